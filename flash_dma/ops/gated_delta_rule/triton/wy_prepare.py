"""The WY representation: per chunk A = StrictTril(diag(beta) (K K^T . Gamma)), T = (I + A)^-1 in
16-row blocks (stored), w = T diag(beta e^B) K and u = T diag(beta) V; and the recompute of w,
u from a stored T (the split forward, and the backward)."""
import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from ..layout import CHUNK as CHUNK_ROWS, ChunkLayout
from .common import (
    CHUNK, SUB, chunk_args, chunk_inverse, chunk_program, decay_factor, load_square_block, load_tile, load_vec,
    scalar_gamma, square_ptrs, store_tile, store_vec
)
from .key_gates import gated_qk_buffers, store_gated_qk


@triton.jit
def _dot32(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _inv_unit_lower(a, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular 16x16 a: with m = -a nilpotent (m^16 = 0),
    (I + m)(I + m^2)(I + m^4)(I + m^8) = sum of m^n for n < 16."""
    idx = tl.arange(0, SUB)
    m = -a
    p = (idx[:, None] == idx[None, :]).to(tl.float32) + m
    m2 = _dot32(m, m, PRECISION)
    p = p + _dot32(p, m2, PRECISION)
    m4 = _dot32(m2, m2, PRECISION)
    p = p + _dot32(p, m4, PRECISION)
    m8 = _dot32(m4, m4, PRECISION)
    p = p + _dot32(p, m8, PRECISION)
    return p


@triton.jit
def _cum_blocks(x0, x1, x2, x3):
    """Cumulative sums down a 64-row chunk held as four 16-row blocks (vectors or tiles)."""
    c0 = tl.cumsum(x0, 0)
    t0 = tl.sum(x0, 0)
    c1 = tl.cumsum(x1, 0) + t0
    t1 = t0 + tl.sum(x1, 0)
    c2 = tl.cumsum(x2, 0) + t1
    t2 = t1 + tl.sum(x2, 0)
    c3 = tl.cumsum(x3, 0) + t2
    return c0, c1, c2, c3


@triton.jit
def _store_square_block(base, value, tok0, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, hv,
                        n_valid):
    sub = tl.arange(0, SUB)
    ptrs, mask = square_ptrs(base, tok0, sub + I * SUB, HV, hv, sub + J * SUB, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _store_lower_blocks(base, tok0, HV: tl.constexpr, hv, n_valid,
                        m00, m10, m11, m20, m21, m22, m30, m31, m32, m33):
    """A lower block-triangular 64x64 matrix given by its 10 blocks; the upper blocks are zeros."""
    zero = tl.zeros([SUB, SUB], dtype=tl.float32)
    _store_square_block(base, m00, tok0, 0, 0, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 0, 1, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 0, 2, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 0, 3, HV, hv, n_valid)
    _store_square_block(base, m10, tok0, 1, 0, HV, hv, n_valid)
    _store_square_block(base, m11, tok0, 1, 1, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 1, 2, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 1, 3, HV, hv, n_valid)
    _store_square_block(base, m20, tok0, 2, 0, HV, hv, n_valid)
    _store_square_block(base, m21, tok0, 2, 1, HV, hv, n_valid)
    _store_square_block(base, m22, tok0, 2, 2, HV, hv, n_valid)
    _store_square_block(base, zero, tok0, 2, 3, HV, hv, n_valid)
    _store_square_block(base, m30, tok0, 3, 0, HV, hv, n_valid)
    _store_square_block(base, m31, tok0, 3, 1, HV, hv, n_valid)
    _store_square_block(base, m32, tok0, 3, 2, HV, hv, n_valid)
    _store_square_block(base, m33, tok0, 3, 3, HV, hv, n_valid)


@triton.jit
def _log_growth(key_norm2, beta_rows):
    """sum over rows of log max(1, |1 - beta |k|^2|): the log of a bound on the norms of the rows'
    projections I - beta k k^T (rows past n_valid have beta 0 and add nothing)."""
    return tl.sum(tl.maximum(tl.log(tl.abs(1.0 - beta_rows * key_norm2)), 0.0))


@triton.jit(do_not_specialize=["T"])
def gdn_prepare_kernel(k, v, beta, g, g_cum, gk_cum, w, u, ai, a_raw, decay_bound, chunk_map, cu_seqlens, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr,
                       HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       STORE_WU: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
                       STORE_BOUND: tl.constexpr = False):
    """Per chunk: the scalar gate's cumsums, T = (I + A)^-1 (stored) and, with STORE_WU, w and u. Without STORE_WU the caller makes w, u from the stored T with
    gdn_recompute_wu_kernel (two lighter kernels instead of one that spills).
    INVERSE_PRECISION: of the fp32 products of the blockwise inverse ("ieee" or "tf32").
    With gk the gate cumsums and the gated key products A_raw (in `a_raw`, fp32; it may be ai
    itself) come from gdn_gated_pairs_kernel: phase 1 only loads them.
    STORE_BOUND (scalar gate, no gk): the chunk's log bound on the norm of its state transition
    into decay_bound [chunks, HV] (segments.py, "Decayed segments"), from the key norms on the
    diagonals of the key products."""
    hv, head, tok0, n_valid, chunk = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    sub = tl.arange(0, SUB)
    r0, r1, r2, r3 = sub, sub + SUB, sub + 2 * SUB, sub + 3 * SUB
    beta0 = load_vec(beta, tok0, r0, HV, hv, n_valid)
    beta1 = load_vec(beta, tok0, r1, HV, hv, n_valid)
    beta2 = load_vec(beta, tok0, r2, HV, hv, n_valid)
    beta3 = load_vec(beta, tok0, r3, HV, hv, n_valid)
    if HAS_G and HAS_GK:
        b0 = load_vec(g_cum, tok0, r0, HV, hv, n_valid)
        b1 = load_vec(g_cum, tok0, r1, HV, hv, n_valid)
        b2 = load_vec(g_cum, tok0, r2, HV, hv, n_valid)
        b3 = load_vec(g_cum, tok0, r3, HV, hv, n_valid)
    elif HAS_G:
        b0, b1, b2, b3 = _cum_blocks(load_vec(g, tok0, r0, HV, hv, n_valid),
                                     load_vec(g, tok0, r1, HV, hv, n_valid),
                                     load_vec(g, tok0, r2, HV, hv, n_valid),
                                     load_vec(g, tok0, r3, HV, hv, n_valid))
        store_vec(g_cum, b0, tok0, r0, HV, hv, n_valid)
        store_vec(g_cum, b1, tok0, r1, HV, hv, n_valid)
        store_vec(g_cum, b2, tok0, r2, HV, hv, n_valid)
        store_vec(g_cum, b3, tok0, r3, HV, hv, n_valid)
    else:
        b0 = tl.zeros([SUB], dtype=tl.float32)
        b1, b2, b3 = b0, b0, b0

    # Phase 1: the pairwise key products of the 10 lower blocks (read back with gk).
    if HAS_GK:
        a00 = load_square_block(a_raw, tok0, 0, 0, HV, hv, n_valid)
        a10 = load_square_block(a_raw, tok0, 1, 0, HV, hv, n_valid)
        a11 = load_square_block(a_raw, tok0, 1, 1, HV, hv, n_valid)
        a20 = load_square_block(a_raw, tok0, 2, 0, HV, hv, n_valid)
        a21 = load_square_block(a_raw, tok0, 2, 1, HV, hv, n_valid)
        a22 = load_square_block(a_raw, tok0, 2, 2, HV, hv, n_valid)
        a30 = load_square_block(a_raw, tok0, 3, 0, HV, hv, n_valid)
        a31 = load_square_block(a_raw, tok0, 3, 1, HV, hv, n_valid)
        a32 = load_square_block(a_raw, tok0, 3, 2, HV, hv, n_valid)
        a33 = load_square_block(a_raw, tok0, 3, 3, HV, hv, n_valid)
    else:
        a00 = tl.zeros([SUB, SUB], dtype=tl.float32)
        a10, a11, a20, a21, a22, a30, a31, a32, a33 = a00, a00, a00, a00, a00, a00, a00, a00, a00
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            k0 = load_tile(k, tok0, r0, H, head, K, cols, n_valid)
            k1 = load_tile(k, tok0, r1, H, head, K, cols, n_valid)
            k2 = load_tile(k, tok0, r2, H, head, K, cols, n_valid)
            k3 = load_tile(k, tok0, r3, H, head, K, cols, n_valid)
            a00 += tl.dot(k0, tl.trans(k0))
            a10 += tl.dot(k1, tl.trans(k0))
            a11 += tl.dot(k1, tl.trans(k1))
            a20 += tl.dot(k2, tl.trans(k0))
            a21 += tl.dot(k2, tl.trans(k1))
            a22 += tl.dot(k2, tl.trans(k2))
            a30 += tl.dot(k3, tl.trans(k0))
            a31 += tl.dot(k3, tl.trans(k1))
            a32 += tl.dot(k3, tl.trans(k2))
            a33 += tl.dot(k3, tl.trans(k3))

    if STORE_BOUND:
        eye = sub[:, None] == sub[None, :]
        growth = (_log_growth(tl.sum(tl.where(eye, a00, 0.0), 1), beta0)
                  + _log_growth(tl.sum(tl.where(eye, a11, 0.0), 1), beta1)
                  + _log_growth(tl.sum(tl.where(eye, a22, 0.0), 1), beta2)
                  + _log_growth(tl.sum(tl.where(eye, a33, 0.0), 1), beta3))
        # b3's last row is the sum of the chunk's gates (rows past n_valid load as zero)
        decay = tl.sum(tl.where(sub == SUB - 1, b3, 0.0))
        tl.store(decay_bound + chunk * HV + hv, decay + growth)

    # Phase 2: A = diag(beta) (products . Gamma), strictly lower; T = (I + A)^-1 blockwise.
    if HAS_G and not HAS_GK:
        a00 = a00 * scalar_gamma(b0, b0, False, r0 < n_valid)
        a11 = a11 * scalar_gamma(b1, b1, False, r1 < n_valid)
        a22 = a22 * scalar_gamma(b2, b2, False, r2 < n_valid)
        a33 = a33 * scalar_gamma(b3, b3, False, r3 < n_valid)
        a10 = a10 * decay_factor(b1[:, None] - b0[None, :], r1 < n_valid)
        a20 = a20 * decay_factor(b2[:, None] - b0[None, :], r2 < n_valid)
        a21 = a21 * decay_factor(b2[:, None] - b1[None, :], r2 < n_valid)
        a30 = a30 * decay_factor(b3[:, None] - b0[None, :], r3 < n_valid)
        a31 = a31 * decay_factor(b3[:, None] - b1[None, :], r3 < n_valid)
        a32 = a32 * decay_factor(b3[:, None] - b2[None, :], r3 < n_valid)
    else:
        strict = sub[:, None] > sub[None, :]
        a00 = tl.where(strict, a00, 0.0)
        a11 = tl.where(strict, a11, 0.0)
        a22 = tl.where(strict, a22, 0.0)
        a33 = tl.where(strict, a33, 0.0)
    P: tl.constexpr = INVERSE_PRECISION
    t00 = _inv_unit_lower(a00 * beta0[:, None], P)
    t11 = _inv_unit_lower(a11 * beta1[:, None], P)
    t22 = _inv_unit_lower(a22 * beta2[:, None], P)
    t33 = _inv_unit_lower(a33 * beta3[:, None], P)
    a10 = a10 * beta1[:, None]
    a20 = a20 * beta2[:, None]
    a21 = a21 * beta2[:, None]
    a30 = a30 * beta3[:, None]
    a31 = a31 * beta3[:, None]
    a32 = a32 * beta3[:, None]
    # Block forward substitution: T_IJ = -T_II sum_{J <= m < I} A_Im T_mJ.
    t10 = -_dot32(t11, _dot32(a10, t00, P), P)
    t21 = -_dot32(t22, _dot32(a21, t11, P), P)
    t32 = -_dot32(t33, _dot32(a32, t22, P), P)
    t20 = -_dot32(t22, _dot32(a20, t00, P) + _dot32(a21, t10, P), P)
    t31 = -_dot32(t33, _dot32(a31, t11, P) + _dot32(a32, t21, P), P)
    t30 = -_dot32(t33, _dot32(a30, t00, P) + _dot32(a31, t10, P) + _dot32(a32, t20, P), P)
    _store_lower_blocks(ai, tok0, HV, hv, n_valid, t00, t10, t11, t20, t21, t22, t30, t31, t32, t33)

    # Phase 3: w = T diag(beta e^B) K and u = T diag(beta) V.
    if STORE_WU:
        kdt = w.dtype.element_ty
        s00, s10, s11, s20 = t00.to(kdt), t10.to(kdt), t11.to(kdt), t20.to(kdt)
        s21, s22, s30, s31, s32, s33 = t21.to(kdt), t22.to(kdt), t30.to(kdt), t31.to(kdt), t32.to(kdt), t33.to(kdt)
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            if HAS_GK:
                e0 = tl.exp(load_tile(gk_cum, tok0, r0, HV, hv, K, cols, n_valid) + b0[:, None])
                e1 = tl.exp(load_tile(gk_cum, tok0, r1, HV, hv, K, cols, n_valid) + b1[:, None])
                e2 = tl.exp(load_tile(gk_cum, tok0, r2, HV, hv, K, cols, n_valid) + b2[:, None])
                e3 = tl.exp(load_tile(gk_cum, tok0, r3, HV, hv, K, cols, n_valid) + b3[:, None])
            else:
                e0, e1, e2, e3 = tl.exp(b0)[:, None], tl.exp(b1)[:, None], tl.exp(b2)[:, None], tl.exp(b3)[:, None]
            kb0 = (load_tile(k, tok0, r0, H, head, K, cols, n_valid) * e0 * beta0[:, None]).to(kdt)
            kb1 = (load_tile(k, tok0, r1, H, head, K, cols, n_valid) * e1 * beta1[:, None]).to(kdt)
            kb2 = (load_tile(k, tok0, r2, H, head, K, cols, n_valid) * e2 * beta2[:, None]).to(kdt)
            kb3 = (load_tile(k, tok0, r3, H, head, K, cols, n_valid) * e3 * beta3[:, None]).to(kdt)
            store_tile(w, tl.dot(s00, kb0), tok0, r0, HV, hv, K, cols, n_valid)
            store_tile(w, tl.dot(s10, kb0) + tl.dot(s11, kb1), tok0, r1, HV, hv, K, cols, n_valid)
            store_tile(w, tl.dot(s20, kb0) + tl.dot(s21, kb1) + tl.dot(s22, kb2), tok0, r2, HV, hv, K, cols, n_valid)
            store_tile(w, tl.dot(s30, kb0) + tl.dot(s31, kb1) + tl.dot(s32, kb2) + tl.dot(s33, kb3),
                        tok0, r3, HV, hv, K, cols, n_valid)
        vdt = u.dtype.element_ty
        s00, s10, s11, s20 = t00.to(vdt), t10.to(vdt), t11.to(vdt), t20.to(vdt)
        s21, s22, s30, s31, s32, s33 = t21.to(vdt), t22.to(vdt), t30.to(vdt), t31.to(vdt), t32.to(vdt), t33.to(vdt)
        for v_start in range(0, V, BV):
            cols = v_start + tl.arange(0, BV)
            vb0 = (load_tile(v, tok0, r0, HV, hv, V, cols, n_valid) * beta0[:, None]).to(vdt)
            vb1 = (load_tile(v, tok0, r1, HV, hv, V, cols, n_valid) * beta1[:, None]).to(vdt)
            vb2 = (load_tile(v, tok0, r2, HV, hv, V, cols, n_valid) * beta2[:, None]).to(vdt)
            vb3 = (load_tile(v, tok0, r3, HV, hv, V, cols, n_valid) * beta3[:, None]).to(vdt)
            store_tile(u, tl.dot(s00, vb0), tok0, r0, HV, hv, V, cols, n_valid)
            store_tile(u, tl.dot(s10, vb0) + tl.dot(s11, vb1), tok0, r1, HV, hv, V, cols, n_valid)
            store_tile(u, tl.dot(s20, vb0) + tl.dot(s21, vb1) + tl.dot(s22, vb2), tok0, r2, HV, hv, V, cols, n_valid)
            store_tile(u, tl.dot(s30, vb0) + tl.dot(s31, vb1) + tl.dot(s32, vb2) + tl.dot(s33, vb3),
                        tok0, r3, HV, hv, V, cols, n_valid)


@triton.jit
def _t_times_scaled_rows(tmat, row_scale, src, src_heads, src_head, dst, dst_heads, dst_head,
                         D: tl.constexpr, BD: tl.constexpr, tok0, rows, n_valid, hv, HV: tl.constexpr,
                         key_gate=None, row_log=None, q=None, q_gated=None, k_gated=None):
    """dst = T diag(row_scale) src for one chunk, in [64, BD] tiles over the head dim D; with
    key_gate ([.., HV, D] fp32, the per-key gate cumsums) src is gated element-wise by
    e^(key_gate + row_log) first, as prepare gates it, and with k_gated (src = k) the gated k and
    q of the state passes are stored from the same tiles (key_gates.store_gated_qk)."""
    dt = dst.dtype.element_ty
    t_dt = tmat.to(dt)
    for start in range(0, D, BD):
        cols = start + tl.arange(0, BD)
        src_tile = load_tile(src, tok0, rows, src_heads, src_head, D, cols, n_valid)
        x = src_tile * row_scale[:, None]
        if key_gate is not None:
            gate_tile = load_tile(key_gate, tok0, rows, HV, hv, D, cols, n_valid)
            x = x * tl.exp(gate_tile + row_log[:, None])
            if k_gated is not None:
                q_tile = load_tile(q, tok0, rows, src_heads, src_head, D, cols, n_valid).to(tl.float32)
                store_gated_qk(gate_tile, src_tile.to(tl.float32), q_tile, q_gated, k_gated, tok0, rows, hv, cols,
                               n_valid, HV, D, True)
        store_tile(dst, tl.dot(t_dt, x.to(dt)), tok0, rows, dst_heads, dst_head, D, cols, n_valid)


@triton.jit(do_not_specialize=["T"])
def gdn_recompute_wu_kernel(k, v, beta, g_cum, gk_cum, ai, w, u, q, q_gated, k_gated, chunk_map, cu_seqlens, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr,
                            HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_U: tl.constexpr):
    """The backward's w = T diag(beta e^g) K (with gk_cum: T diag(beta) (K . e^(g + gk))) and
    (STORE_U) u = T diag(beta) V, from the T and gate cumsums that the forward kept: one 64-row
    product per tile instead of a second prepare. Without u the state pass forms v_new from T
    itself. With k_gated (and gk_cum) also the gated k and q of the state passes
    (key_gates.store_gated_qk), from the tiles w is formed from."""
    hv, head, tok0, n_valid, _ = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    tmat, beta_t = chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
    b = tl.zeros([CHUNK], dtype=tl.float32)  # the scalar gate's cumsum: in the key gate with gk
    row_scale = beta_t
    if HAS_G:
        b = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
        if gk_cum is None:
            row_scale = tl.exp(b) * beta_t
    _t_times_scaled_rows(tmat, row_scale, k, H, head, w, HV, hv, K, BK, tok0, rows, n_valid, hv, HV, gk_cum, b,
                         q, q_gated, k_gated)
    if STORE_U:
        _t_times_scaled_rows(tmat, beta_t, v, HV, hv, u, HV, hv, V, BV, tok0, rows, n_valid, hv, HV)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def inverse_buffer(k, HV: int):
    """The buffer of T = (I + A)^-1 per chunk ([B, T, HV, 64]), in the input type: each use
    rounds T to that type anyway, and its bytes are read up to four times."""
    B, T = k.shape[:2]
    return torch.empty(B, T, HV, CHUNK_ROWS, device=k.device, dtype=k.dtype)


def raw_products_buffer(k, HV: int, ai):
    """With gk, the buffer of the gated key products A_raw (gdn_gated_pairs_kernel writes them,
    the prepare pass inverts them into T): fp32, so ai itself for fp32 inputs (inverted in
    place), else a buffer of its own, freed after the prepare pass."""
    if ai.dtype == torch.float32:
        return ai
    B, T = k.shape[:2]
    return torch.empty(B, T, HV, CHUNK_ROWS, device=k.device, dtype=torch.float32)


def prepare(plan, layout: ChunkLayout, k, v, beta, g, g_cum, gk_cum, ai, store_wu: bool, decay_bound=None,
            a_raw=None):
    """T = (I + A)^-1 per chunk into ai, the scalar gate's cumsums (unless g_cum is given: with
    gk they come from the gated-pair kernel, and the gated key products in a_raw), with store_wu
    w and u, and with decay_bound
    ([layout.num_chunk_states, HV] fp32; scalar gate, no gk) each chunk's transition bound. -> (g_cum, w, u);
    w, u None without store_wu."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    has_g, has_gk = g is not None, gk_cum is not None
    if has_g and g_cum is None:
        g_cum = torch.empty(B, T, HV, device=dev, dtype=torch.float32)
    w = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype) if store_wu else None
    u = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype) if store_wu else None
    cfg = plan.launch(plan.prepare_pass)
    chunk_map, cu = chunk_args(layout)
    launch(gdn_prepare_kernel, (layout.num_slots, B * HV),
           k, v, beta, g, g_cum, gk_cum, w, u, ai, a_raw, decay_bound, chunk_map, cu, T,
           H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=has_g, HAS_GK=has_gk,
           IS_VARLEN=layout.is_varlen, STORE_WU=store_wu, INVERSE_PRECISION=plan.inverse_precision,
           STORE_BOUND=decay_bound is not None, **cfg.launch_options())
    return g_cum, w, u


def recompute_wu(plan, layout: ChunkLayout, k, v, beta, g_cum, ai, with_u: bool = True, gk_cum=None, q=None):
    """w and (with_u) u from the forward's T and gate cumsums (with gk, its cumsums gk_cum too);
    with q (and gk_cum) also the gated k and q of the state passes, per value head.
    -> (w, u or None, k_gated or None, q_gated or None)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    w = torch.empty(B, T, HV, K, device=dev, dtype=k.dtype)
    u = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype) if with_u else None
    gated = q is not None and gk_cum is not None
    k_gated, q_gated = gated_qk_buffers(q, k, HV, True) if gated else (None, None)
    cfg = plan.launch("recompute_wu")
    chunk_map, cu = chunk_args(layout)
    launch(gdn_recompute_wu_kernel, (layout.num_slots, B * HV),
           k, v, beta, g_cum, gk_cum, ai, w, u, q if gated else None, q_gated, k_gated, chunk_map, cu, T,
           H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
           IS_VARLEN=layout.is_varlen, STORE_U=with_u, **cfg.launch_options())
    return w, u, k_gated, q_gated
