"""Builds Triton launchers (the C modules Triton loads as "__triton_launcher") for kernels of 1 to
24 pointer arguments in 16 parallel threads, on an empty cache, and checks that each loaded
module's launch takes its own arity (a launcher of another kernel raises "function takes exactly
N arguments"). Needs a CUDA machine (the launchers link libcuda).

    python dev/gpu/launcher_race.py [lock]     # lock: module loads one at a time
"""
import os
import re
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()

import triton.runtime.build as build  # noqa: E402
from triton.backends.nvidia import driver as nv  # noqa: E402

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


def main():
    locked = sys.argv[1:] == ["lock"]
    if locked:
        real, lock = build._load_module_from_path, threading.Lock()

        def load(name, path):
            with lock:
                return real(name, path)
        build._load_module_from_path = load
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(build_one, range(1, 25)))
    wrong = [(n, arity) for n, arity in results if arity != n + FIXED_ARGS]
    print(f"{'locked' if locked else 'parallel'} loads: {len(results)} launchers, wrong arity: {wrong or 'none'}")


if __name__ == "__main__":
    main()
