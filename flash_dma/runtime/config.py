"""Launch configuration: block sizes, warps and pipeline depth for each kernel.

Chosen from, in order:
  1. the persistent tuning cache (filled by `tune`, i.e. by a sweep on this very GPU),
  2. defaults measured on Hopper (H100/H200) for the architecture and head dim,
  3. a generic rule that shrinks tiles until they fit the device's shared memory.
In Triton's CPU interpreter small tiles are used so that small test shapes still cross blocks.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable

import torch
import triton

from . import tuning_cache
from .hardware import DeviceInfo, device_info, interpreter_active


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
_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("flash_dma_overrides", default={})


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
    token = _OVERRIDES.set({**_OVERRIDES.get(), **choices})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def overridden(name: str) -> Any | None:
    """The override in force for a choice or a kernel's launch configuration, else None."""
    return _OVERRIDES.get().get(name)


def active_overrides() -> dict:
    """Every override in force (empty outside `overrides`): ops that memoise their plans build
    them afresh while it is not empty."""
    return _OVERRIDES.get()


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


# Hopper defaults, keyed by (kernel, padded head dim), or (kernel, padded head dim, variant) where
# the variant ("bias" or "plain"; "-dq" when the key-major kernel also adds up dq; "-list" when
# it walks block lists; "-full" when those list every tile of a problem without mask or causal
# rule; "-dbtma" when dbias goes out by TMA stores) changes the winner; a variant without an entry
# takes its longest listed prefix's. From the sweeps of bench/tune_attention.py on an H200,
# 2026-11-21 (bench/results/tune-*.json; the "-dq" ones: dq-strategy-H200-20261121.txt). The
# key-major backward is register-bound: at head dim 128 its two fp32 accumulators fill the
# register file unless the key tile stays small.
_HOPPER_DEFAULTS: dict[tuple, LaunchConfig] = {
    ("attn_fwd", 16): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 32): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 64): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 128): LaunchConfig(128, 64, 8, 3),
    # no mask and no bias: 128-key tiles, 3 stages (no bias tile to stage): B4 H16 S4096 1.143 ->
    # 1.100 ms, causal 0.655 -> 0.615 (H200, bench/results/s12-probes-H200-20261122.txt); with a
    # mask the walks keep 64-key tiles (finer skipping), at D64 128 keys lost (0.663 -> 0.764)
    ("attn_fwd", 128, "plain-dense"): LaunchConfig(128, 128, 8, 3),
    ("attn_fwd", 256): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dkdv", 16): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 32): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 64): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 64, "bias"): LaunchConfig(64, 64, 4, 3),
    ("attn_bwd_dkdv", 64, "plain-dq"): LaunchConfig(32, 128, 4, 2),
    ("attn_bwd_dkdv", 128): LaunchConfig(32, 128, 8, 2),
    # 64-query tiles with 3 stages won at B4 H16 S4096 (4.297 -> 4.132 ms) but lost by 47-57% at
    # S1024, S8192, GQA and B1 H32 in the same session (H200, s12 probes): register-bound on a knife
    # edge, they spill where the compiled variant differs a little. Kept at 32.
    ("attn_bwd_dkdv", 128, "plain-dq"): LaunchConfig(32, 128, 8, 3),
    ("attn_bwd_dkdv", 128, "bias-dq"): LaunchConfig(32, 128, 8, 3),
    # dbias by TMA stores: 64-query tiles (2.781 -> 2.552 ms at B2 H16 S4096 with the stores;
    # without them these tiles gained 1%; H200, bench/results/s13-probes-H200-20261122.txt)
    ("attn_bwd_dkdv", 128, "bias-dbtma"): LaunchConfig(64, 128, 8, 2),
    # block lists ("-list"): 64-query tiles, which spill in the dense walk (B4 H16 S4096: 6.3 ms
    # vs 4.1), measured 1.97 vs 2.43 ms with every tile listed, 0.32 vs 0.37 with 1/8 (H200, s7)
    ("attn_bwd_dkdv", 128, "plain-dq-list"): LaunchConfig(64, 128, 8, 2),
    # no mask, not causal ("-full": every listed tile whole, as long as the lists): 3 stages, B4 H16
    # S4096 4.085 -> 3.900 ms, B2 H16 S8192 7.980 -> 7.481, B1 H32 S2048 -4%, B8 H16 S1000 -3%;
    # causal lost (2.197 -> 2.321: shorter lists), so did D64 and the masked walks (H200,
    # bench/results/s13-probes-H200-20261122.txt)
    ("attn_bwd_dkdv", 128, "plain-dq-list-full"): LaunchConfig(64, 128, 8, 3),
    ("attn_bwd_dkdv", 256): LaunchConfig(32, 64, 8, 2),
    ("attn_bwd_dq", 16): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 32): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 64): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 128): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 256): LaunchConfig(64, 32, 4, 3),
}


def estimate_shared_memory(kernel: str, cfg: LaunchConfig, block_d: int, elem_bytes: int,
                           bias_bytes: int = 4) -> int:
    """Rough bytes of shared memory a configuration needs (operands staged per pipeline stage).
    bias_bytes: the element size of the bias tile staged beside them, 0 where there is none."""
    m, n, s = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    bias_tile = m * n * bias_bytes
    if kernel == "attn_fwd":  # Q resident, K and V streamed
        return m * block_d * elem_bytes + s * (2 * n * block_d * elem_bytes + bias_tile)
    if kernel == "attn_bwd_dkdv":  # K, V resident, Q and dO streamed
        return 2 * n * block_d * elem_bytes + s * (2 * m * block_d * elem_bytes + bias_tile)
    return 2 * m * block_d * elem_bytes + s * (2 * n * block_d * elem_bytes + bias_tile)


def _fit_to_device(kernel: str, cfg: LaunchConfig, info: DeviceInfo, block_d: int,
                   elem_bytes: int, bias_bytes: int) -> LaunchConfig:
    budget = info.shared_memory_per_block
    while estimate_shared_memory(kernel, cfg, block_d, elem_bytes, bias_bytes) > budget:
        if cfg.num_stages > 1:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif max(cfg.block_m, cfg.block_n) > 16:
            if cfg.block_m >= cfg.block_n:
                cfg = replace(cfg, block_m=cfg.block_m // 2)
            else:
                cfg = replace(cfg, block_n=cfg.block_n // 2)
        else:
            break
    return cfg


def _variant_chain(variant: str) -> list[str]:
    """The variant and its shorter prefixes, most specific first:
    "plain-dq-list" -> ["plain-dq-list", "plain-dq", "plain"]."""
    parts = variant.split("-") if variant else []
    return ["-".join(parts[:i]) for i in range(len(parts), 0, -1)]


def default_config(kernel: str, info: DeviceInfo, block_d: int, elem_bytes: int = 2,
                   variant: str = "") -> LaunchConfig:
    d = min(block_d, 256)
    cfg = _HOPPER_DEFAULTS[(kernel, d)]
    for narrower in _variant_chain(variant):
        if (kernel, d, narrower) in _HOPPER_DEFAULTS:
            cfg = _HOPPER_DEFAULTS[(kernel, d, narrower)]
            break
    if not info.is_hopper:
        # Older or other GPUs: fewer stages by default; then make sure the tiles fit.
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2), warp_specialize=False)
    return _fit_to_device(kernel, cfg, info, block_d, elem_bytes,
                          variant_bias_bytes(kernel, variant, elem_bytes))


def variant_bias_bytes(kernel: str, variant: str, elem_bytes: int) -> int:
    """Bytes per element of the bias tile a variant stages: none for "plain...", the inputs' size
    for the forward's "bias" (it names an fp32 bias "bias-fp32"), else 4 (the most)."""
    if variant.startswith("plain"):
        return 0
    return elem_bytes if kernel == "attn_fwd" and variant == "bias" else 4


def cache_key(kernel: str, info: DeviceInfo, block_d: int, dtype: torch.dtype, variant: str) -> str:
    return f"{info.name}|sm{info.arch}|triton{triton.__version__}|{kernel}|d{block_d}|{dtype}|{variant}"


def select_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                  variant: str = "") -> LaunchConfig:
    if interpreter_active() or device.type != "cuda":
        return INTERPRETER_CONFIG
    return _select_cuda_config(kernel, device, head_dim, dtype, variant)


@remember_until_retuned
def _select_cuda_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                        variant: str) -> LaunchConfig:
    info = device_info(device)
    block_d = head_dim_block(head_dim)
    hit = tuning_cache.lookup(cache_key(kernel, info, block_d, dtype, variant))
    if hit is not None:
        return LaunchConfig(**hit)
    return default_config(kernel, info, block_d, dtype.itemsize, variant)


def candidate_configs(kernel: str, block_d: int) -> list[LaunchConfig]:
    """The sweep space for `tune`: tile shapes Hopper can hold at this head dim."""
    out = []
    for bm in (32, 64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    cfg = LaunchConfig(bm, bn, warps, stages)
                    if estimate_shared_memory(kernel, cfg, block_d, 2) <= 228 * 1024:
                        out.append(cfg)
    return out


def tune(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype, variant: str,
         time_config: Callable[[LaunchConfig], float],
         candidates: Iterable[LaunchConfig] | None = None) -> LaunchConfig:
    """Time each candidate with `time_config` (milliseconds), remember the fastest.

    The winner goes to the persistent cache, every timing to the profiling log. Candidates that
    fail to compile or launch (too much shared memory, too many registers) are skipped.
    """
    info = device_info(device)
    block_d = head_dim_block(head_dim)
    key = cache_key(kernel, info, block_d, dtype, variant)
    best, best_ms = None, math.inf
    for cfg in candidates if candidates is not None else candidate_configs(kernel, block_d):
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
    tuning_cache.store(key, {**asdict(best)})
    return best
