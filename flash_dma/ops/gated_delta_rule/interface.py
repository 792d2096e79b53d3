"""Chunked gated delta rule: argument checks, launches and autograd.

Forward: prepare (gates, WY representation) -> states -> output; where the GPU is full the
state pass forms the WY products from T itself. The backward keeps what FLA keeps
(the inputs, the scalar gate's cumsums and the per-chunk inverse T, no per-chunk states): it
recomputes w, u and the states, then runs the state-gradient pass (`chunk_gated_delta_rule_bwd_dhu`,
public) and the chunk-parallel gradient kernels.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ...runtime.autograd import first_order_only
from ...runtime.config import ceil_div
from ...runtime.hardware import device_guard, graph_capturing
from ...runtime.launch import compile_ahead, compile_ahead_enabled, launch
from ...runtime.tensor_cache import TensorKeyedCache
from ...runtime.validation import (check_cu_seqlens, check_interpreter_dtype, check_same_device, check_shape,
                           check_tensor, cu_seqlens_values)
from . import config as gdn_config
from .kernels import (
    gdn_bwd_dhu_kernel,
    gdn_bwd_dqkw_kernel,
    gdn_bwd_wy_kernel,
    gdn_chunk_cumsum_kernel,
    gdn_fwd_h_kernel,
    gdn_gate_grad_kernel,
    gdn_gated_pair_grad_kernel,
    gdn_gated_pairs_kernel,
    gdn_intra_kernel,
    gdn_prepare_kernel,
    gdn_recompute_wu_kernel,
)

CHUNK = 64
MAX_HEAD_DIM = 256
_MIN_GPU_V = 32
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_CPU_FLOATS = (torch.float16, torch.float32)  # in Triton's interpreter (see check_interpreter_dtype)


# ------------------------------------------------------------------------------------------------
# Chunk layout (equal lengths, or packed sequences without a host sync)
# ------------------------------------------------------------------------------------------------
@dataclass
class ChunkLayout:
    batch: int  # B (1 with cu_seqlens)
    seq_len: int  # T
    num_seqs: int  # N
    num_slots: int  # programs of the chunk-parallel kernels, per (batch, head)
    num_chunk_states: int  # first dim of the per-chunk state buffers (B * NT, or num_slots)
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None  # [N] first global chunk of each sequence
    chunk_map: torch.Tensor | None  # [num_slots, 2] (sequence or -1, chunk within it)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None


# varlen layouts per cu_seqlens object: every layer and both passes of a step share one
_LAYOUTS = TensorKeyedCache()


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    if cu_seqlens is None:
        nt = ceil_div(seq_len, CHUNK)
        return ChunkLayout(batch, seq_len, batch, nt, batch * nt, None, None, None)
    return _LAYOUTS.get(cu_seqlens, ("layout", seq_len), lambda: _varlen_layout(seq_len, cu_seqlens))


def total_chunks(cu_seqlens: torch.Tensor) -> int:
    """Chunks of all packed sequences: read from the device once per cu_seqlens object (the one
    host synchronisation of the public bwd_dhu, which must size dh)."""
    return _LAYOUTS.get(cu_seqlens, ("total_chunks",), lambda: int(_chunk_counts(cu_seqlens).sum()),
                        reuse_in_capture=True)  # (dh's size: fixed in a graph anyway)


def _chunk_counts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK


def _varlen_layout(seq_len: int, cu_seqlens: torch.Tensor) -> ChunkLayout:
    cu = cu_seqlens.to(torch.int32)
    n = cu.numel() - 1
    # Every sequence adds at most one partial chunk: an upper bound known without reading cu.
    slots = ceil_div(seq_len, CHUNK) + n
    counts = _chunk_counts(cu)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    starts = (ends - counts).to(torch.int32)
    slot = torch.arange(slots, device=cu.device, dtype=torch.int32)
    seq = torch.searchsorted(ends, slot, right=True).to(torch.int32)
    used = seq < n
    seq_c = seq.clamp(max=max(n - 1, 0))
    local = slot - starts[seq_c] if n > 0 else slot
    chunk_map = torch.stack([torch.where(used, seq, -1), torch.where(used, local, 0)], 1).contiguous()
    return ChunkLayout(1, seq_len, n, slots, slots, cu, starts.contiguous(), chunk_map)


@functools.lru_cache(maxsize=None)
def _unused_int32(device: torch.device) -> torch.Tensor:
    """A pointer argument the kernels never read (one per device: an allocation per launch costs
    host time that small calls notice)."""
    return torch.empty(0, device=device, dtype=torch.int32)


def _chunk_args(layout: ChunkLayout, device) -> tuple:
    if layout.is_varlen:
        return layout.chunk_map, layout.cu_seqlens
    unused = _unused_int32(device)
    return unused, unused


def _seq_args(layout: ChunkLayout, device) -> tuple:
    if layout.is_varlen:
        return layout.cu_seqlens, layout.chunk_offsets
    unused = _unused_int32(device)
    return unused, unused


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------
def _check_head_dim(name: str, dim: int) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")


def _check_cu_seqlens(cu_seqlens, batch: int, seq_len: int, device):
    """The packed offsets as the kernels read them (int32), their values checked against T."""
    if cu_seqlens is None:
        return None
    check_cu_seqlens("cu_seqlens", cu_seqlens, min_count=1)
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1 (all tokens along T), got B={batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected to be on {device} like q, got {cu_seqlens.device}")
    return cu_seqlens_values("cu_seqlens", cu_seqlens, seq_len)


def _check_op_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gk, chunk_size):
    check_tensor("q", q, dims=4, dtypes=_FLOATS)
    check_tensor("k", k, dims=4, dtypes=_FLOATS)
    check_tensor("v", v, dims=4, dtypes=_FLOATS)
    check_interpreter_dtype("q", q, _CPU_FLOATS)
    B, T, H, K = q.shape
    check_shape("k", k, (B, T, H, K), "like q: [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected shape [{B}, {T}, HV, V] (batch and length of q), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: its head count HV={HV} must be a multiple of q's H={H} (grouped value heads)")
    _check_head_dim("q", K)
    _check_head_dim("v", V)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got k {k.dtype}, v {v.dtype}")
    if g is not None:
        check_tensor("g", g, dtypes=_FLOATS)
        check_shape("g", g, (B, T, HV), "[B, T, HV] log decay per value head")
    if gk is not None:
        check_tensor("gk", gk, dtypes=_FLOATS)
        check_shape("gk", gk, (B, T, HV, K), "[B, T, HV, K] per-key log decay")
    check_tensor("beta", beta, dtypes=_FLOATS)
    check_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size: only {CHUNK} is supported, got {chunk_size}")
    device = check_same_device({"q": q, "k": k, "v": v, "g": g, "gk": gk, "beta": beta,
                                "initial_state": initial_state})
    cu_seqlens = _check_cu_seqlens(cu_seqlens, B, T, device)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,))
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        check_shape("initial_state", initial_state, (n, HV, K, V), "[N, HV, K, V], N = number of sequences")
    return B, T, H, HV, K, V, cu_seqlens


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels address [B, T, heads, D] tensors as dense rows."""
    return t if t.is_contiguous() else t.contiguous()


# ------------------------------------------------------------------------------------------------
# Launch helpers
# ------------------------------------------------------------------------------------------------
# Where T is kept anyway, the forward makes w, u with the recompute kernel rather than inside
# prepare (module-level for A/B scripts; measured in bench/NOTES.md).
SPLIT_PREPARE = True


def _inverse_precision(dtype: torch.dtype) -> str:
    """Products of the blockwise inverse T = (I + A)^-1: on tf32 tensor cores for 16-bit inputs,
    whose w = T diag(beta e^B) K and u = T diag(beta) V are rounded to 8 or 11 significant bits
    anyway (as T itself is, where it is stored for the backward): prepare 500 -> 276 us at
    B8 T4096 H32 bf16 on an H200, errors against fp64 unchanged at T = 4096 (bench/NOTES.md,
    session 8). fp32 inputs keep exact fp32 products."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _prepare(q, k, v, beta, g, gk, scale, layout: ChunkLayout, store_wu: bool = True,
             store_q_gated: bool = False):
    """Gate cumsums, T = (I + A)^-1 per chunk, w and u (unless store_wu is False: returned as
    None) and, with gk, the gated query-key matrix and k e^(C_last - C) (and, with store_q_gated,
    q e^C) per value head for the state passes; None without gk."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    has_g, has_gk = g is not None, gk is not None
    g_cum = torch.empty(B, T, HV, device=dev, dtype=torch.float32) if has_g else None
    gk_cum = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32) if has_gk else None
    w = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype) if store_wu else None
    u = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype) if store_wu else None
    # T in the 16-bit input type (each use rounds it to that type anyway; the bytes of T are read
    # up to four times: -2.5% fwd+bwd at B8 T4096 H32, s11 probes); fp32 where the gated pair
    # products pass through it (gk) or the inputs are fp32
    ai = torch.empty(B, T, HV, CHUNK, device=dev,
                     dtype=torch.float32 if has_gk or k.dtype == torch.float32 else k.dtype)
    aqk = torch.empty(B, T, HV, CHUNK, device=dev, dtype=torch.float32) if has_gk else None
    k_gated = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype) if has_gk else None
    q_gated = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype) if has_gk and store_q_gated else None
    precision = _inverse_precision(k.dtype)
    # T alone in tf32 is light enough for one warp per chunk; w, u or exact products want two
    cfg = gdn_config.select("prepare_gk" if has_gk else "prepare" if store_wu or precision == "ieee"
                            else "prepare_t", K, V, dev)
    chunk_map, cu = _chunk_args(layout, dev)
    if has_gk:
        # the gate cumsums and the gated pair products (16 programs per chunk) come first; the
        # prepare program then only inverts and forms w, u (all in one program it spilled 3.3 KB)
        scan_cfg = gdn_config.select("chunk_cumsum", K, V, dev)
        launch(gdn_chunk_cumsum_kernel, (layout.num_slots, B * HV),
            g if has_g else gk, gk, g_cum if has_g else gk_cum, gk_cum, q, k,
            q_gated if q_gated is not None else k_gated, k_gated, chunk_map, cu, T,
            H=H, HV=HV, K=K, BK=scan_cfg.block_k, HAS_G=has_g, STORE_Q_GATED=q_gated is not None,
            IS_VARLEN=layout.is_varlen,
            num_warps=scan_cfg.num_warps, num_stages=scan_cfg.num_stages)
        pairs_cfg = gdn_config.select("gated_pairs", K, V, dev)
        launch(gdn_gated_pairs_kernel, (layout.num_slots * 16, B * HV),
            q, k, g_cum if has_g else gk_cum, gk_cum, ai, aqk, chunk_map, cu, T, scale,
            H=H, HV=HV, K=K, BK=pairs_cfg.block_k, HAS_G=has_g, IS_VARLEN=layout.is_varlen,
            num_warps=pairs_cfg.num_warps, num_stages=pairs_cfg.num_stages)
    launch(gdn_prepare_kernel, (layout.num_slots, B * HV),
        k, v, beta, g if has_g else ai, g_cum if has_g else ai, gk_cum if has_gk else ai,
        w if store_wu else ai, u if store_wu else ai, ai, chunk_map, cu,
        T, H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=has_g, HAS_GK=has_gk,
        IS_VARLEN=layout.is_varlen, STORE_WU=store_wu, INVERSE_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return g_cum, gk_cum, w, u, ai, aqk, k_gated, q_gated


def _backward_reuses_inverse(K: int, V: int, has_gk: bool) -> bool:
    """Whether the backward recomputes w, u from the forward's T (else prepare runs again, and
    the forward keeps nothing extra). Not with gk: its per-key cumsums and query-key products
    would cost more to keep than to recompute. Not with head dims that leave 64-wide tiles partly
    masked: the recompute kernel then read shared memory out of bounds on Triton 3.6 / Hopper
    (compute-sanitizer)."""
    return not has_gk and K % CHUNK == 0 and V % CHUNK == 0


def _recompute_wu(k, v, beta, g_cum, ai, layout: ChunkLayout, with_u: bool = True):
    """w and (with_u) u from the forward's T and gate cumsums (scalar gate only); u None without."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    w = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
    u = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype) if with_u else None
    cfg = gdn_config.select("recompute_wu", K, V, dev)
    chunk_map, cu = _chunk_args(layout, dev)
    launch(gdn_recompute_wu_kernel, (layout.num_slots, B * HV),
        k, v, beta, g_cum if g_cum is not None else w, ai, w, u if with_u else w, chunk_map, cu, T,
        H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
        IS_VARLEN=layout.is_varlen, STORE_U=with_u, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return w, u


# None: gdn_config.states_from_inverse decides; True/False force it (tests, A/B scripts).
STATES_FROM_INVERSE: bool | None = None
BACKWARD_STATES_FROM_INVERSE: bool | None = None


def _states_from_inverse(layout: ChunkLayout, HV: int, K: int, device, backward: bool) -> bool:
    """Whether a state pass forms w and u from T itself (no u, and in the forward no w, in memory).
    Only where T is kept (_backward_reuses_inverse). The backward's recompute kernel writes w
    either way: forming w in bwd_dhu was slower (one more dependent product per chunk: 690 -> 1418
    us at B8 T4096 H32), and writing w from the state pass gave wrong results on Triton 3.6 /
    Hopper (bench/NOTES.md, session 9)."""
    forced = BACKWARD_STATES_FROM_INVERSE if backward else STATES_FROM_INVERSE
    if forced is not None:
        return forced
    return gdn_config.states_from_inverse(K, layout.num_seqs * HV, device, backward)


def _states(k, v, beta, ai, w, u, g_cum, gk_cum, initial_state, layout: ChunkLayout, store_final: bool):
    """States at each chunk start and v_new, from w and u, or (both None) from T (ai), v and beta.
    With gk, k is the gated k of _prepare (per value head)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    from_inverse = w is None
    if from_inverse:
        w = u = k  # not read
    else:
        ai = beta = k  # not read
    h = torch.empty(layout.num_chunk_states, HV, K, V, device=dev, dtype=k.dtype)
    v_new = torch.empty_like(v)
    final = torch.empty(layout.num_seqs, HV, K, V, device=dev, dtype=torch.float32) if store_final else None
    cfg = gdn_config.select("fwd_h_from_t" if from_inverse else "fwd_h", K, V, dev, layout.num_seqs * HV)
    cu, offsets = _seq_args(layout, dev)
    grid = (ceil_div(V, cfg.block_v), layout.num_seqs * HV)
    launch(gdn_fwd_h_kernel, grid,
        k, w, u, v, beta, ai, g_cum if g_cum is not None else k, gk_cum if gk_cum is not None else k,
        initial_state if initial_state is not None else k, h, v_new, final if store_final else k,
        cu, offsets, T, H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v,
        HAS_G=g_cum is not None, HAS_GK=gk_cum is not None, HAS_H0=initial_state is not None,
        STORE_HT=store_final, WU_FROM_T=from_inverse, IS_VARLEN=layout.is_varlen,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return h, v_new, final


def _intra(q, k, g_cum, gk_cum, aqk, h, v_new, do, scale, layout: ChunkLayout, out_dtype, is_dv: bool):
    B, T, H, K = q.shape
    src = do if is_dv else v_new
    HV, V = src.shape[2], src.shape[3]
    dev = q.device
    out = torch.empty(B, T, HV, V, device=dev, dtype=out_dtype)
    cfg = gdn_config.select("intra", K, V, dev)
    chunk_map, cu = _chunk_args(layout, dev)
    launch(gdn_intra_kernel, (layout.num_slots, B * HV),
        q, k, g_cum if g_cum is not None else q, gk_cum if gk_cum is not None else q,
        aqk if aqk is not None else q, h if h is not None else q, v_new if v_new is not None else q,
        do if do is not None else q, out, chunk_map, cu, T, scale,
        H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
        HAS_GK=gk_cum is not None, IS_VARLEN=layout.is_varlen, IS_DV=is_dv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _bwd_dhu(q, k, w, do, dv, g_cum, gk_cum, dht, want_dh0: bool, scale, layout: ChunkLayout):
    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dev = q.device
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=dev, dtype=q.dtype)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=dev, dtype=torch.float32) if want_dh0 else None
    dv2 = torch.empty_like(dv)
    cfg = gdn_config.select("bwd_dhu", K, V, dev, layout.num_seqs * HV)
    cu, offsets = _seq_args(layout, dev)
    grid = (ceil_div(V, cfg.block_v), layout.num_seqs * HV)
    launch(gdn_bwd_dhu_kernel, grid,
        q, k, w, do, dv, g_cum if g_cum is not None else q, gk_cum if gk_cum is not None else q,
        dht if dht is not None else q, dh, dh0 if want_dh0 else q, dv2, cu, offsets, T, scale,
        HQ=HQ, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
        HAS_GK=gk_cum is not None, HAS_DHT=dht is not None, STORE_DH0=want_dh0,
        IS_VARLEN=layout.is_varlen, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dh, dh0, dv2


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, HV, K] per value head -> [B, T, H, K] per q/k head (sum over the group)."""
    B, T, HV, K = x.shape
    if HV == heads:
        return x
    return x.view(B, T, heads, HV // heads, K).sum(3)


def _backward(q, k, v, g, gk, beta, scale, initial_state, layout, do, dht, g_cum, ai):
    """g_cum and ai: the forward's gate cumsums and T, or None where it keeps neither
    (_backward_reuses_inverse)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    has_g, has_gk = g is not None, gk is not None
    if ai is None:
        g_cum, gk_cum, w, u, ai, aqk, k_gated, q_gated = _prepare(q, k, v, beta, g, gk, scale, layout,
                                                                  store_q_gated=True)
    else:
        gk_cum = aqk = k_gated = q_gated = None
        w, u = _recompute_wu(k, v, beta, g_cum, ai, layout,
                             with_u=not _states_from_inverse(layout, HV, K, dev, backward=True))
    k_states = k if k_gated is None else k_gated  # with gk the state passes take gated q and k
    # u None: the state pass forms v_new from T (w is still bwd_dhu's)
    h, v_new, _ = _states(k_states, v, beta, ai, None if u is None else w, u, g_cum, gk_cum,
                          initial_state, layout, store_final=False)
    dv_local = _intra(q, k, g_cum, gk_cum, aqk, None, None, do, scale, layout, v.dtype, is_dv=True)
    dh, dh0, dv2 = _bwd_dhu(q if q_gated is None else q_gated, k_states, w, do, dv_local, g_cum, gk_cum,
                            dht, initial_state is not None, scale, layout)
    del k_gated, q_gated, dv_local
    cfg = gdn_config.select("bwd_dqkw", K, V, dev)
    num_k_tiles = ceil_div(K, cfg.block_k)
    # Without gk and GVA, dq and the WY kernel's dk are final where they are written: straight
    # into the input dtype (saves an fp32 round trip and a cast of each).
    direct = HV == H and not has_gk
    dq = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype if direct else torch.float32)
    # dqkw's partial dk: in the input dtype where the WY kernel finishes it (as FLA keeps both
    # parts; dk's error against fp64 3.5e-3 -> 3.9e-3, dqkw + WY -8% at B8 T4096 H32, s11 probes),
    # fp32 where more is added (gk, GVA group sums)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype if direct else torch.float32)
    dk_out = torch.empty_like(k) if direct else dk
    dw = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
    if has_gk:
        db = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
        d_p = torch.empty(B, T, HV, CHUNK, device=dev, dtype=torch.float32)  # from dqkw
        d_a = torch.empty(B, T, HV, CHUNK, device=dev, dtype=torch.float32)  # from the wy kernel
    else:  # not written: placeholders
        db = torch.empty(num_k_tiles, B, T, HV, device=dev, dtype=torch.float32) if has_g else dq
        d_p = d_a = dq
    db_tile_stride = B * T * HV
    chunk_map, cu = _chunk_args(layout, dev)
    launch(gdn_bwd_dqkw_kernel, (layout.num_slots * num_k_tiles, B * HV),
        q, k, v_new, h, dh, do, dv2, g_cum if has_g else q, gk_cum if has_gk else q, dq, dk, dw, db,
        d_p, chunk_map, cu, T, db_tile_stride, scale, H=H, HV=HV, K=K, V=V, BK=cfg.block_k,
        BV=cfg.block_v, HAS_G=has_g, HAS_GK=has_gk, IS_VARLEN=layout.is_varlen,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    del h, dh, v_new
    dbeta = torch.empty(B, T, HV, device=dev, dtype=torch.float32)
    dv = torch.empty_like(v)
    dg = torch.empty(B, T, HV, device=dev, dtype=torch.float32) if has_g else None
    wy_cfg = gdn_config.select("bwd_wy", K, V, dev)
    launch(gdn_bwd_wy_kernel, (layout.num_slots, B * HV),
        k, v, beta, g_cum if has_g else q, gk_cum if has_gk else q, ai, dw, dv2, dk, dk_out, dv, dbeta,
        db, dg if has_g else q, d_a, chunk_map, cu, T, db_tile_stride,
        H=H, HV=HV, K=K, V=V,
        BK=wy_cfg.block_k, BV=wy_cfg.block_v, NK=num_k_tiles, HAS_G=has_g, HAS_GK=has_gk,
        IS_VARLEN=layout.is_varlen, num_warps=wy_cfg.num_warps, num_stages=wy_cfg.num_stages)
    dgk = None
    if has_gk:
        # both pairwise matrices' gradients at once (after the wy kernel: all adds commute)
        pair_cfg = gdn_config.select("pair_grad", K, V, dev)
        pair_k_tiles = ceil_div(K, pair_cfg.block_k)
        dbeta_parts = torch.empty(pair_k_tiles, B, T, HV, device=dev, dtype=torch.float32)
        launch(gdn_gated_pair_grad_kernel,
            (layout.num_slots * pair_k_tiles * 4, B * HV),  # x 16-row blocks
            q, k, beta, g_cum if has_g else q, gk_cum, d_p, d_a, dq, dk, dbeta_parts, db, chunk_map,
            cu, T, B * T * HV, scale, H=H, HV=HV, K=K, BK=pair_cfg.block_k, HAS_G=has_g,
            IS_VARLEN=layout.is_varlen, num_warps=pair_cfg.num_warps, num_stages=pair_cfg.num_stages)
        dbeta += dbeta_parts.sum(0)
        dgk = torch.empty(B, T, HV, K, device=dev, dtype=torch.float32)
        launch(gdn_gate_grad_kernel, (layout.num_slots, B * HV),
            db, dg if has_g else q, dgk, chunk_map, cu, T, HV=HV, K=K,
            BK=max(64, gdn_config.head_dim_block(K)),
            HAS_G=has_g, IS_VARLEN=layout.is_varlen)
    if not direct:
        dq = _group_sum(dq, H).to(q.dtype)
        dk_out = _group_sum(dk, H).to(k.dtype)
    dk = dk_out
    return dq, dk, dv, dg, dgk, dbeta, dh0


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, cu_seqlens)
        keep_t = _backward_reuses_inverse(k.shape[3], v.shape[3], gk is not None)
        split = keep_t and SPLIT_PREPARE
        g_cum, gk_cum, w, u, ai, aqk, k_gated, _ = _prepare(q, k, v, beta, g, gk, scale, layout,
                                                            store_wu=not split)
        if split and not _states_from_inverse(layout, v.shape[2], k.shape[3], q.device, backward=False):
            w, u = _recompute_wu(k, v, beta, g_cum, ai, layout)
        h, v_new, final = _states(k if k_gated is None else k_gated, v, beta, ai, w, u, g_cum, gk_cum,
                                  initial_state, layout, output_final_state)
        del w, u, k_gated
        o = _intra(q, k, g_cum, gk_cum, aqk, h, v_new, None, scale, layout, q.dtype, is_dv=False)
        # Kept for the backward, as FLA keeps them: T and the scalar gate's cumsums (not per chunk
        # states), where the backward can reuse them.
        if not keep_t:
            g_cum = ai = None
        ctx.save_for_backward(q, k, v, g, gk, beta, initial_state, g_cum, ai)
        ctx.layout, ctx.scale = layout, scale
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, gk, beta, initial_state, g_cum, ai = ctx.saved_tensors
        do = _rows(do)
        dht = None if dht is None else dht.float().contiguous()
        with device_guard(q.device):
            dq, dk, dv, dg, dgk, dbeta, dh0 = _backward(q, k, v, g, gk, beta, ctx.scale, initial_state,
                                                        ctx.layout, do, dht, g_cum, ai)
        return first_order_only("chunk_gated_delta_rule",
                                (dq, dk, dv, dg, dgk, dbeta.to(beta.dtype), None, dh0, None, None),
                                (q, k, v, g, gk, beta, initial_state))


# compile-time signatures whose kernels were compiled ahead (see _compile_ahead), and the exact
# call shapes already checked against them (a cheap first lookup: the full signature costs ~15 us
# of host time per call to form, the shapes of a training step repeat)
_COMPILED_AHEAD: set = set()
_CHECKED_CALLS: set = set()


def _compile_ahead(args: tuple, backward: bool) -> None:
    """On the first call with a new set of compile-time constants (dtypes, heads, head dims,
    gates, states, layout), compile the kernels that this call's forward (and backward) will
    launch, in parallel, before running it: a dry run of both in which every launch only hands
    its compilation to a thread pool (launch.compile_ahead). The dry run allocates the buffers of
    one forward and backward once. The real launches then find their kernels compiled; one the
    dry run missed would compile as usual."""
    q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens = args
    call = (q.shape, v.shape, q.device, q.dtype, k.dtype, v.dtype, beta.dtype, g is None, gk is None,
            initial_state is None, output_final_state,
            None if cu_seqlens is None else cu_seqlens.numel(), backward)
    if call in _CHECKED_CALLS:
        return
    if not compile_ahead_enabled() or graph_capturing(q.device):
        return
    if len(_CHECKED_CALLS) > 4096:  # varying lengths: bounded
        _CHECKED_CALLS.clear()
    _CHECKED_CALLS.add(call)
    layout = chunk_layout(q.shape[0], q.shape[1], cu_seqlens)
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    # The number of (sequence, head) pairs sets some kernels' tiles and stages; T only Triton's
    # divisibility specialisation.
    pairs = layout.num_seqs * HV
    pair_choices = tuple(gdn_config.select(name, K, V, q.device, pairs)
                         for name in ("fwd_h", "fwd_h_from_t", "bwd_dhu"))
    pair_choices += tuple(_states_from_inverse(layout, HV, K, q.device, way) for way in (False, True))
    key = (q.device, q.dtype, k.dtype, v.dtype, beta.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]),
           g is not None, gk is not None, initial_state is not None, output_final_state,
           layout.is_varlen, q.shape[1] % 16 == 0, pair_choices, backward)
    if key in _COMPILED_AHEAD:
        return
    _COMPILED_AHEAD.add(key)
    ctx = SimpleNamespace()
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    try:
        with torch.no_grad(), compile_ahead():
            o, final = ChunkGatedDeltaRuleFunction.forward(ctx, *args)
            if backward:
                ChunkGatedDeltaRuleFunction.backward(ctx, torch.empty_like(o),
                                                     None if final is None else torch.empty_like(final))
    except Exception as exc:  # noqa: BLE001 - a speed-up only: the real call runs (and raises) as usual
        warnings.warn(f"flash_dma: compiling ahead failed ({type(exc).__name__}: {exc}); kernels "
                      "compile at their first launch instead", RuntimeWarning, stacklevel=3)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the head dim, in fp32 (autograd handles its backward)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                           gk: torch.Tensor | None = None, chunk_size: int = 64):
    """Gated delta rule (Gated DeltaNet; Kimi Delta Attention with the per-key gate gk), chunked.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV] log decay (or None with
    gk); gk [B, T, HV, K] per-key log decay; beta [B, T, HV]; initial_state [N, HV, K, V] fp32.
    With cu_seqlens (int32/int64, [N + 1]) the sequences are packed along T and B must be 1.
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None).
    """
    B, T, H, HV, K, V, cu_seqlens = _check_op_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gk,
                                                     chunk_size)
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    # Gates in fp32 (the casts are autograd ops, so their gradients come back in the given dtype).
    g32 = None if g is None else _rows(g.float())
    gk32 = None if gk is None else _rows(gk.float())
    # On the H200 (Triton 3.6) value dims under 32 gave wrong outputs: zero-pad V (zero value
    # columns stay zero in every state and output) and slice the results; autograd does the rest.
    pad_v = _MIN_GPU_V - V if (q.is_cuda and V < _MIN_GPU_V) else 0
    if pad_v:
        v = torch.nn.functional.pad(v, (0, pad_v))
        if initial_state is not None:
            initial_state = torch.nn.functional.pad(initial_state, (0, pad_v))
    args = (_rows(q), _rows(k), _rows(v), g32, gk32, _rows(beta), float(scale), initial_state,
            bool(output_final_state), cu_seqlens)
    with device_guard(q.device):
        _compile_ahead(args, backward=torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g32, gk32, beta, initial_state)))
        o, final = ChunkGatedDeltaRuleFunction.apply(*args)
    if pad_v:
        o = o[..., :V]
        final = None if final is None else final[..., :V]
    return o, (final if output_final_state else None)


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def chunk_gated_delta_rule_bwd_dhu(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                                   dv: torch.Tensor, g: torch.Tensor | None = None,
                                   gk: torch.Tensor | None = None, h0: torch.Tensor | None = None,
                                   dht: torch.Tensor | None = None, scale: float | None = None,
                                   cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64):
    """The state-gradient pass of the chunked gated delta rule (see the spec): returns
    (dh [B, NT, HV, K, V] in q's dtype, dh0 [N, HV, K, V] fp32 or None, dv2 like dv).
    g, gk are chunk-local cumulative sums; with gk, q and k come already gated. With cu_seqlens,
    NT is the total chunk count of the packed sequences (read from cu_seqlens: one host sync
    the first time a cu_seqlens tensor is seen, none after)."""
    for name, t in (("q", q), ("k", k), ("w", w)):
        check_tensor(name, t, dims=4, dtypes=_FLOATS)
    check_tensor("do", do, dims=4, dtypes=_FLOATS)
    check_tensor("dv", dv, dims=4, dtypes=_FLOATS)
    check_interpreter_dtype("q", q, _CPU_FLOATS)
    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    check_shape("k", k, (B, T, HQ, K), "like q")
    check_shape("w", w, (B, T, HV, K), "[B, T, HV, K]")
    check_shape("do", do, (B, T, HV, V), "[B, T, HV, V]")
    check_shape("dv", dv, (B, T, HV, V), "like do")
    if HV % HQ != 0:
        raise ValueError(f"q: its head count {HQ} must divide the value heads HV={HV} of do")
    _check_head_dim("q", K)
    _check_head_dim("do", V)
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size: only {CHUNK} is supported, got {chunk_size}")
    if g is not None:
        check_tensor("g", g, dtypes=(torch.float32,))
        check_shape("g", g, (B, T, HV), "[B, T, HV] chunk-local cumsum, fp32")
    if gk is not None:
        check_tensor("gk", gk, dtypes=(torch.float32,))
        check_shape("gk", gk, (B, T, HV, K), "[B, T, HV, K] chunk-local cumsum, fp32")
    device = check_same_device({"q": q, "k": k, "w": w, "do": do, "dv": dv, "g": g, "gk": gk,
                                "h0": h0, "dht": dht})
    cu_seqlens = _check_cu_seqlens(cu_seqlens, B, T, device)
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    for name, t in (("h0", h0), ("dht", dht)):
        if t is not None:
            check_tensor(name, t, dtypes=(torch.float32,))
            check_shape(name, t, (n, HV, K, V), "[N, HV, K, V] fp32")
    if scale is None:
        scale = K ** -0.5
    with device_guard(device):
        return _public_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, float(scale), cu_seqlens)


def _public_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, scale: float, cu_seqlens):
    B, T, HV, K, V = q.shape[0], q.shape[1], do.shape[2], q.shape[3], do.shape[3]
    layout = chunk_layout(B, T, cu_seqlens)
    dh, dh0, dv2 = _bwd_dhu(_rows(q), _rows(k), _rows(w), _rows(do), _rows(dv), g if g is None else _rows(g),
                            gk if gk is None else _rows(gk), None if dht is None else _rows(dht),
                            h0 is not None, scale, layout)
    if layout.is_varlen:
        dh = dh[:total_chunks(cu_seqlens)].unsqueeze(0)
    else:
        dh = dh.view(B, -1, HV, K, V)
    return dh, dh0, dv2
