"""The backward through the WY representation: dk, dv, dbeta and the gate terms, dg."""
import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from ..layout import CHUNK as CHUNK_ROWS, ChunkLayout
from .common import (
    CHUNK, chunk_args, chunk_inverse, chunk_program, load_tile, load_vec, pair_gradient_dtype,
    reverse_cumsum, scalar_gamma, square_ptrs, store_tile, store_vec, total_gate
)


@triton.jit(do_not_specialize=["T", "db_tile_stride"])
def gdn_bwd_wy_kernel(k, v, beta, g_cum, gk_cum, ai, dw, du, dk, dk_out, dv, dbeta, db, dg, da,
                      chunk_map, cu_seqlens, T, db_tile_stride,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
                      HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Back through u = T diag(beta) V, w = T diag(beta e^B) K and T = (I + A)^-1, with
    A = StrictTril(diag(beta) (K K^T . Gamma)), given du (= dv2) and dw. One program per
    (chunk, head): dv, dbeta, dk (the partial dk from gdn_bwd_dqkw_kernel plus these terms, into
    dk_out: the final dtype when nothing is added later, else dk itself) and, without gk,
    dg (the gate terms summed and reverse-cumsummed). With gk, dA is stored for the pair kernel,
    and dk_out gets these terms alone: their gate terms are k dk_out, which the pair kernel adds
    (no read of dqkw's dk here, no gate buffer)."""
    hv, head, tok0, n_valid, _ = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    tmat, beta_t = chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
    kdt = k.dtype.element_ty
    vdt = v.dtype.element_ty
    d_t = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    dbeta_t = tl.zeros([CHUNK], dtype=tl.float32)
    tt_v = tl.trans(tmat).to(vdt)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        du_t = load_tile(du, tok0, rows, HV, hv, V, vcols, n_valid).to(vdt)
        v_t = load_tile(v, tok0, rows, HV, hv, V, vcols, n_valid)
        d_t += tl.dot(du_t, tl.trans((v_t * beta_t[:, None]).to(vdt)))
        dvb = tl.dot(tt_v, du_t)
        store_tile(dv, dvb * beta_t[:, None], tok0, rows, HV, hv, V, vcols, n_valid)
        dbeta_t += tl.sum(dvb * v_t.to(tl.float32), axis=1)
    kkt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k_start in range(0, K, BK):
        kcols = k_start + tl.arange(0, BK)
        k_t = load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
        dw_t = load_tile(dw, tok0, rows, HV, hv, K, kcols, n_valid).to(kdt)
        bt, _b_last = total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
        kb = (k_t * tl.exp(bt) * beta_t[:, None]).to(kdt)
        d_t += tl.dot(dw_t, tl.trans(kb))
    if not HAS_GK:
        # K K^T in a loop of its own, each operand from its own load: as `k_t @ k_t^T` inside the
        # loop above (one tile as both operands beside its other uses), Triton 3.6's pipeline on
        # Hopper let dbeta and dg change from run to run (and raised their errors against fp64).
        for k_start in range(0, K, BK):
            kcols = k_start + tl.arange(0, BK)
            k_rows = load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
            kkt += tl.dot(k_rows, tl.trans(load_tile(k, tok0, rows, H, head, K, kcols, n_valid)))
    # dA = -T^T dT T^T on the strict lower triangle, with 16-bit operands as the other products
    # here (faster than tf32, errors against fp64 unchanged)
    tt_k = tl.trans(tmat).to(kdt)
    d_a = -tl.dot(tl.dot(tt_k, d_t.to(kdt)).to(kdt), tt_k)
    d_a = tl.where(rows[:, None] > rows[None, :], d_a, 0.0)
    if HAS_GK:
        da_ptrs, da_mask = square_ptrs(da, tok0, rows, HV, hv, rows, n_valid)
        tl.store(da_ptrs, d_a, mask=da_mask)
        d_ag = d_a  # unused
    else:
        if HAS_G:
            b_row = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            d_ag = d_a * scalar_gamma(b_row, b_row, False, rows < n_valid)
        else:
            d_ag = d_a
        dbeta_t += tl.sum(d_ag * kkt, axis=1)
    gate_t = tl.zeros([CHUNK], dtype=tl.float32)
    if HAS_G and not HAS_GK:  # dqkw's partial gate row sums, one per dqkw K tile
        for i in range(NK):
            gate_t += load_vec(db + i * db_tile_stride, tok0, rows, HV, hv, n_valid)
    if not HAS_GK:
        x_dab = d_ag * beta_t[:, None]
        sym_dab = (x_dab + tl.trans(x_dab)).to(kdt)
    for k_start in range(0, K, BK):
        kcols = k_start + tl.arange(0, BK)
        # dqkw's part of dk first: an elementwise operand, not pipelined like the product operands,
        # so its load latency overlaps the product below (the WY kernel's top stall where it was
        # read after it)
        if HAS_GK:
            dk_t = tl.zeros([CHUNK, BK], dtype=tl.float32)
        else:
            dk_t = load_tile(dk, tok0, rows, HV, hv, K, kcols, n_valid).to(tl.float32)
        k_t = load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
        dw_t = load_tile(dw, tok0, rows, HV, hv, K, kcols, n_valid).to(kdt)
        bt, _b_last = total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
        kbase = k_t.to(tl.float32) * tl.exp(bt)
        dkb = tl.dot(tt_k, dw_t)
        dk_t += dkb * tl.exp(bt) * beta_t[:, None]
        dbeta_t += tl.sum(dkb * kbase, axis=1)
        if not HAS_GK:
            # diag(beta) dA k + (dA diag(beta))^T k as one product: (X + X^T) k, X = diag(beta) dA
            dk_t = tl.dot(sym_dab, k_t, acc=dk_t)
            gate_t += tl.sum(kbase * beta_t[:, None] * dkb, axis=1)
        store_tile(dk_out, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
    store_vec(dbeta, dbeta_t, tok0, rows, HV, hv, n_valid)
    if HAS_G and not HAS_GK:
        m = d_ag * kkt * beta_t[:, None]  # dA . A
        gate_t += tl.sum(m, axis=1) - tl.sum(m, axis=0)
        store_vec(dg, reverse_cumsum(gate_t), tok0, rows, HV, hv, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def bwd_wy(plan, layout: ChunkLayout, k, v, beta, g_cum, gk_cum, ai, dv2, grads):
    """Back through w, u and T, finishing grads.dk into grads.dk_out (with gk: its own terms
    into grads.dk_out, for the pair pass). -> (dv, dbeta fp32, dg or None, dA or None): dg is
    complete here without gk (with gk the gate-gradient pass writes it), dA is stored for the
    pair pass."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    has_g, has_gk = g_cum is not None, gk_cum is not None
    dbeta = torch.empty(B, T, HV, device=dev, dtype=torch.float32)
    dv = torch.empty_like(v)
    dg = torch.empty(B, T, HV, device=dev, dtype=torch.float32) if has_g else None
    d_a = (torch.empty(B, T, HV, CHUNK_ROWS, device=dev, dtype=pair_gradient_dtype(k.dtype)) if has_gk
           else None)
    cfg = plan.launch("bwd_wy")
    chunk_map, cu = chunk_args(layout)
    launch(gdn_bwd_wy_kernel, (layout.num_slots, B * HV),
           k, v, beta, g_cum, gk_cum, ai, grads.dw, dv2, grads.dk, grads.dk_out, dv, dbeta,
           grads.db, dg, d_a, chunk_map, cu, T, B * T * HV,
           H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, NK=grads.k_tiles, HAS_G=has_g,
           HAS_GK=has_gk, IS_VARLEN=layout.is_varlen, **cfg.launch_options())
    return dv, dbeta, dg, d_a
