"""Launch configurations of the gated delta rule kernels.

Chosen from the tuning cache (a sweep on this GPU, bench/tune_gdn.py), else from defaults measured
on Hopper, keyed by kernel and padded head dims. In the interpreter small tiles make small test
shapes cross tile boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import tuning_cache
from ...config import head_dim_block
from ...hardware import device_info, interpreter_active


@dataclass(frozen=True)
class GdnConfig:
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2


# Kernels whose K tile must cover all of K (they hold a [K, BV] state or a full query tile).
_FULL_K = ("fwd_h", "bwd_dhu", "intra")


def _default(kernel: str, kp: int, vp: int) -> GdnConfig:
    """Measured on an H200 (2026-11-21, bench notes): the sequential passes are latency-bound, so
    narrow V tiles (more programs in flight) with a deep load pipeline win."""
    if kernel in ("fwd_h", "bwd_dhu"):
        return GdnConfig(kp, 16, num_warps=4, num_stages=3 if kp <= 128 else 2)
    if kernel == "intra":
        return GdnConfig(kp, min(vp, 64), num_warps=4, num_stages=2)
    if kernel == "pair_grad":
        return GdnConfig(min(kp, 32), 16, num_warps=4, num_stages=1)
    # prepare, bwd_dqkw, bwd_wy. K tiles narrower than 64 miscompile on Triton 3.6 / Hopper
    # (a shared-memory overrun in the dqkw row sum, and NaN gradients with gk at K = 32): the
    # tile stays 64 wide, masked beyond K.
    return GdnConfig(64, min(vp, 64), num_warps=4, num_stages=2)


# Set by sweeps (bench/tune_gdn.py): kernel -> config, ahead of everything else.
OVERRIDES: dict[str, GdnConfig] = {}


def select(kernel: str, K: int, V: int, device: torch.device, sequences_x_heads: int = 0) -> GdnConfig:
    """sequences_x_heads: for the sequential passes, the (sequence, value head) pairs, which set
    how many programs a V tile width gives: narrow tiles only while the GPU is not yet full
    (each V tile re-reads q, k and w)."""
    kp, vp = head_dim_block(K), head_dim_block(V)
    if kernel in OVERRIDES:
        return OVERRIDES[kernel]
    if device.type != "cuda" or interpreter_active():
        full = kernel in _FULL_K
        return GdnConfig(kp if full else 16, 16, num_warps=1, num_stages=1)
    info = device_info(device)
    key = f"gdn/{kernel}/K{kp}/V{vp}/{info.name}"
    hit = tuning_cache.lookup(key)
    if hit:
        return GdnConfig(**hit)
    cfg = _default(kernel, kp, vp)
    if kernel in ("fwd_h", "bwd_dhu") and sequences_x_heads:
        for width in (16, 32, 64):
            if width >= vp or sequences_x_heads * (vp // width) <= info.sm_count:
                break
        cfg = GdnConfig(cfg.block_k, min(width, vp), cfg.num_warps, cfg.num_stages if width < 64 else 2)
    if kernel == "intra":  # V tiles of 16 gave wrong outputs on the H200 (Triton 3.6)
        cfg = GdnConfig(cfg.block_k, max(cfg.block_v, 32), cfg.num_warps, cfg.num_stages)
    return cfg
