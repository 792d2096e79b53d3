"""Launch configurations of the gated delta rule kernels.

Chosen from the tuning cache (an entry stored under gdn/<kernel>/K<k>/V<v>/<GPU name> with
flash_dma.runtime.tuning_cache.store, e.g. after a sweep on this GPU), else from defaults measured on Hopper
(the sweeps are logged in bench/results/s5-ab-*.txt and s8-probes-*.txt), keyed by kernel and
padded head dims. In the interpreter small tiles make small test shapes cross tile boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime import tuning_cache
from ...runtime.config import head_dim_block, remember_until_retuned
from ...runtime.hardware import device_info, interpreter_active


@dataclass(frozen=True)
class GdnConfig:
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2


# Kernels whose K tile must cover all of K (they hold a [K, BV] state or a full query tile).
_FULL_K = ("fwd_h", "fwd_h_from_t", "bwd_dhu", "intra")
_SEQUENTIAL = ("fwd_h", "fwd_h_from_t", "bwd_dhu")


def _default(kernel: str, kp: int, vp: int) -> GdnConfig:
    """Measured on an H200 (2026-11-21, bench notes): the sequential passes are latency-bound, so
    narrow V tiles (more programs in flight) with a deep load pipeline win."""
    if kernel in _SEQUENTIAL:
        return GdnConfig(kp, 16, num_warps=4, num_stages=3 if kp <= 128 else 2)
    if kernel == "intra":
        return GdnConfig(kp, min(vp, 64), num_warps=4, num_stages=2)
    if kernel == "pair_grad":  # one 16-row block per program: 64 wide, 4 warps, no pipeline (KDA
        # B2 T4096 H16 fwd+bwd 3.375 ms against 3.455-3.576 for the others tried; s10 probes)
        return GdnConfig(min(kp, 64), 16, num_warps=4, num_stages=1)
    # prepare, recompute_wu, bwd_dqkw, bwd_wy: measured at B4 T4096 H16 K = V = 128 on an H200
    # (bench/NOTES.md). K tiles narrower than 64 miscompile on Triton 3.6 / Hopper (a shared-memory
    # overrun in the dqkw row sum, and NaN gradients with gk at K = 32): tiles stay >= 64 wide,
    # masked beyond K.
    if kernel == "prepare":  # 16-row blocks: 2 warps, a deep pipeline
        return GdnConfig(64, min(vp, 64), num_warps=2, num_stages=3)
    if kernel == "prepare_t":  # T only, tf32 products: one warp per chunk (B8 T4096 H32: 170 us,
        # two warps 275, four 540; bench/results/s8-probes-H200-20261121.txt)
        return GdnConfig(64, min(vp, 64), num_warps=1, num_stages=3)
    if kernel == "prepare_gk":  # inverse and w, u only (the products come from gated_pairs): 2
        # warps (48 bytes of stack) beat 4 (none), 4 / 2 stages and 8 warps (KDA B2 T4096 H16
        # forward 0.791 ms against 0.826-0.923, H200, bench/results/s10-probes-H200-20261121.txt)
        return GdnConfig(64, min(vp, 64), num_warps=2, num_stages=3)
    if kernel == "chunk_cumsum":  # 2 or 8 warps, 128-wide tiles: within 0.5% (s10 probes, run 7)
        return GdnConfig(64, 16, num_warps=4, num_stages=1)
    if kernel == "gated_pairs":  # one 16x16 block per program; the same sweep: 2 warps, 1 stage
        return GdnConfig(64, 16, num_warps=2, num_stages=1)
    if kernel == "recompute_wu":  # no software pipeline: the fastest in the sweep
        return GdnConfig(64, min(vp, 64), num_warps=4, num_stages=1)
    # bwd_wy, and bwd_dqkw: once a chunk's K-tile programs ran side by side (sharing do, v_new,
    # dv2 in L2) 64-wide K tiles with 4 warps were the best at every size tried, against all of
    # K in one 8-warp tile: B8 T4096 H32 1488 -> 1271 us, K = 256 445 -> 386 (H200,
    # bench/results/s11-probes-H200-20261121.txt, runs 3-6)
    return GdnConfig(64, min(vp, 64), num_warps=4, num_stages=3)


def _sequential(kernel: str, kp: int, vp: int, pairs: int, sm_count: int) -> GdnConfig:
    """The sequential passes run one program per (V tile, sequence, head): latency-bound while
    the GPU is not full, bandwidth-bound after (each V tile re-reads q, k, w). Measured on an
    H200 at K = V = 128 (bench/NOTES.md, 2026-11-21): the narrowest tile that still fills the
    SMs with 4 warps and 3 stages; once 64-wide tiles are needed, 8 warps and 3 stages (4 warps
    spill the [K, 64] state), except for the forward pass past one wave (4 warps)."""
    stages = 3 if kp <= 128 else 2  # K = 256: three stages of q/k/w tiles overflow shared memory
    for width in (16, 32):
        if width < vp and pairs * (vp // width) <= sm_count:
            return GdnConfig(kp, width, num_warps=4, num_stages=stages)
    if kernel == "fwd_h_from_t" and 32 < vp and pairs * (vp // 32) <= 2 * sm_count:
        # the state pass that forms w, u from T (one more product per chunk) kept 32-wide tiles
        # up to two waves: B4 T4096 H16 152 us against 198 at 64 wide / 8 warps (H200, s9 probes)
        return GdnConfig(kp, 32, num_warps=4, num_stages=stages)
    width = min(vp, 64)
    if kernel in ("fwd_h", "fwd_h_from_t") and pairs * (vp // width) > sm_count:
        # 3 stages since T is read in 16 bits: B8 T4096 H32 from T 1043 -> 890 us (fwd + bwd
        # calls) against 2 stages (H200, s11 probes run 13)
        return GdnConfig(kp, width, num_warps=4, num_stages=stages)
    return GdnConfig(kp, width, num_warps=8, num_stages=stages)


# Set by sweep scripts (kernel -> config), ahead of everything else, the tuning cache included.
OVERRIDES: dict[str, GdnConfig] = {}


def select(kernel: str, K: int, V: int, device: torch.device, sequences_x_heads: int = 0) -> GdnConfig:
    """sequences_x_heads: for the sequential passes, the (sequence, value head) pairs, which set
    how many programs a V tile width gives: narrow tiles only while the GPU is not yet full
    (each V tile re-reads q, k and w)."""
    if kernel in OVERRIDES:
        return OVERRIDES[kernel]
    if device.type != "cuda" or interpreter_active():
        kp = head_dim_block(K)
        return GdnConfig(kp if kernel in _FULL_K else 16, 16, num_warps=1, num_stages=1)
    return _select_cuda(kernel, K, V, device, sequences_x_heads)


@remember_until_retuned
def _select_cuda(kernel: str, K: int, V: int, device: torch.device, sequences_x_heads: int) -> GdnConfig:
    kp, vp = head_dim_block(K), head_dim_block(V)
    info = device_info(device)
    key = f"gdn/{kernel}/K{kp}/V{vp}/{info.name}"
    hit = tuning_cache.lookup(key)
    if hit:
        return GdnConfig(**hit)
    cfg = _default(kernel, kp, vp)
    if kernel not in _FULL_K and (K % 64 or V % 64):
        # Partly masked 64-wide tiles: the tuned configurations above crashed on Triton 3.6 /
        # Hopper (an illegal address at K = 48, V = 32); these passed every GPU test.
        cfg = GdnConfig(64, min(vp, 64), num_warps=4, num_stages=2)
    if kernel in _SEQUENTIAL and sequences_x_heads:
        cfg = _sequential(kernel, kp, vp, sequences_x_heads, info.sm_count)
    if kernel == "intra":  # V tiles of 16 gave wrong outputs, and of 32 an out-of-bounds shared
        # memory read (K = 48, V = 32), on the H200 with Triton 3.6: 64 wide, masked beyond V
        cfg = GdnConfig(cfg.block_k, 64, cfg.num_warps, cfg.num_stages)
    return cfg


def states_from_inverse(K: int, sequences_x_heads: int, device: torch.device, backward: bool) -> bool:
    """Whether a state pass forms w and u from T (one more dependent product per chunk, which
    costs where few programs run) instead of reading them from the recompute kernel (bytes, which
    cost where the GPU is full). The recompute's bytes grow with K, hence pairs x K.
    Forward ms, recompute -> from T, H200 bf16 2026-11-21 (bench/results/s9-probes-H200-20261121.txt):
    B8 T4096 H32 1.408 -> 1.146, B4 T4096 H16 0.393 -> 0.364, B2 T8192 H8 K256 0.627 -> 0.585,
    32 pairs at K128 0.220 -> 0.213 and 0.428 -> 0.423; 16 pairs at K128 0.280 -> 0.299 and
    1.060 -> 1.128: from 32 pairs at K = 128.
    In the backward the recompute kernel writes w either way (bwd_dhu reads it), so from T spares
    only u: fwd+bwd ms (s11 probes): B4 T4096 H16 1.497 -> 1.474, B8 T4096 H32 5.585 -> 5.535;
    B1 T8192 H32 1.675 -> 1.736, B2 T8192 H8 K256 2.144 -> 2.153, B1 T8192 H16 1.031 -> 1.078:
    from 64 pairs at K = 128."""
    if device.type != "cuda" or interpreter_active():
        return True
    return sequences_x_heads * K >= (64 if backward else 32) * 128
