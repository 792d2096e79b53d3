"""compile_ahead's guard on C module loads (runtime.launch._module_loads_one_at_a_time).

CPython serves a second load of a single-phase extension module file from its cache: it returns
the module last registered under the module's name, with the file's functions written into it.
Triton names every kernel's launcher "__triton_launcher", so threads loading launchers at once
can read each other's launch. Here eight tiny modules of that name, each returning its own
number, are loaded again and again by eight threads; under the guard every load must hand back
its own function. (Needs a C compiler and Python's headers; skipped without them.)"""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

SOURCE = """
#include <Python.h>
static PyObject* launch(PyObject* self, PyObject* args) { return PyLong_FromLong(%d); }
static PyMethodDef methods[] = {{"launch", launch, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "__triton_launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit___triton_launcher(void) { return PyModule_Create(&def); }
"""

RACE = """
import random, sys, sysconfig
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, {root!r})
import triton.runtime.build as build
from flash_dma.runtime.launch import _module_loads_one_at_a_time
paths = {paths!r}
for n, path in paths.items():  # first loads: every load below is a second one
    assert build._load_module_from_path("__triton_launcher", path).launch() == n
sys.setswitchinterval(1e-6)

def loads(seed):
    rng, wrong = random.Random(seed), 0
    for _ in range(3000):
        n = rng.choice(list(paths))
        wrong += build._load_module_from_path("__triton_launcher", paths[n]).launch() != n
    return wrong

with _module_loads_one_at_a_time(), ThreadPoolExecutor(8) as pool:
    print(sum(pool.map(loads, range(8))))
assert build._load_module_from_path.__name__ == "_load_module_from_path"  # the guard is lifted
"""


def test_parallel_second_loads_keep_their_own_functions(tmp_path):
    pytest.importorskip("triton")
    compiler = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if compiler is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("no C compiler or Python headers here")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    paths = {}
    for n in range(1, 9):
        folder = tmp_path / f"m{n}"
        folder.mkdir()
        (folder / "m.c").write_text(SOURCE % n)
        paths[n] = str(folder / f"__triton_launcher{suffix}")
        try:
            subprocess.run([compiler, "-shared", "-fPIC", f"-I{include}", str(folder / "m.c"), "-o", paths[n]],
                           check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"the C compiler does not build an extension module here: {exc.stderr[-300:]!r}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "race.py"
    script.write_text(textwrap.dedent(RACE.format(root=root, paths=paths)))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0", f"loads that handed back another module's launch: {run.stdout}"


def test_overlapping_guards_neither_deadlock_nor_outlive_the_last(monkeypatch):
    """Two compile_ahead blocks open at once (two threads, or one inside the other): a load inside
    both goes through one lock (no deadlock), and Triton's loader comes back when the last one
    closes, whichever closes first."""
    import threading
    import types

    build = pytest.importorskip("triton.runtime.build")
    from flash_dma.runtime.launch import _module_loads_one_at_a_time

    def real(name, path):
        module = types.ModuleType(name)
        module.path = path
        return module
    monkeypatch.setattr(build, "_load_module_from_path", real)
    loaded = []

    def nested_then_load():
        outer = _module_loads_one_at_a_time()
        outer.__enter__()
        with _module_loads_one_at_a_time():
            loaded.append(build._load_module_from_path("m", "p").path)
            outer.__exit__(None, None, None)  # the first opened closes first
            assert build._load_module_from_path is not real  # still guarded for the inner one
    thread = threading.Thread(target=nested_then_load, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a load inside two open guards deadlocked"
    assert loaded == ["p"]
    assert build._load_module_from_path is real


def test_compile_ahead_guards_its_loads(monkeypatch):
    """compile_ahead installs the guard for its whole block and takes it away after."""
    build = pytest.importorskip("triton.runtime.build")
    from flash_dma.runtime.launch import compile_ahead

    def real(name, path):
        raise AssertionError("not called here")
    monkeypatch.setattr(build, "_load_module_from_path", real)
    with compile_ahead(workers=1):
        assert build._load_module_from_path is not real
    assert build._load_module_from_path is real
