"""The backward's chunk-parallel gradients in one pass: dq, dk, dv, dbeta and dg from the states
h[c], their gradients dh[c] and dv2 (bwd_dhu's), for the scalar gate or none (not gk).

It does the work of gdn_bwd_dqkw_kernel and gdn_bwd_wy_kernel without their intermediates in
memory (dw and the partial dk), using
    dw = -dv2 h^T              so  T^T dw = -(T^T dv2) h^T   (T^T dv2 is dv / beta, needed anyway)
    dw (diag(beta e^B) K)^T = -dv2 (diag(beta e^B) K h)^T, and diag(beta)(V - diag(e^B) K h)
    = (I + A) v_new, so the WY product dT = dv2 (diag(beta) V)^T + dw (diag(beta e^B) K)^T
    = (dv2 v_new^T) (I + A)^T: one [64, 64] accumulator over V instead of dw over K.
One program per (chunk, value head, K tile); the K tiles of a chunk run side by side (sharing
its tiles in L2) and each forms the whole dT (a [64, 64] product per V tile, cheap beside the
state products). dbeta and the gate rows are summed over the K tiles afterwards (per-tile
partials, reverse-cumsummed per chunk first: the sum of reverse cumsums is the reverse cumsum of
the sum).
"""
import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from ..layout import ChunkLayout
from .common import (
    CHUNK, chunk_args, chunk_inverse, chunk_part_program, load_tile, load_vec, reverse_cumsum,
    scalar_gamma, state_ptrs, store_tile, store_vec, total_gate
)


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_bwd_chunk_kernel(q, k, v, v_new, beta, g_cum, ai, h, dh, do, dv2, dq, dk, dv, dbeta_parts, dg_parts,
                         chunk_map, cu_seqlens, T, part_stride, scale,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """With h = h[c], D = dh[c] (end of chunk), P = do v_new^T, B the gate cumsum of the chunk and
    Gamma_ij = e^(B_i - B_j):
        dq = scale e^B (do h^T) + scale (Tril(P) . Gamma) K
        dk = e^(B_last - B) (v_new D^T) + scale (Tril(P) . Gamma)^T Q
             - diag(beta e^B) (T^T dv2) h^T + (X + X^T) K,   X = diag(beta) (dA . Gamma)
        dv = diag(beta) T^T dv2,   dA = -T^T dT T^T (strictly lower)
    and dbeta, dg as the WY and dqkw kernels form them (their docstrings)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, chunk, k_tile = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK)
    rows = tl.arange(0, CHUNK)
    kcols = k_tile * BK + tl.arange(0, BK)
    kdt = k.dtype.element_ty
    tmat, beta_t = chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
    tt = tl.trans(tmat).to(kdt)
    if HAS_G:
        b_row = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
    else:
        b_row = tl.zeros([CHUNK], dtype=tl.float32)
    # Two passes over V, so that at most three [64, 64] accumulators live at once (five in one
    # pass spilled): the first forms what dq and dT need, the second what dk needs.
    dqg = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dpa = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dvv = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # dv2 v_new^T
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        do_t = load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid)
        vn_t = load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid)
        dv2_t = load_tile(dv2, tok0, rows, HV, hv, V, vcols, n_valid).to(kdt)
        h_ptrs, s_mask = state_ptrs(h, chunk, hv, HV, K, V, kcols, vcols)
        h_t = tl.load(h_ptrs, mask=s_mask, other=0.0)
        dqg += tl.dot(do_t, tl.trans(h_t))
        dpa += tl.dot(do_t, tl.trans(vn_t))
        dvv += tl.dot(dv2_t, tl.trans(vn_t))
    qt = load_tile(q, tok0, rows, H, head, K, kcols, n_valid)
    kt = load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
    bt, b_last = total_gate(g_cum, None, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, False)
    e_b = tl.exp(bt)
    pg = (dpa * scalar_gamma(b_row, b_row, True) * scale).to(kdt)
    dq_t = tl.dot(pg, kt, acc=dqg * e_b * scale)
    gate_t = tl.sum(qt.to(tl.float32) * dq_t, axis=1)
    store_tile(dq, dq_t, tok0, rows, HV, hv, K, kcols, n_valid)
    # A = StrictTril(diag(beta) (K K^T . Gamma)) over all of K (every K tile needs all of dT)
    kkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k_start in range(0, K, BK):
        kall = k_start + tl.arange(0, BK)
        k_rows = load_tile(k, tok0, rows, H, head, K, kall, n_valid)
        kkt += tl.dot(k_rows, tl.trans(load_tile(k, tok0, rows, H, head, K, kall, n_valid)))
    gamma_strict = scalar_gamma(b_row, b_row, False)
    a_mat = kkt * gamma_strict * beta_t[:, None]
    # dT = (dv2 v_new^T)(I + A)^T, dA = -T^T dT T^T on the strict lower triangle
    d_t = dvv + tl.dot(dvv.to(kdt), tl.trans(a_mat.to(kdt)))
    d_a = -tl.dot(tl.dot(tt, d_t.to(kdt)).to(kdt), tt)
    d_ag = tl.where(rows[:, None] > rows[None, :], d_a, 0.0) * gamma_strict
    first = k_tile == 0
    m = d_ag * kkt * beta_t[:, None]  # dA . A
    gate_t += tl.where(first, tl.sum(m, axis=1) - tl.sum(m, axis=0), 0.0)
    dbeta_t = tl.where(first, tl.sum(d_ag * kkt, axis=1), 0.0)
    x_dab = d_ag * beta_t[:, None]
    sym_dab = (x_dab + tl.trans(x_dab)).to(kdt)
    # the V-wide parts (dv, its dbeta term) are this chunk's first K tile's: the others mask them off
    v_rows = tl.where(first, n_valid, 0)
    dkl = tl.zeros([CHUNK, BK], dtype=tl.float32)
    dkb = tl.zeros([CHUNK, BK], dtype=tl.float32)  # (T^T dv2) h^T = -T^T dw
    dlast = tl.zeros([BK], dtype=tl.float32)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        vn_t = load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid)
        dv2_t = load_tile(dv2, tok0, rows, HV, hv, V, vcols, n_valid).to(kdt)
        h_ptrs, s_mask = state_ptrs(h, chunk, hv, HV, K, V, kcols, vcols)
        h_t = tl.load(h_ptrs, mask=s_mask, other=0.0)
        dh_ptrs, s_mask = state_ptrs(dh, chunk, hv, HV, K, V, kcols, vcols)
        dh_t = tl.load(dh_ptrs, mask=s_mask, other=0.0)
        v_t = load_tile(v, tok0, rows, HV, hv, V, vcols, v_rows)
        dkl += tl.dot(vn_t, tl.trans(dh_t))
        dvb = tl.dot(tt, dv2_t)
        dkb += tl.dot(dvb.to(kdt), tl.trans(h_t))
        dlast += tl.sum(h_t.to(tl.float32) * dh_t.to(tl.float32), axis=1)
        store_tile(dv, dvb * beta_t[:, None], tok0, rows, HV, hv, V, vcols, v_rows)
        dbeta_t += tl.sum(dvb * v_t.to(tl.float32), axis=1)
    dk_t = dkl * tl.exp(b_last[None, :] - bt)
    # B_last: from the kept part of every k (sum of k dk here) and from e^(B_last) h[c]
    last_extra = tl.sum(tl.sum(kt.to(tl.float32) * dk_t, axis=0) + tl.exp(b_last) * dlast, axis=0)
    dk_t = tl.dot(tl.trans(pg), qt, acc=dk_t)
    kbase = kt.to(tl.float32) * e_b
    gate_t += tl.where(rows == n_valid - 1, last_extra, 0.0) - tl.sum(kt.to(tl.float32) * dk_t, axis=1)
    # the WY terms through w: T^T dw = -dkb
    dbeta_t -= tl.sum(dkb * kbase, axis=1)
    gate_t -= tl.sum(kbase * beta_t[:, None] * dkb, axis=1)
    dk_t -= dkb * e_b * beta_t[:, None]
    dk_t = tl.dot(sym_dab, kt, acc=dk_t)
    store_tile(dk, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
    part = k_tile.to(tl.int64) * part_stride
    store_vec(dbeta_parts + part, dbeta_t, tok0, rows, HV, hv, n_valid)
    if HAS_G:
        store_vec(dg_parts + part, reverse_cumsum(gate_t), tok0, rows, HV, hv, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def serves(has_gk: bool) -> bool:
    """Whether this pass can take a call: the scalar gate or none (gk keeps dqkw + WY + pairs)."""
    return not has_gk


def bwd_chunk(plan, layout: ChunkLayout, q, k, v, v_new, beta, g_cum, ai, h, dh, do, dv2, scale: float):
    """-> (dq, dk, dv, dbeta fp32, dg fp32 or None). dq and dk per value head: in the input dtype
    where HV == H, else fp32 (the caller sums each group)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    cfg = plan.launch("bwd_chunk")
    k_tiles = ceil_div(K, cfg.block_k)
    direct = HV == H
    dq = torch.empty(B, T, HV, K, device=dev, dtype=q.dtype if direct else torch.float32)
    dk = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype if direct else torch.float32)
    dv = torch.empty_like(v)
    has_g = g_cum is not None
    dbeta = torch.empty(k_tiles, B, T, HV, device=dev, dtype=torch.float32)
    dg = torch.empty(k_tiles, B, T, HV, device=dev, dtype=torch.float32) if has_g else None
    chunk_map, cu = chunk_args(layout)
    launch(gdn_bwd_chunk_kernel, (layout.num_slots * k_tiles, B * HV),
           q, k, v, v_new, beta, g_cum, ai, h, dh, do, dv2, dq, dk, dv, dbeta, dg, chunk_map, cu, T,
           B * T * HV, scale, H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=has_g,
           IS_VARLEN=layout.is_varlen, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if k_tiles > 1:
        dbeta = dbeta.sum(0)
        dg = None if dg is None else dg.sum(0)
    else:
        dbeta = dbeta[0]
        dg = None if dg is None else dg[0]
    return dq, dk, dv, dbeta, dg
