"""Launch configurations of the gated delta rule's kernel passes: the one table that configures them.

`choose(pass, ...)` returns a Chosen (runtime.config) that says where the configuration came
from, in this order:
  "override"      `runtime.config.overrides(gdn_<pass>=GdnConfig(...))` (sweeps, tests),
  "interpreter"   small tiles on the CPU, so that small test shapes cross tile boundaries,
  "tuning cache"  an entry stored under cache_key (gdn/<pass>/K<k>/V<v>/<GPU name>) by a sweep
                  on this GPU (`flash-dma tune gdn`, tune.py beside this file),
  "table"         the defaults below, measured on Hopper (docs/perf/gated_delta_rule.md),
  "rule"          derived from the problem (head dims that leave tiles partly masked, the number
                  of sequential chains).
The strategy choices of a call (split prepare, states from T) are made in plan.py with the
rules at the end of this file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime import tuning_cache
from ...runtime.config import Chosen, declare_choice, head_dim_block, overridden, remember_until_retuned
from ...runtime.hardware import device_info, interpreter_active


@dataclass(frozen=True)
class GdnConfig:
    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int = 0  # ptxas's cap per thread (Triton's maxnreg); 0: the compiler's own count

    def launch_options(self) -> dict:
        """Triton's launch options of this configuration: warps, stages and, where set, the
        register cap."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers:
            options["maxnreg"] = self.max_registers
        return options


# Every pass, by the name the table, the overrides (gdn_<pass>) and the profiling log use.
PASSES = ("gated_pairs", "gated_pair_blocks", "prepare", "prepare_t", "prepare_gk", "recompute_wu",
          "fwd_h", "fwd_h_from_t", "intra", "bwd_dhu", "bwd_dqkw", "bwd_wy", "pair_grad", "pair_grad_blocks",
          "gate_grad")
# The gated pairs' blockwise kernels run on their whole-chunk kernel's grid and K tiles: only
# their warps and stages are their own.
BLOCKWISE_PARENT = {"gated_pair_blocks": "gated_pairs", "pair_grad_blocks": "pair_grad"}
BLOCKWISE_OF = {parent: blocks for blocks, parent in BLOCKWISE_PARENT.items()}
for _name in PASSES:
    declare_choice(f"gdn_{_name}", None, (),
                   f"launch configuration (GdnConfig) of the gated delta rule's {_name} pass")

# Passes whose K tile must cover all of K (they hold a [K, BV] state or a full query tile).
_FULL_K = ("fwd_h", "fwd_h_from_t", "bwd_dhu", "intra")
SEQUENTIAL = ("fwd_h", "fwd_h_from_t", "bwd_dhu")  # one program per chain of chunks


def _default(kernel: str, kp: int, vp: int) -> GdnConfig:
    """The Hopper table. The sequential passes are latency-bound: narrow V tiles (more programs
    in flight) with a deep load pipeline."""
    if kernel in SEQUENTIAL:
        return GdnConfig(kp, 16, num_warps=4, num_stages=3 if kp <= 128 else 2)
    if kernel == "intra":
        return GdnConfig(kp, min(vp, 64), num_warps=4, num_stages=2)
    # K tiles narrower than 64 miscompile on Triton 3.6 / Hopper (a shared-memory overrun in the
    # dqkw row sum, and NaN gradients with gk at K = 32): tiles stay >= 64 wide, masked beyond K,
    # except the gated-pair kernels' tiles (at most 32 wide; GPU tests cover K = 16 to 256)
    if kernel == "pair_grad":
        # one chunk's K tile per program, no pipeline; capped at 168 registers a thread (ptxas
        # spills a few words) so that three programs fit an SM, not two: bf16 ran 1.27x faster on
        # the H200 (other GPUs untimed; fp32 inputs spill 320 bytes under it, untimed)
        return GdnConfig(min(kp, 32), 16, num_warps=4, num_stages=1, max_registers=168)
    if kernel == "prepare":  # 16-row blocks: 2 warps, a deep pipeline
        return GdnConfig(64, min(vp, 64), num_warps=2, num_stages=3)
    if kernel == "prepare_t":  # T only, tf32 products: one warp per chunk
        return GdnConfig(64, min(vp, 64), num_warps=1, num_stages=3)
    if kernel == "prepare_gk":  # inverse and w, u only (the products come from gated_pairs)
        return GdnConfig(64, min(vp, 64), num_warps=2, num_stages=3)
    if kernel == "gated_pairs":
        # one chunk per program: the gate cumsums, then its [64, 64] products over K tiles; 32-wide
        # tiles with 2 warps (a few spilled words) ran faster than 64 with 4, 16 with 2 or 4
        return GdnConfig(min(kp, 32), 16, num_warps=2, num_stages=1)
    # The blockwise kernels (BLOCKWISE_PARENT) are chains of small dependent steps per program:
    # fewer warps fit more programs an SM (four warps ran 1.3x slower where every chunk had a
    # strong decay; one warp forward, or two backward, slower in other mixes)
    if kernel == "gated_pair_blocks":
        return GdnConfig(64, 16, num_warps=2, num_stages=1)
    if kernel == "pair_grad_blocks":
        return GdnConfig(min(kp, 32), 16, num_warps=1, num_stages=1)
    if kernel == "recompute_wu":  # no software pipeline
        return GdnConfig(64, min(vp, 64), num_warps=4, num_stages=1)
    # bwd_wy and bwd_dqkw: a chunk's K-tile programs run side by side (sharing do, v_new, dv2
    # in L2), so 64-wide K tiles with 4 warps beat all of K in one 8-warp tile
    return GdnConfig(64, min(vp, 64), num_warps=4, num_stages=3)


def _sequential(kernel: str, kp: int, vp: int, pairs: int, sm_count: int) -> GdnConfig:
    """The sequential passes run one program per (V tile, sequence, head): latency-bound while
    the GPU is not full, bandwidth-bound after (each V tile re-reads q, k, w). The narrowest tile
    that still fills the SMs with 4 warps and 3 stages; once 64-wide tiles are needed, 8 warps
    (4 spill the [K, 64] state), except for the forward pass past one wave (4 warps)."""
    stages = 3 if kp <= 128 else 2  # K = 256: three stages of q/k/w tiles overflow shared memory
    for width in (16, 32):
        if width < vp and pairs * (vp // width) <= sm_count:
            return GdnConfig(kp, width, num_warps=4, num_stages=stages)
    if kernel == "fwd_h_from_t" and 32 < vp and pairs * (vp // 32) <= 2 * sm_count:
        # the state pass that forms w, u from T (one more product per chunk) keeps 32-wide
        # tiles up to two waves
        return GdnConfig(kp, 32, num_warps=4, num_stages=stages)
    if kernel == "bwd_dhu" and kp > 128:
        # 64-wide tiles need more shared memory than an SM has at K = 256 (about 238 KB: the
        # launch failed), from a quarter of the SMs' worth of pairs or a cut on
        return GdnConfig(kp, min(vp, 32), num_warps=4, num_stages=stages)
    width = min(vp, 64)
    if kernel in ("fwd_h", "fwd_h_from_t") and pairs * (vp // width) > sm_count:
        # 3 stages: T is read in 16 bits
        return GdnConfig(kp, width, num_warps=4, num_stages=stages)
    return GdnConfig(kp, width, num_warps=8, num_stages=stages)


def choose(kernel: str, K: int, V: int, device: torch.device, sequences_x_heads: int = 0) -> Chosen:
    """sequences_x_heads: for the sequential passes, the (sequence, value head) pairs, which set
    how many programs a V tile width gives: narrow tiles only while the GPU is not yet full
    (each V tile re-reads q, k and w)."""
    forced = overridden(f"gdn_{kernel}")
    if forced is not None:
        return Chosen(forced, "override")
    if kernel == "gate_grad":  # one program per chunk summing [64] vectors: nothing to tune (tiles unused)
        return Chosen(GdnConfig(64, 16, num_warps=4, num_stages=1), "rule")
    if device.type != "cuda" or interpreter_active():
        kp = head_dim_block(K)
        return Chosen(GdnConfig(kp if kernel in _FULL_K else 16, 16, num_warps=1, num_stages=1), "interpreter")
    return _choose_cuda(kernel, K, V, device, sequences_x_heads)


def cache_key(kernel: str, K: int, V: int, device: torch.device) -> str:
    """Where a sweep's winner for a pass is stored (flash-dma tune gdn) and looked up."""
    return f"gdn/{kernel}/K{head_dim_block(K)}/V{head_dim_block(V)}/{device_info(device).name}"


@remember_until_retuned
def _choose_cuda(kernel: str, K: int, V: int, device: torch.device, sequences_x_heads: int) -> Chosen:
    kp, vp = head_dim_block(K), head_dim_block(V)
    info = device_info(device)
    masked = kernel not in _FULL_K and bool(K % 64 or V % 64)
    # the cache key pads K and V (K = 80 shares K = 128's entry): partly masked tiles keep the rule
    hit = None if masked else tuning_cache.lookup(cache_key(kernel, K, V, device))
    if hit:
        return Chosen(GdnConfig(**hit), "tuning cache")
    cfg, source = _default(kernel, kp, vp), "table"
    if masked:
        # Partly masked 64-wide tiles: the table's configurations crashed on Triton 3.6 / Hopper
        # (an illegal address at K = 48, V = 32); these passed every GPU test.
        cfg, source = GdnConfig(64, min(vp, 64), num_warps=4, num_stages=2), "rule"
    if kernel in SEQUENTIAL and sequences_x_heads:
        cfg, source = _sequential(kernel, kp, vp, sequences_x_heads, info.sm_count), "rule"
    if kernel == "intra":  # V tiles of 16 gave wrong outputs, and of 32 an out-of-bounds shared
        # memory read (K = 48, V = 32), on the H200 with Triton 3.6: 64 wide, masked beyond V
        cfg = GdnConfig(cfg.block_k, 64, cfg.num_warps, cfg.num_stages)
    return Chosen(cfg, source)


def config_name(cfg: GdnConfig) -> str:
    """A configuration as the profiling log names it: BK128_BV16_W4_S3 (_R168 with a register cap)."""
    cap = f"_R{cfg.max_registers}" if cfg.max_registers else ""
    return f"BK{cfg.block_k}_BV{cfg.block_v}_W{cfg.num_warps}_S{cfg.num_stages}{cap}"


# ------------------------------------------------------------------------------------------------
# Strategy rules (plan.py makes them declared choices)
# ------------------------------------------------------------------------------------------------
def _recompute_tiles_whole(K: int, V: int) -> bool:
    """Whether the recompute of w, u from a kept T runs on whole 64-wide tiles: with partly
    masked ones the recompute kernel read shared memory out of bounds on Triton 3.6 / Hopper
    (compute-sanitizer), so nothing is kept for it."""
    return K % 64 == 0 and V % 64 == 0


def keeps_inverse(K: int, V: int, has_gk: bool) -> bool:
    """Whether the backward recomputes w, u from the forward's T and scalar gate cumsums (else
    prepare runs again). With gk see keeps_gated_pairs instead."""
    return not has_gk and _recompute_tiles_whole(K, V)


def keeps_gated_pairs(K: int, V: int, has_gk: bool) -> bool:
    """With gk, whether the forward keeps T, the gated query-key products and the gate cumsums
    (in place of gk) for the backward, as FLA's chunk_kda keeps its gate cumsums and both
    products: the backward then forms only w, u and the gated q and k again, not the cumsums,
    the pair products and the inverse."""
    return has_gk and _recompute_tiles_whole(K, V)


# The forward state passes' sequence split (segments.py), from bench/sweep_gdn_segments.py and
# bench/profile_gdn_segments.py (docs/perf/gated_delta_rule.md): B1 T32768 H16 ran its forward
# 1.20x faster cut into segments of 64 chunks, while T8192 (128 chunks) and 20 packed
# sequences (320 chains) ran slower cut at every size; bwd_dhu ran slower cut everywhere (before
# decayed segments: see DHU_SEGMENT_MIN_CHUNKS).
SEGMENT_CHUNKS = 64
SEGMENT_MIN_CHUNKS = 256  # chunks of a sequence below which cutting did not pay
SEGMENT_MAX_CHAINS_PER_SM = 0.25  # (sequences x heads) per SM above which it did not either


# bwd_dhu cut like the forward where decayed segments shorten its local pass (segments.py), from
# bench/gdn_decay_reach.py (H200, 2026-11-27, fwd+bwd ms, bwd_dhu cut alike / whole): B1 T32768
# H16 2.043 / 2.251 at the op report's decays, 2.499 / 2.467 at slow ones (nothing decays away);
# B1 and B2 T16384 H16 no faster (1.218 / 1.208, 2.006 / 2.003) and slower at slow decays.
DHU_SEGMENT_MIN_CHUNKS = 512


def _sequence_chunks(seq_len: int, varlen: bool, num_seqs: int) -> int:
    """Chunks of a sequence of the call: packed sequences (their lengths live on the device) by
    their mean length, seq_len / num_seqs."""
    return -(-(seq_len // max(num_seqs, 1) if varlen else seq_len) // 64)


def dhu_segments_alike(seq_len: int, varlen: bool, num_seqs: int = 1) -> bool:
    """Whether bwd_dhu takes the forward's rule cut too (decayed segments apply): sequences of
    DHU_SEGMENT_MIN_CHUNKS chunks and more (packed ones by their mean length)."""
    return _sequence_chunks(seq_len, varlen, num_seqs) >= DHU_SEGMENT_MIN_CHUNKS


def forward_segments(sequences_x_heads: int, seq_len: int, varlen: bool, device: torch.device,
                     num_seqs: int = 1) -> int | None:
    """Chunks per segment of the forward state passes, or None (not cut): only where few
    chains leave SMs idle along long sequences. Packed sequences (their lengths live on the
    device) go by their mean length, seq_len / num_seqs."""
    if device.type != "cuda" or interpreter_active():
        return None
    chunks = _sequence_chunks(seq_len, varlen, num_seqs)
    if chunks < SEGMENT_MIN_CHUNKS or sequences_x_heads > SEGMENT_MAX_CHAINS_PER_SM * device_info(device).sm_count:
        return None
    return SEGMENT_CHUNKS


def states_from_inverse(K: int, sequences_x_heads: int, device: torch.device, backward: bool) -> bool:
    """Whether a state pass forms w and u from T (one more dependent product per chunk, which
    costs where few programs run) instead of reading them from the recompute kernel (bytes, which
    cost where the GPU is full). The recompute's bytes grow with K, hence pairs x K: from 32
    pairs at K = 128 in the forward. In the backward the recompute kernel writes w either way
    (bwd_dhu reads it), so from T spares only u: from 64 pairs at K = 128."""
    if device.type != "cuda" or interpreter_active():
        return True
    return sequences_x_heads * K >= (64 if backward else 32) * 128


# The forward's state pass and output fused in one Hopper kernel (gluon/), from
# bench/gdn_fused_forward.py (H100, K = V = 128; kernel ms). Two forms: warp roles
# (forward_ws.py: a chain warpgroup, an output warpgroup and a load warpgroup per 64-wide V tile,
# one program per SM) up to four (chain, V tile) programs a SM (B1 T8192 H16, 32
# programs: 0.22 against 0.27 for the Triton passes; B4 T4096 H16, 128 programs: 0.16 against
# 0.22 one-role and 0.32 Triton; B1 T32768 H16 cut into 64-chunk segments, 256 programs: public
# forward 0.67 against 0.75 one-role), and beyond that the one-role kernel with 128-wide tiles
# (forward_fused.py, eight warps). The bound between them, same runs on both cards (2026-11-27,
# bench/results/gdn-fused-forward-forms-20261127.txt): B8 T4096 H32 (512 programs, 3.9 a SM) kernel
# 0.513 warp roles / 0.566 one-role on an H200 (public forward 0.671 / 0.726), 0.589 / 0.582 on an
# H100 (public 0.758 / 0.757); B16 T4096 H32 (7.8 a SM) on the H100 1.169 / 1.150.
# Below that the Triton passes' narrower V tiles spread each chain over more SMs (not measured
# below 32 programs).
FUSED_MIN_TILES_PER_SM = 0.2
WARP_ROLES_MAX_TILES_PER_SM = 4.0


def fused_forward_tile(K: int, V: int, chains: int, dtype: torch.dtype, has_gk: bool,
                       device: torch.device, varlen: bool = False):
    """The fused forward's form: "ws" (warp roles, 64-wide V tiles), 64 or 128 (the V tile of
    the one-role kernel), or None where the Triton passes run. Packed sequences (varlen) take
    warp roles wherever the fused forward runs (not only up to four tiles a SM): their longest chain,
    not the total work, sets the time, and a chunk step of the warp-role kernel is about half the
    one-role kernel's."""
    if not fused_forward_fits(K, V, dtype, has_gk, device):
        return None
    sm = device_info(device).sm_count
    tiles = chains * (V // 64)
    if tiles < FUSED_MIN_TILES_PER_SM * sm:
        return None
    if tiles <= WARP_ROLES_MAX_TILES_PER_SM * sm or varlen:
        return "ws"
    return 128 if V % 128 == 0 else 64


# Packed sequences of mixed lengths run by the fused kernels longest first, and with warp roles
# (fused_forward_tile), from bench/gdn_packed_forms.py (H100; 20 sequences of 53-4462 tokens
# filling T = 32768 at H16, K = V = 128; forward kernel us, as given / longest first): one-role
# 128 wide 414 / 325, warp roles 288 / 270. The longest sequence (70 chunks) sets the time.
LONGEST_FIRST = True


def fused_forward_fits(K: int, V: int, dtype: torch.dtype, has_gk: bool, device: torch.device) -> bool:
    """Whether the fused forward computes such a call: an SM90 GPU (warpgroup MMA), scalar gate
    or none, K 64 or 128, V a multiple of 64, 16-bit inputs."""
    return (device.type == "cuda" and not interpreter_active() and device_info(device).arch // 10 == 9
            and not has_gk and K in (64, 128) and V % 64 == 0 and dtype in (torch.float16, torch.bfloat16))


def fused_forward_gk_fits(K: int, V: int, dtype: torch.dtype, has_g: bool, has_gk: bool,
                          device: torch.device) -> bool:
    """Whether the warp-role forward with the per-key gate (gluon/forward_ws_gk.py) computes such
    a call: an SM90 GPU, gk without the scalar gate, K 64 or 128, V a multiple of 64, 16-bit
    inputs."""
    return (device.type == "cuda" and not interpreter_active() and device_info(device).arch // 10 == 9
            and has_gk and not has_g and K in (64, 128) and V % 64 == 0 and dtype in (torch.float16, torch.bfloat16))


# Off until measured on a GPU against the Triton state pass and output it replaces (written in the
# seventeenth session of 2026-11-28, compiled for sm_90a on the CPU only).
FUSED_FORWARD_GK_BY_DEFAULT = False


# The backward's bwd_dqkw and bwd_wy fused in one Hopper kernel (gluon/backward_chunk.py), from
# bench/gdn_fused_backward.py (H200, K = V = 128, same run): the two kernels' 557 / 290 / 1118 /
# 2270 us against 360 / 193 / 696 / 1358 us at B4 T4096 H16, B1 T8192 H16, B1 T32768 H16 and
# B8 T4096 H32 (one program per chunk and value head at every size: it wins wherever it fits).
def _backward_kernels_fit(K: int, dtype: torch.dtype, has_gk: bool, device: torch.device) -> bool:
    """What the SM90 backward kernels share: an SM90 GPU, scalar gate or none, K 64 or 128,
    16-bit inputs."""
    return (device.type == "cuda" and not interpreter_active() and device_info(device).arch // 10 == 9
            and not has_gk and K in (64, 128) and dtype in (torch.float16, torch.bfloat16))


def fused_backward_fits(K: int, V: int, dtype: torch.dtype, has_gk: bool, device: torch.device) -> bool:
    """Whether the fused chunk backward (gluon/backward_chunk.py: bwd_dqkw and bwd_wy in one
    kernel) computes such a call: _backward_kernels_fit, and V 64 or 128."""
    return _backward_kernels_fit(K, dtype, has_gk, device) and V in (64, 128)


# bwd_dhu taking on another pass's work, from bench/gdn_fused_backward.py (K = V = 128, backward
# ms with the fused chunk backward, own passes / bwd_dhu forming the intra-chunk dv itself / also
# applying w through T): H100 B8 T4096 H32 3.355 / 3.312, B4 T4096 H16 0.918 / 0.910, B1 T32768
# H16 2.064 / 2.498; H200 B8 T4096 H32 2.967 / 3.120 / 3.866, B4 T4096 H16 0.827 / 0.851 / 1.037,
# B1 T8192 H16 0.593 / 0.714 / 1.122, B1 T32768 H16 1.851 / 2.344 / 3.779. The extra products
# sit in every chunk's step of the chain; only the H100's full-GPU shapes gained, by about 1%.
# Off by default; the overrides stay for other shapes and cards.
DHU_FOLDS_BY_DEFAULT = False


# bwd_dhu with warp roles (gluon/bwd_dhu_ws.py), forming the intra-chunk dv and w off its chain,
# against the Triton local_dv, recompute of w and bwd_dhu it replaces (bench/gdn_backward_forms.py,
# H200, public backward ms off / on): B4 T4096 H16 (128 tiles of 64) 0.829 / 0.770, B8 T4096 H32
# (1024) 2.952 / 2.871, 20 packed sequences at H16 (640) 1.695 / 1.655; H100: 0.979 / 0.797,
# 3.346 / 3.011, 1.909 / 1.675. Below a wave it loses (B2 T8192 H16, 64 tiles: H200 0.901 / 1.115,
# H100 0.990 / 1.193; B1 T8192 H16, 32: 0.632 / 0.908, 0.613 / 0.916): one 64-wide chain a
# program where the Triton kernel spreads each chain over narrower tiles.
DHU_WARP_ROLES_MIN_TILES_PER_SM = 0.9


def dhu_warp_roles_fit(K: int, V: int, dtype: torch.dtype, has_gk: bool, device: torch.device) -> bool:
    """Whether the warp-role bwd_dhu computes such a call: _backward_kernels_fit, and V a multiple
    of 64."""
    return _backward_kernels_fit(K, dtype, has_gk, device) and V % 64 == 0


def dhu_warp_roles_rule(V: int, chains: int, device: torch.device) -> bool:
    """Where the fitting warp-role bwd_dhu is chosen: from DHU_WARP_ROLES_MIN_TILES_PER_SM (chain,
    V tile) programs a SM."""
    return chains * (V // 64) >= DHU_WARP_ROLES_MIN_TILES_PER_SM * device_info(device).sm_count


# The whole backward after the state pass as one warp-role kernel (gluon/backward_ws.py), one
# program per sequence x value head, against the passes and the warp-role bwd_dhu
# (bench/gdn_backward_forms.py, public backward ms passes / warp-role bwd_dhu / this;
# gdn-backward-forms-20261127.txt). H200: from a wave of programs it wins (B8 T4096 H16, 128
# pairs: 1.509 / 1.438 / 0.995; B8 T4096 H32, 256: 2.991 / 2.869 / 1.984; 20 packed at H16, 320:
# 1.705 / 1.650 / 1.345; B16 T4096 H32, 512: 5.952 / 5.683 / 4.212); at half a wave it does not
# (B4 T4096 H16: 0.817 / 0.775 / 0.816; B2 T16384 H32: 3.153 / 3.021 / 3.222), nor below (B2 T8192
# H16, 32 pairs: 0.905 / 1.126 / 1.572). H100, whose slower memory costs the passes more: it wins
# from half a wave too (B4 T4096 H16: 1.179 / 0.913 / 0.847; B2 T16384 H32: 3.530 / 3.222 /
# 3.181; B8 T4096 H32: 3.355 / 3.032 / 2.187), not below (B2 T8192 H16: 0.988 / 1.180 / 1.570).
# Programs a SM from which it is chosen, by the card's name; other cards: the H200's.
BACKWARD_WARP_ROLES_MIN_PAIRS_PER_SM = {"H100": 0.45, "H200": 0.9}


def backward_warp_roles_bound(device: torch.device) -> float:
    """(sequence x value head) programs a SM from which the warp-role backward is chosen."""
    name = device_info(device).name
    return next((bound for card, bound in BACKWARD_WARP_ROLES_MIN_PAIRS_PER_SM.items() if card in name),
                BACKWARD_WARP_ROLES_MIN_PAIRS_PER_SM["H200"])


def backward_warp_roles_rule(pairs: int, device: torch.device) -> bool:
    """Where the fitting warp-role backward is chosen: from backward_warp_roles_bound's programs a
    SM."""
    return pairs >= backward_warp_roles_bound(device) * device_info(device).sm_count
