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
    if kernel in ("fwd_h", "bwd_dhu"):
        # the sequential passes: more V tiles = more programs in flight at low batch x heads
        return GdnConfig(kp, 32 if kp <= 128 else 16, num_warps=4, num_stages=2)
    if kernel == "intra":
        return GdnConfig(kp, min(vp, 64), num_warps=4, num_stages=2)
    if kernel == "bwd_dqkw":
        return GdnConfig(min(kp, 64), min(vp, 64), num_warps=4, num_stages=2)
    if kernel == "pair_grad":
        return GdnConfig(min(kp, 32), 16, num_warps=4, num_stages=1)
    return GdnConfig(min(kp, 64), min(vp, 64), num_warps=4, num_stages=2)  # prepare, bwd_wy


def select(kernel: str, K: int, V: int, device: torch.device) -> GdnConfig:
    kp, vp = head_dim_block(K), head_dim_block(V)
    if device.type != "cuda" or interpreter_active():
        full = kernel in _FULL_K
        return GdnConfig(kp if full else 16, 16, num_warps=1, num_stages=1)
    info = device_info(device)
    key = f"gdn/{kernel}/K{kp}/V{vp}/{info.name}"
    hit = tuning_cache.lookup(key)
    if hit:
        return GdnConfig(**hit)
    return _default(kernel, kp, vp)
