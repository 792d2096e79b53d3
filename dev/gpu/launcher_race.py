"""Builds Triton launchers (the C modules Triton loads as "__triton_launcher") for kernels of 1 to
24 pointer arguments in 16 parallel threads and checks that each loaded module's launch takes its
own arity (a launcher of another kernel raises "function takes exactly N arguments"). Needs a
CUDA machine (the launchers link libcuda).

    python dev/gpu/launcher_race.py [lock]          # empty cache: builds and loads overlap
    python dev/gpu/launcher_race.py warm [lock] [again] [N]
        builds once, then N fresh processes each load all 24 from the warm cache at once (again:
        each process loads all 24 one by one first, so the parallel loads are second loads)
lock: module loads one at a time, each handing back its own functions (runtime.launch's guard).
"""
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())

import triton.runtime.build as build  # noqa: E402
from triton.backends.nvidia import driver as nv  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from flash_dma.runtime.launch import _module_loads_one_at_a_time  # noqa: E402

FIXED_ARGS = 13  # grid, stream, function, metadata, hooks, scratch: the launch's own arguments


def build_one(n: int):
    """(n, the arity the loaded launcher reports, or None if it accepted no arguments)."""
    src = nv.make_launcher({}, {i: "*fp32" for i in range(n)}, None)
    mod = build.compile_module_from_src(src=src, name="__triton_launcher", library_dirs=nv.library_dirs(),
                                        include_dirs=nv.include_dirs, libraries=nv.libraries)
    try:
        mod.launch()
    except TypeError as e:
        found = re.search(r"exactly (\d+) arguments", str(e))
        return n, int(found.group(1)) if found else str(e)
    return n, None


def load_all(locked: bool) -> list:
    guard = _module_loads_one_at_a_time() if locked else contextlib.nullcontext()
    barrier = threading.Barrier(16)

    def at_once(n):
        if n <= 16:
            barrier.wait()
        return build_one(n)
    with guard, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(at_once, range(1, 25)))
    return [(n, arity) for n, arity in results if arity != n + FIXED_ARGS]


def main():
    args = sys.argv[1:]
    locked = "lock" in args
    label = "locked" if locked else "parallel"
    if "child" in args:
        if "again" in args:  # every launcher loaded once, then all again at once: CPython finds
            for n in range(1, 25):  # each in its extension cache the second time
                build_one(n)
        print(len(load_all(locked)))
        return
    if "warm" not in args:
        wrong = load_all(locked)
        print(f"{label} loads, empty cache: 24 launchers, wrong arity: {wrong or 'none'}")
        return
    rounds = int(next((a for a in args if a.isdigit()), "40"))
    for n in range(1, 25):  # warm the cache in this process, one at a time
        build_one(n)
    child = [sys.executable, __file__, "child"] + (["lock"] if locked else []) + (["again"] if "again" in args else [])
    bad = 0
    for _ in range(rounds):
        out = subprocess.run(child, capture_output=True, text=True, env=os.environ)
        bad += int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
        if out.returncode != 0:
            print(out.stderr[-500:])
    print(f"{label} loads, warm cache: {rounds} processes x 24 launchers, wrong arity: {bad}")


if __name__ == "__main__":
    main()
