"""The backward's chunk-parallel dq, the state and intra parts of dk, dw and the gate terms."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from ..layout import CHUNK as CHUNK_ROWS, ChunkLayout
from .common import (
    CHUNK, chunk_args, chunk_part_program, load_tile, load_vec, pair_gradient_dtype, scalar_gamma,
    square_ptrs, state_ptrs, store_tile, store_vec, total_gate
)


@triton.jit(do_not_specialize=["T", "db_tile_stride"])
def gdn_bwd_dqkw_kernel(q, k, v_new, h, dh, do, dv2, g_cum, gk_cum, dq, dk, dw, db, dp, d_last,
                        chunk_map, cu_seqlens, T, db_tile_stride, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr,
                        HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One program per (chunk, head, K tile). With h = h[c] and D = dh[c] (end of chunk):
        dq = scale e^B (do h^T) + scale (dP . Gamma) k,  dP = Tril(do v_new^T)
        dk = e^(B_last - B) (v_new D^T) + scale (dP . Gamma)^T q          (partial: + wy terms)
        dw = -dv2 h^T
    and the gate terms dB (before the reverse cumsum). With gk the dP products are left to
    gdn_gated_pair_grad_kernel: dP is stored instead, and of the gate terms only the chunk's last
    row's extra (d_last, per chunk state): that kernel forms the rest from dq, dk themselves."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, chunk, k_tile = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK)
    rows = tl.arange(0, CHUNK)
    kcols = k_tile * BK + tl.arange(0, BK)
    dqg = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dwa = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dkl = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dpa = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dlast = tl.zeros([BK], dtype=tl.float32)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        do_t = load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid)
        vn_t = load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid)
        dv2_t = load_tile(dv2, tok0, rows, HV, hv, V, vcols, n_valid).to(do_t.dtype)
        h_ptrs, s_mask = state_ptrs(h, chunk, hv, HV, K, V, kcols, vcols)
        h_t = tl.load(h_ptrs, mask=s_mask, other=0.0)
        dh_ptrs, s_mask = state_ptrs(dh, chunk, hv, HV, K, V, kcols, vcols)
        dh_t = tl.load(dh_ptrs, mask=s_mask, other=0.0)
        dqg += tl.dot(do_t, tl.trans(h_t))
        dwa += tl.dot(dv2_t, tl.trans(h_t))
        dkl += tl.dot(vn_t, tl.trans(dh_t))
        dpa += tl.dot(do_t, tl.trans(vn_t))
        dlast += tl.sum(h_t.to(tl.float32) * dh_t.to(tl.float32), axis=1)
    # each finished tile is stored as soon as it is complete: fewer live at once (it spilled)
    store_tile(dw, -dwa, tok0, rows, HV, hv, K, kcols, n_valid)
    kt = load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
    bt, b_last = total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
    dq_t = dqg * tl.exp(bt) * scale
    dk_t = dkl * tl.exp(b_last[None, :] - bt)
    # B_last: from the kept part of every k (sum of k dk here) and from e^(B_last) h[c]
    last_extra = tl.sum(kt.to(tl.float32) * dk_t, axis=0) + tl.exp(b_last) * dlast
    if HAS_GK:
        if k_tile == 0:
            dp_ptrs, dp_mask = square_ptrs(dp, tok0, rows, HV, hv, rows, n_valid)
            tl.store(dp_ptrs, tl.where(rows[:, None] >= rows[None, :], dpa, 0.0), mask=dp_mask)
        store_tile(dq, dq_t, tok0, rows, HV, hv, K, kcols, n_valid)
        store_tile(dk, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
        last_ptrs = d_last + (chunk.to(tl.int64) * HV + hv) * K + kcols
        tl.store(last_ptrs, last_extra, mask=kcols < K)
    else:
        qt = load_tile(q, tok0, rows, H, head, K, kcols, n_valid)
        if HAS_G:
            b_row = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            pg = dpa * scalar_gamma(b_row, b_row, True, rows < n_valid) * scale
        else:
            pg = tl.where(rows[:, None] >= rows[None, :], dpa * scale, 0.0)
        # the intra-chunk parts accumulate into dq and dk themselves (one live tile each); the
        # gate rows are then q . dq - k . dk of the totals
        dq_t = tl.dot(pg.to(kt.dtype), kt, acc=dq_t)
        gate_rows = tl.sum(qt.to(tl.float32) * dq_t, axis=1)
        store_tile(dq, dq_t, tok0, rows, HV, hv, K, kcols, n_valid)
        dk_t = tl.dot(tl.trans(pg).to(qt.dtype), qt, acc=dk_t)
        gate_rows -= tl.sum(kt.to(tl.float32) * dk_t, axis=1)
        store_tile(dk, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
        gate_rows += tl.where(rows == n_valid - 1, tl.sum(last_extra, axis=0), 0.0)
        if HAS_G:  # one partial sum over this K tile's keys; the wy kernel adds the tiles
            store_vec(db + k_tile.to(tl.int64) * db_tile_stride, gate_rows, tok0, rows, HV, hv, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
@dataclass
class DqkwGrads:
    """The dqkw pass's outputs, which the WY and pair passes finish."""
    dq: torch.Tensor  # final (input dtype) where `direct`, else fp32 per value head
    dk: torch.Tensor  # partial dk: input dtype where `direct`, else fp32 per value head
    # where the WY pass writes the finished dk (dk itself unless direct); with gk its own terms
    # alone (fp32), which the pair pass adds (it forms the gate terms from both parts)
    dk_out: torch.Tensor
    dw: torch.Tensor
    db: torch.Tensor | None  # gate terms per K tile [NK, B, T, HV] with g and without gk
    d_p: torch.Tensor | None  # dP with gk (common.pair_gradient_dtype)
    d_last: torch.Tensor | None  # with gk: the gate terms' last-row extra per chunk state [NS, HV, K]
    k_tiles: int
    direct: bool


def bwd_dqkw(plan, layout: ChunkLayout, q, k, v_new, h, dh, do, dv2, g_cum, gk_cum, scale: float) -> DqkwGrads:
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dev = q.device
    has_g, has_gk = g_cum is not None, gk_cum is not None
    cfg = plan.launch("bwd_dqkw")
    k_tiles = ceil_div(K, cfg.block_k)
    # Without gk and GVA, dq and the WY kernel's dk are final where they are written: straight
    # into the input dtype (saves an fp32 round trip and a cast of each).
    direct = HV == H and not has_gk
    dq = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype if direct else torch.float32)
    # dqkw's partial dk: in the input dtype where the WY kernel finishes it (as FLA keeps both
    # parts; the error against fp64 barely moves), fp32 where more is added (gk, GVA group sums)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype if direct else torch.float32)
    dk_out = torch.empty_like(k) if direct else torch.empty_like(dk) if has_gk else dk
    dw = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
    db = d_p = d_last = None
    if has_gk:
        d_p = torch.empty(B, T, HV, CHUNK_ROWS, device=dev, dtype=pair_gradient_dtype(q.dtype))
        d_last = torch.empty(h.numel() // (HV * K * V), HV, K, device=dev, dtype=torch.float32)
    elif has_g:
        db = torch.empty(k_tiles, B, T, HV, device=dev, dtype=torch.float32)
    chunk_map, cu = chunk_args(layout)
    launch(gdn_bwd_dqkw_kernel, (layout.num_slots * k_tiles, B * HV),
           q, k, v_new, h, dh, do, dv2, g_cum, gk_cum, dq, dk, dw, db, d_p, d_last, chunk_map, cu, T,
           B * T * HV, scale, H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=has_g,
           HAS_GK=has_gk, IS_VARLEN=layout.is_varlen, **cfg.launch_options())
    return DqkwGrads(dq, dk, dk_out, dw, db, d_p, d_last, k_tiles, direct)
