"""Attention's launch table: block sizes, warps and pipeline depth of each Triton kernel.

    kernel           file                          table key
    attn_fwd         triton/forward.py             ("attn_fwd", padded D[, variant])
    attn_bwd_dkdv    triton/backward_dkdv.py       ("attn_bwd_dkdv", padded D[, variant])
    attn_bwd_dq      triton/backward_dq.py         ("attn_bwd_dq", padded D[, variant])
(the delta pass of triton/backward_preprocess.py and the dq scale-cast take fixed blocks, set in
plan.py.)

A configuration is chosen, in order, from: an override (runtime.config.overrides(attn_fwd=
LaunchConfig(...))), the persistent tuning cache (a sweep on this very GPU: `flash-dma tune attention`, tune.py beside this file),
this table (measured on Hopper), then fitted to the device's shared memory ("rule" where that
changed it). Triton's CPU interpreter takes small tiles so that small test shapes cross blocks.
select_config returns a runtime.config.Chosen naming that source; the plan carries it and the
profiling log (FLASH_DMA_PROFILE=1) prints it.

Variants: the table key may carry a variant (built by plan.py in one place) where it changes the
winner: "bias" or "plain" (the forward also "bias-fp32" and "plain-dense": no mask, no bias);
for the key-major kernel "-dbtma" (dbias by TMA stores), "-dq" (it also adds dq), "-list" (it
walks block lists), "-full" (those list every tile: no mask, not causal). A variant without an
entry takes its longest listed prefix's.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...runtime import config, tuning_cache
from ...runtime.config import Chosen, LaunchConfig, head_dim_block, remember_until_retuned
from ...runtime.hardware import DeviceInfo, device_info, interpreter_active

KERNELS = ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")

# Hopper defaults, from the sweeps of bench/tune_attention.py and the A/B probes recorded in
# docs/perf/attention.md. The key-major backward is register-bound: at head dim 128
# its two fp32 accumulators fill the register file unless the key tile stays small.
HOPPER_TABLE: dict[tuple, LaunchConfig] = {
    ("attn_fwd", 16): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 32): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 64): LaunchConfig(128, 64, 4, 3),
    ("attn_fwd", 128): LaunchConfig(128, 64, 8, 3),
    # no mask and no bias: 128-key tiles and 3 stages (no bias tile to stage); with a mask the
    # walks keep 64-key tiles, which skip at a finer grain
    ("attn_fwd", 128, "plain-dense"): LaunchConfig(128, 128, 8, 3),
    ("attn_fwd", 256): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dkdv", 16): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 32): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 64): LaunchConfig(64, 64, 4, 2),
    ("attn_bwd_dkdv", 64, "bias"): LaunchConfig(64, 64, 4, 3),
    ("attn_bwd_dkdv", 64, "plain-dq"): LaunchConfig(32, 128, 4, 2),
    ("attn_bwd_dkdv", 128): LaunchConfig(32, 128, 8, 2),
    # 64-query tiles with 3 stages won at one shape and lost badly at others (register-bound on a
    # knife edge: they spill where the compiled variant differs a little): kept at 32
    ("attn_bwd_dkdv", 128, "plain-dq"): LaunchConfig(32, 128, 8, 3),
    ("attn_bwd_dkdv", 128, "bias-dq"): LaunchConfig(32, 128, 8, 3),
    # dbias by TMA stores: 64-query tiles (with pointer stores these tiles gained little)
    ("attn_bwd_dkdv", 128, "bias-dbtma"): LaunchConfig(64, 128, 8, 2),
    # block lists: 64-query tiles, which spill in the dense walk but not in the list walk
    ("attn_bwd_dkdv", 128, "plain-dq-list"): LaunchConfig(64, 128, 8, 2),
    # every tile listed and whole: 3 stages (lost where causal lists are shorter, at D64, and in
    # the masked walks)
    ("attn_bwd_dkdv", 128, "plain-dq-list-full"): LaunchConfig(64, 128, 8, 3),
    ("attn_bwd_dkdv", 256): LaunchConfig(32, 64, 8, 2),
    ("attn_bwd_dq", 16): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 32): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 64): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 128): LaunchConfig(128, 64, 8, 2),
    ("attn_bwd_dq", 256): LaunchConfig(64, 32, 4, 3),
}


def estimate_shared_memory(kernel: str, cfg: LaunchConfig, block_d: int, elem_bytes: int,
                           bias_bytes: int = 4, extra_bytes: int = 0) -> int:
    """Rough bytes of shared memory a configuration needs (operands staged per pipeline stage).
    bias_bytes: the element size of the bias tile staged beside them, 0 where there is none;
    extra_bytes: per element of an (m x n) tile staged once (variant_extra_bytes)."""
    m, n, s = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    bias_tile = m * n * bias_bytes
    if extra_bytes:
        return m * n * extra_bytes + estimate_shared_memory(kernel, cfg, block_d, elem_bytes, bias_bytes)
    if kernel == "attn_fwd":  # Q resident, K and V streamed
        return m * block_d * elem_bytes + s * (2 * n * block_d * elem_bytes + bias_tile)
    if kernel == "attn_bwd_dkdv":  # K, V resident, Q and dO streamed
        return 2 * n * block_d * elem_bytes + s * (2 * m * block_d * elem_bytes + bias_tile)
    return 2 * m * block_d * elem_bytes + s * (2 * n * block_d * elem_bytes + bias_tile)


def _fit_to_device(kernel: str, cfg: LaunchConfig, info: DeviceInfo, block_d: int,
                   elem_bytes: int, bias_bytes: int, extra_bytes: int = 0) -> LaunchConfig:
    budget = info.shared_memory_per_block
    while estimate_shared_memory(kernel, cfg, block_d, elem_bytes, bias_bytes, extra_bytes) > budget:
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


def table_entry(kernel: str, block_d: int, variant: str = "") -> LaunchConfig:
    """The table's configuration for a kernel, padded head dim and variant (longest prefix)."""
    d = min(block_d, 256)
    cfg = HOPPER_TABLE[(kernel, d)]
    for narrower in _variant_chain(variant):
        if (kernel, d, narrower) in HOPPER_TABLE:
            return HOPPER_TABLE[(kernel, d, narrower)]
    return cfg


def default_config(kernel: str, info: DeviceInfo, block_d: int, elem_bytes: int = 2,
                   variant: str = "") -> LaunchConfig:
    cfg = table_entry(kernel, block_d, variant)
    if not info.is_hopper:
        # Older or other GPUs: fewer stages by default; then make sure the tiles fit.
        cfg = replace(cfg, num_stages=min(cfg.num_stages, 2), warp_specialize=False)
    return _fit_to_device(kernel, cfg, info, block_d, elem_bytes,
                          variant_bias_bytes(kernel, variant, elem_bytes), variant_extra_bytes(kernel, variant))


def variant_bias_bytes(kernel: str, variant: str, elem_bytes: int) -> int:
    """Bytes per element of the bias tile a variant stages: none for "plain...", the inputs' size
    for the forward's "bias" (it names an fp32 bias "bias-fp32"), else 4 (the most)."""
    if variant.startswith("plain"):
        return 0
    return elem_bytes if kernel == "attn_fwd" and variant == "bias" else 4


def variant_extra_bytes(kernel: str, variant: str) -> int:
    """Per element of an (m x n) tile, what a variant stages once beyond the estimate's operands:
    the key-major backward with an fp32 bias ("-fp32") and a descriptor dbias store ("dbtma")
    stages the fp32 dbias tile and its conversion (the H200 refused such a D128 kernel that the
    estimate without them had fitted: 246272 bytes of shared memory against 232448)."""
    parts = variant.split("-")
    if kernel == "attn_bwd_dkdv" and "fp32" in parts and "dbtma" in parts:
        return 8
    return 0


def select_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                  variant: str = "") -> Chosen:
    """The launch configuration of one attention kernel, with where it came from."""
    forced = config.overridden(kernel)
    if forced is not None:
        return Chosen(forced, "override")
    if interpreter_active() or device.type != "cuda":
        return Chosen(config.INTERPRETER_CONFIG, "interpreter")
    return _select_cuda_config(kernel, device, head_dim, dtype, variant)


@remember_until_retuned
def _select_cuda_config(kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                        variant: str) -> Chosen:
    info = device_info(device)
    block_d = head_dim_block(head_dim)
    hit = tuning_cache.lookup(config.cache_key(kernel, info, block_d, dtype, variant))
    if hit is not None:
        return Chosen(LaunchConfig(**hit), "tuning cache")
    cfg = default_config(kernel, info, block_d, dtype.itemsize, variant)
    return Chosen(cfg, "table" if cfg == table_entry(kernel, block_d, variant) else "rule")


def candidate_configs(kernel: str, block_d: int) -> list[LaunchConfig]:
    """The sweep space for tuning: tile shapes Hopper can hold at this head dim."""
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
         time_config, candidates=None) -> LaunchConfig:
    """Sweep one attention kernel (runtime.config.tune over this table's candidates)."""
    if candidates is None:
        candidates = candidate_configs(kernel, head_dim_block(head_dim))
    return config.tune(kernel, device, head_dim, dtype, variant, time_config, candidates)


def triton_kernel(kernel: str):
    """The Triton JIT function a table kernel name launches (its file: see the module docstring)."""
    from .triton import backward_dkdv, backward_dq, forward
    return {"attn_fwd": forward.attn_fwd_kernel, "attn_bwd_dkdv": backward_dkdv.attn_bwd_dkdv_kernel,
            "attn_bwd_dq": backward_dq.attn_bwd_dq_kernel}[kernel]
