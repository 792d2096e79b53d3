"""Kernel launches with less host time per call.

`kernel[grid](*args, **kwargs)` spends most of its ~40 us (H200 host, Triton 3.6) deciding which
compiled variant to run: binding 50-70 arguments, specialising each one, hashing the result.
Small problems (a sparse attention call, a short sequence of the delta rule, the ten launches
of its forward and backward) are then bound by the host, not the GPU.

`launch` remembers, per call signature, the compiled kernel Triton chose and launches it
directly the next time. The signature is everything Triton's choice depends on, taken
conservatively: each tensor's dtype and 16-byte alignment, the exact value of every integer,
the type of every other scalar, each descriptor's dtype, alignment, block shape, shape and
strides, the keyword arguments (constexprs and launch options) and the device. A signature not
seen before goes through Triton's own launch path, which compiles as usual.

`compile_ahead` serves an op's first call on new compile-time constants: inside it, launch()
compiles and loads kernels in a thread pool instead of running them, so a dry run of the op's
forward and backward there readies all their kernels in parallel (the gated delta rule's first
fwd+bwd on an empty Triton cache, H200 host: 10.1-13.2 -> 5.1-7.2 s; bench/first_call_gdn.py).

Used only where verified: Triton 3.6 (the internals read here are not a stable API), on a GPU,
not in the interpreter, and not when FLASH_DMA_FAST_LAUNCH=0.
"""
from __future__ import annotations

import os
import threading
import types
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .hardware import interpreter_active

_VERIFIED_TRITON = ("3.6.",)
_MAX_ENTRIES = 512  # signatures remembered per process (the oldest dropped first)


def fast_launch_enabled() -> bool:
    return (triton.__version__.startswith(_VERIFIED_TRITON) and not interpreter_active()
            and os.environ.get("FLASH_DMA_FAST_LAUNCH", "1") != "0")


class _Unkeyable(Exception):
    """An argument whose effect on Triton's choice we do not model: use Triton's path."""


_TENSOR = torch.Tensor


def _arg_key(a):
    """The key of an argument that is not a plain tensor, int or None (signature_key's loop
    handles those inline: this runs per argument of every launch)."""
    kind = type(a)
    if kind is bool:
        return bool, a  # Triton types a bool i1 and an int i32 or i64: True must not be 1
    if kind is float:
        return float
    if isinstance(a, _TENSOR):  # subclasses (nn.Parameter)
        return a.dtype, a.data_ptr() % 16 == 0
    if kind is TensorDescriptor:
        return (a.base.dtype, a.base.data_ptr() % 16 == 0, tuple(a.block_shape), tuple(a.shape),
                tuple(a.strides), a.padding)
    raise _Unkeyable


def signature_key(kernel, args: tuple, kwargs: dict, device: int):
    """What Triton's choice of compiled variant depends on, for this call (see module doc)."""
    parts = []
    append = parts.append
    for a in args:
        kind = type(a)
        if kind is _TENSOR:
            append((a.dtype, a.data_ptr() % 16 == 0))
        elif kind is int or a is None:
            append(a)
        else:
            append(_arg_key(a))
    return id(kernel), device, tuple(parts), tuple(kwargs.items())


class _Entry:
    __slots__ = ("compiled", "tail", "direct", "cooperative", "pdl")

    def __init__(self, compiled, tail: tuple):
        self.compiled = compiled
        self.tail = tail  # the constexpr values after the positional arguments, in order
        # Triton's launcher object wraps the C launch in Python that only allocates scratch
        # memory: where the kernel needs none, the C launch is called directly.
        launcher = compiled.run
        plain = (getattr(launcher, "global_scratch_size", 1) == 0
                 and getattr(launcher, "profile_scratch_size", 1) == 0 and hasattr(launcher, "launch"))
        self.direct = launcher.launch if plain else None
        self.cooperative = getattr(launcher, "launch_cooperative_grid", None)
        self.pdl = getattr(launcher, "launch_pdl", None)


_ENTRIES: OrderedDict = OrderedDict()
_ENABLED: bool | None = None


def _constexpr_tail(kernel, args: tuple, kwargs: dict) -> tuple | None:
    """Values of the parameters after the positional ones, if all of them are constexprs given
    as keywords or by default (then the compiled kernel takes args + these); else None."""
    params = kernel.params
    tail = []
    for p in params[len(args):]:
        if not p.is_constexpr:
            return None
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


# Inside compile_ahead, in the thread that entered it (other threads launch as usual): the
# (kernel, device) pairs to load once compiled.
_AHEAD = threading.local()


def compile_ahead_enabled() -> bool:
    """Where compile_ahead works as verified (as fast launches); FLASH_DMA_COMPILE_AHEAD=0 turns
    it off."""
    return fast_launch_enabled() and os.environ.get("FLASH_DMA_COMPILE_AHEAD", "1") != "0"


@contextmanager
def compile_ahead(workers: int | None = None):
    """Inside, launch() runs nothing: it hands each kernel's compilation to a thread pool
    (Triton's AsyncCompileMode). On exit every kernel is compiled, then loaded (_load_ahead), in
    the same pool, so a dry run of an op inside makes its first real call find its kernels
    ready, made in parallel rather than one after another (Triton's compiler and the host
    compiler it runs release the GIL for most of their work)."""
    pending: list = []
    with _module_loads_one_at_a_time(), ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as pool:
        with triton.AsyncCompileMode(pool):
            _AHEAD.pending = pending
            try:
                yield
            finally:
                _AHEAD.pending = None
        # once per compiled kernel: a kernel launched twice in the dry run is listed twice, and
        # two threads initialising one kernel's handles at once race in Triton 3.6 (one may see
        # the launcher before the binary is loaded; triton-lang/triton PR 11518); module loads
        # one at a time (_module_loads_one_at_a_time)
        unique = {}
        for compiled, device in pending:
            unique.setdefault(id(compiled), (compiled, device))  # the first device: where Triton caches it
        for compiled, device in unique.values():
            pool.submit(_load_ahead, compiled, device)


_MODULE_LOAD_LOCK = threading.Lock()
_GUARD_LOCK = threading.Lock()  # guards the two below
_GUARD_USERS = 0  # compile_ahead blocks open now, in any thread
_GUARD_REAL = None  # Triton's own loader while the guard is installed


@contextmanager
def _module_loads_one_at_a_time():
    """While the pool loads kernels, Triton's C modules (each kernel's launcher) load one at a time,
    each handing back a copy of its own namespace. A launcher's module is single-phase, so
    CPython serves a second load of its file (two kernels of one launch signature) from its
    extension cache: it returns the module last registered under the shared name
    "__triton_launcher" (another kernel's) with this file's functions written into it. Two such
    loads at once could each read the other's launch (a launcher of the wrong arity at the first
    real launch). Builds (the host compiler) still run side by side. Installed once for all
    blocks open at a time (threads may enter compile_ahead together): the first in installs it,
    the last out restores Triton's loader."""
    global _GUARD_USERS, _GUARD_REAL
    try:
        from triton.runtime import build
    except ImportError:
        build = None
    with _GUARD_LOCK:
        if _GUARD_USERS == 0:
            real = getattr(build, "_load_module_from_path", None)
            if real is None:  # another Triton layout: nothing to guard
                build = None
            else:
                _GUARD_REAL = real

                def load(name, path):
                    with _MODULE_LOAD_LOCK:
                        module = real(name, path)
                        own = types.ModuleType(module.__name__)
                        own.__dict__.update(module.__dict__)
                        return own
                build._load_module_from_path = load
        if build is not None:
            _GUARD_USERS += 1
    if build is None:
        yield
        return
    try:
        yield
    finally:
        with _GUARD_LOCK:
            _GUARD_USERS -= 1
            if _GUARD_USERS == 0:
                build._load_module_from_path, _GUARD_REAL = _GUARD_REAL, None


def _load_ahead(compiled, device: int) -> None:
    """What Triton would otherwise do at a kernel's first launch: build its launcher (a C module
    compiled with the host's C compiler, about half a second per kernel signature on an empty
    cache) and load the binary onto the GPU. An error here (a kernel that does not fit) is left
    for the real launch to raise."""
    if hasattr(compiled, "result"):  # a FutureKernel, finished by now
        compiled = compiled.result(ignore_errors=True)
    if compiled is not None:
        with torch.cuda.device(device):
            compiled._init_handles()


def _hooked(hook) -> bool:
    """Whether a launch hook will run: Triton 3.6 keeps its hooks as chains (never None), and the
    launch metadata it builds for them is only read by a hook in the chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), remembering Triton's choice of compiled kernel."""
    global _ENABLED
    pending = getattr(_AHEAD, "pending", None)
    if pending is not None:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        if compiled is not None:
            pending.append((compiled, triton.runtime.driver.active.get_current_device()))
        return
    if _ENABLED is None:
        _ENABLED = fast_launch_enabled()
    if not _ENABLED:
        if interpreter_active():
            _interpret(kernel, grid, args, kwargs)
        else:
            kernel[grid](*args, **kwargs)
        return
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    try:
        key = signature_key(kernel, args, kwargs, device)
        entry = _ENTRIES.get(key)
    except (_Unkeyable, TypeError):  # TypeError: an unhashable keyword value
        kernel[grid](*args, **kwargs)
        return
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)  # Triton's own path: compiles, specialises, launches
        if hasattr(compiled, "result"):  # (asynchronous compilation hands back a future)
            compiled = compiled.result()
        tail = _constexpr_tail(kernel, args, kwargs)
        if compiled is not None and tail is not None:
            _ENTRIES[key] = _Entry(compiled, tail)
            if len(_ENTRIES) > _MAX_ENTRIES:
                _ENTRIES.popitem(last=False)
        return
    compiled = entry.compiled
    stream = driver.get_current_stream(device)
    hooks = triton.knobs.runtime
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    full = args + entry.tail
    if _hooked(enter) or _hooked(leave):
        metadata = compiled.launch_metadata(grid, stream, *full)
    else:  # no hook to run: the C launch then calls none (it skips None hooks)
        metadata = enter = leave = None
    n = len(grid)
    if entry.direct is not None:
        entry.direct(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     entry.cooperative, entry.pdl, None, None, compiled.packed_metadata, metadata, enter, leave,
                     *full)
    else:
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, metadata, enter, leave, *full)


def _interpret(kernel, grid, args, kwargs) -> None:
    """In Triton's interpreter the kernels run as numpy code, which warns in the user's program
    about the interpreter's own workings: the logarithm of an empty row's zero sum (-inf, as
    intended) and the interpreter's conversion of one-element arrays to indices. Silence exactly
    those."""
    import warnings

    import numpy
    with numpy.errstate(divide="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Conversion of an array with ndim > 0",
                                category=DeprecationWarning)
        kernel[grid](*args, **kwargs)


def forget() -> None:
    """Drop every remembered signature (tests; after changing FLASH_DMA_FAST_LAUNCH)."""
    global _ENABLED
    _ENTRIES.clear()
    _ENABLED = None
