"""Launch configuration, generic pieces: the LaunchConfig record, where a choice came from
(Chosen), the one way to override a choice (overrides), and the tuning sweep that fills the
persistent tuning cache.

Each op keeps its own table and its selection order beside its kernels (attention:
ops/dynamic_mask_attention/launch_table.py; the gated delta rule: ops/gated_delta_rule/launch_table.py),
and its sweep candidates in tune.py beside it (flash-dma tune).
In Triton's CPU interpreter small tiles are used so that small test shapes still cross blocks.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Callable, Iterable

import torch
import triton

from . import tuning_cache
from .hardware import DeviceInfo, device_info


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # Triton's automatic warp specialisation of the main loop
    exp2_poly: bool = False  # half of the softmax exponentials on the FMA pipe (triton_math.py)


INTERPRETER_CONFIG = LaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def config_name(cfg: LaunchConfig) -> str:
    """A configuration as the profiling log names it: BM64_BN128_W8_S2 (+ _WS, _POLY)."""
    name = f"BM{cfg.block_m}_BN{cfg.block_n}_W{cfg.num_warps}_S{cfg.num_stages}"
    return name + ("_WS" if cfg.warp_specialize else "") + ("_POLY" if cfg.exp2_poly else "")


@dataclass(frozen=True)
class Chosen:
    """A launch choice and where it came from: "table" (defaults measured on Hopper), "tuning
    cache" (a sweep on this GPU), "rule" (fitted to this device's shared memory, or derived from
    the problem), "override" (config.overrides) or "interpreter" (small tiles on the CPU)."""
    value: Any
    source: str


# ------------------------------------------------------------------------------------------------
# Overrides: the one way tests and benchmarks change a choice (never module globals)
# ------------------------------------------------------------------------------------------------
_DECLARED: dict[str, tuple[Any, tuple, str]] = {}
# Process-wide, not a ContextVar: autograd runs a CUDA backward on its own worker threads, which
# would not see a context variable set by the caller, so backward plans would ignore overrides.
_OVERRIDES: list[dict] = [{}]
_OVERRIDES_LOCK = threading.Lock()


def declare_choice(name: str, default: Any, allowed: Iterable[Any], doc: str) -> None:
    """Ops declare each strategy choice they read through `choice`, so that `overrides` can
    refuse a misspelt name or a value the op does not know."""
    _DECLARED[name] = (default, tuple(allowed), doc)


def declared_choices() -> dict[str, tuple[Any, tuple, str]]:
    return dict(_DECLARED)


@contextlib.contextmanager
def overrides(**choices):
    """Inside, each named choice takes the given value instead of the op's own rule, e.g.
    `with config.overrides(attention_dq_strategy="kernel"): ...`. A launch configuration is
    overridden by its kernel name with a LaunchConfig (`attn_fwd=LaunchConfig(64, 64, 4, 2)`).
    Plans built inside carry source="override" for what was overridden."""
    for name, value in choices.items():
        if isinstance(value, LaunchConfig):
            continue
        if name not in _DECLARED:
            raise ValueError(f"overrides: unknown choice {name!r}; known: {sorted(_DECLARED)}")
        allowed = _DECLARED[name][1]
        if allowed and value not in allowed:
            raise ValueError(f"overrides: {name} must be one of {allowed}, got {value!r}")
    with _OVERRIDES_LOCK:
        _OVERRIDES.append({**_OVERRIDES[-1], **choices})
        mine = _OVERRIDES[-1]
    try:
        yield
    finally:
        with _OVERRIDES_LOCK:
            del _OVERRIDES[next(i for i, d in enumerate(_OVERRIDES) if d is mine)]


def parse_overrides(text: str) -> dict:
    """Choice overrides written "name=value,name=value" (True/False for flags, digits for
    counts), as the bench and diagnosis scripts take them, -> keyword arguments for `overrides`."""
    flags = {"True": True, "False": False}

    def value_of(text: str):
        text = text.strip()
        return flags[text] if text in flags else int(text) if text.isdecimal() else text

    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {name.strip(): value_of(value) for name, value in pairs}


def overridden(name: str) -> Any | None:
    """The override in force for a choice or a kernel's launch configuration, else None."""
    return _OVERRIDES[-1].get(name)


def active_overrides() -> dict:
    """Every override in force (empty outside `overrides`): ops that memoise their plans build
    them afresh while it is not empty."""
    return _OVERRIDES[-1]


def choice(name: str) -> Chosen:
    """A declared strategy choice: its override, else its default."""
    value = overridden(name)
    if value is not None:
        return Chosen(value, "override")
    return Chosen(_DECLARED[name][0], "table")


def head_dim_block(head_dim: int) -> int:
    """Head dims are padded to a power of two (at least 16) inside the kernels. (Plain integer
    arithmetic: this runs on every call, and triton.next_power_of_2 goes through Triton's JIT
    dispatch.)"""
    return max(16, 1 << (head_dim - 1).bit_length())


def ceil_div(n: int, d: int) -> int:
    """Grid sizes on the hot path (triton.cdiv goes through Triton's JIT dispatch)."""
    return -(-n // d)


def remember_until_retuned(choose: Callable) -> Callable:
    """Memoise a launch-configuration choice on its (hashable) arguments, until the tuning cache
    changes. The choice runs on every call of every op, and a host that launches small problems
    spends as long choosing as the GPU spends computing."""
    memo: dict = {}
    seen = [tuning_cache.generation()]

    @functools.wraps(choose)
    def chosen(*args):
        if seen[0] != tuning_cache.generation():
            memo.clear()
            seen[0] = tuning_cache.generation()
        try:
            return memo[args]
        except KeyError:
            memo[args] = result = choose(*args)
            return result

    chosen.cache_clear = memo.clear
    return chosen


def cache_key(kernel: str, info: DeviceInfo, block_d: int, dtype: torch.dtype, variant: str) -> str:
    return f"{info.name}|sm{info.arch}|triton{triton.__version__}|{kernel}|d{block_d}|{dtype}|{variant}"


def stored_fields(cfg) -> dict:
    """A configuration as the tuning cache stores it: its fields, less those at their defaults,
    so that a field added later (with a default) neither enters entries that older versions of
    the package read nor changes what they mean."""
    values = asdict(cfg)
    return {f.name: values[f.name] for f in fields(cfg)
            if f.default is MISSING or values[f.name] != f.default}


def tune(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype, variant: str,
         time_config: Callable[[LaunchConfig], float],
         candidates: Iterable[LaunchConfig], key: str | None = None) -> LaunchConfig:
    """Time each candidate with `time_config` (milliseconds), remember the fastest.

    The winner goes to the persistent cache, every timing to the profiling log. Candidates that
    fail to compile or launch (too much shared memory, too many registers) are skipped.
    key: the cache key the op's launch table looks the winner up by (the delta rule keys its
    passes its own way); by default `cache_key` of the other arguments.
    """
    if key is None:
        key = cache_key(kernel, device_info(device), head_dim_block(head_dim), dtype, variant)
    best, best_ms = None, math.inf
    for cfg in candidates:
        try:
            ms = time_config(cfg)
        except Exception as exc:  # noqa: BLE001 - resource errors differ by Triton version
            tuning_cache.log_profile({"key": key, "config": asdict(cfg), "error": type(exc).__name__})
            continue
        tuning_cache.log_profile({"key": key, "config": asdict(cfg), "ms": ms})
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no candidate configuration ran for {key}")
    tuning_cache.store(key, stored_fields(best))
    return best
