"""With the per-key gate gk: the gated key-key and query-key products of a chunk, one 16x16 block
per program (forward), and the gradients through both (backward), with the gate factorisation
around reference rows described in common.py."""
import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from ..layout import BLOCKS_PER_CHUNK, CHUNK as CHUNK_ROWS, ChunkLayout
from .common import (
    BLOCKS, SUB, chunk_args, chunk_part_program, column_of, decay_factor, factors_fit, key_gate_rows,
    load_tile, load_vec, outer_and_block, reference_gate, row_of, square_ptrs, store_vec, tile_ptrs
)


@triton.jit(do_not_specialize=["T"])
def gdn_gated_pairs_kernel(q, k, g_cum, gk_cum, a_raw, aqk, chunk_map, cu_seqlens, T, scale,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """With the per-key gate: one 16x16 block (I, J) of a chunk's gated pair products per program
    (part I * 4 + J of the chunk's 16 on grid axis 0), with B the total per-key log decay,
        A_raw[i, j] = sum_k k_i[k] k_j[k] e^(B_i[k] - B_j[k])           (strictly lower)
        Aqk[i, j]   = scale sum_k q_i[k] k_j[k] e^(B_i[k] - B_j[k])     (lower, diagonal included)
    factorised around a reference row r as in the module docstring. Blocks above the diagonal of
    Aqk are written as zeros. gdn_prepare_kernel takes A_raw on from here (with gk): 16
    small programs per chunk instead of all products in the prepare program, which spilled."""
    hv, head, tok0, n_valid, _, part = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, BLOCKS * BLOCKS)
    bi, bj = outer_and_block(part)
    sub = tl.arange(0, SUB)
    rows_i = sub + bi * SUB
    rows_j = sub + bj * SUB
    sq_ptrs, sq_mask = square_ptrs(aqk, tok0, rows_i, HV, hv, rows_j, n_valid)
    if bj > bi:
        tl.store(sq_ptrs, tl.zeros([SUB, SUB], dtype=tl.float32), mask=sq_mask)
    else:
        acc_a = tl.zeros([SUB, SUB], dtype=tl.float32)
        acc_p = tl.zeros([SUB, SUB], dtype=tl.float32)
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            gate_i = key_gate_rows(g_cum, gk_cum, tok0, rows_i, hv, HV, K, cols, n_valid, HAS_G)
            gate_j = key_gate_rows(g_cum, gk_cum, tok0, rows_j, hv, HV, K, cols, n_valid, HAS_G)
            ref = reference_gate(g_cum, gk_cum, tok0, bi, bj, hv, HV, K, cols, n_valid, HAS_G)
            left_exponent = gate_i - ref[None, :]
            right_exponent = ref[None, :] - gate_j
            if factors_fit(left_exponent, rows_i < n_valid, right_exponent, rows_j < n_valid):
                left = decay_factor(left_exponent, rows_i < n_valid)
                right = (load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
                         * decay_factor(right_exponent, rows_j < n_valid))
                k_rows = load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                q_rows = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                acc_a += tl.dot(k_rows * left, tl.trans(right))
                acc_p += tl.dot(q_rows * left, tl.trans(right))
            else:  # a diagonal block (I = J) with a strong decay: column j at a time, exactly
                k_rows = load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                q_rows = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                for j in range(0, SUB):
                    keep = (sub >= j)[:, None] & (rows_i < n_valid)[:, None]
                    decay = tl.exp(tl.where(keep, gate_i - row_of(gate_j, sub, j)[None, :], float("-inf")))
                    k_j = row_of(k_rows, sub, j)[None, :]
                    column = (sub == j)[None, :]
                    acc_a += tl.where(column, tl.sum(k_rows * decay * k_j, axis=1)[:, None], 0.0)
                    acc_p += tl.where(column, tl.sum(q_rows * decay * k_j, axis=1)[:, None], 0.0)
        off_diag = bi != bj
        a_keep = (sub[:, None] > sub[None, :]) | off_diag
        p_keep = (sub[:, None] >= sub[None, :]) | off_diag
        tl.store(sq_ptrs, tl.where(p_keep, acc_p * scale, 0.0), mask=sq_mask)
        a_ptrs, a_mask = square_ptrs(a_raw, tok0, rows_i, HV, hv, rows_j, n_valid)
        tl.store(a_ptrs, tl.where(a_keep, acc_a, 0.0), mask=a_mask)


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_gated_pair_grad_kernel(q, k, beta, g_cum, gk_cum, dp, da, dq, dk, dbeta_parts, db, dq_out, dk_out,
                               chunk_map, cu_seqlens, T, part_stride, scale,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                               HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Gradients through the two gated pairwise matrices of a chunk (lower triangles), per key gate,
        P_ij = scale sum_k q_i[k] k_j[k] e^(B_i[k] - B_j[k]),  A_ij = sum_k beta_i k_i[k] k_j[k] e^(...),
    given dP (stored by the dqkw kernel) and dA (by the wy kernel): adds to dq, dk, dbeta and the
    per-key gate terms db, with the forward's factorisation around reference rows. Both share
    their decay factors and k's right-hand factor, so one program does both. One program per
    (chunk, head, K tile, 16-row block b) (part K tile * 4 + b on grid axis 0): row b of dP, dA gives the
    gradients of row b's q and beta k, column b those of row b's k.
    dq_out, dk_out (H = HV; or None): the finished dq and dk in their own dtype, written there
    instead of adding into the fp32 buffers (this program is the last to touch its tile)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, _, part = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK * BLOCKS)
    k_tile, blk = outer_and_block(part)
    sub = tl.arange(0, SUB)
    rows_b = sub + blk * SUB
    valid_b = rows_b < n_valid
    cols = k_tile * BK + tl.arange(0, BK)
    gate_b = key_gate_rows(g_cum, gk_cum, tok0, rows_b, hv, HV, K, cols, n_valid, HAS_G)
    # row b: d(left operand)_b = sum_{J <= b} (dM_bJ (k_J e^(r - B_J))) e^(B_b - r), M = P, A
    dq_b = tl.zeros([SUB, BK], dtype=tl.float32)
    dka_b = tl.zeros([SUB, BK], dtype=tl.float32)
    for bj in range(0, blk + 1):
        rows_j = sub + bj * SUB
        ref = reference_gate(g_cum, gk_cum, tok0, blk, bj, hv, HV, K, cols, n_valid, HAS_G)
        gate_j = key_gate_rows(g_cum, gk_cum, tok0, rows_j, hv, HV, K, cols, n_valid, HAS_G)
        right_exponent = ref[None, :] - gate_j
        left_exponent = gate_b - ref[None, :]
        if factors_fit(left_exponent, valid_b, right_exponent, rows_j < n_valid):
            right = (load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
                     * decay_factor(right_exponent, rows_j < n_valid))
            row_factor = decay_factor(left_exponent, valid_b)
            m_ptrs, m_mask = square_ptrs(dp, tok0, rows_b, HV, hv, rows_j, n_valid)
            dq_b += tl.dot(tl.load(m_ptrs, mask=m_mask, other=0.0), right) * row_factor
            m_ptrs, m_mask = square_ptrs(da, tok0, rows_b, HV, hv, rows_j, n_valid)
            dka_b += tl.dot(tl.load(m_ptrs, mask=m_mask, other=0.0), right) * row_factor
        else:  # the diagonal block (J = b) with a strong decay: column j of dM at a time, exactly
            k_j = load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
            m_ptrs, m_mask = square_ptrs(dp, tok0, rows_b, HV, hv, rows_j, n_valid)
            m_p = tl.load(m_ptrs, mask=m_mask, other=0.0)
            m_ptrs, m_mask = square_ptrs(da, tok0, rows_b, HV, hv, rows_j, n_valid)
            m_a = tl.load(m_ptrs, mask=m_mask, other=0.0)
            for j in range(0, SUB):
                keep = (sub >= j)[:, None] & valid_b[:, None]
                decay = tl.exp(tl.where(keep, gate_b - row_of(gate_j, sub, j)[None, :], float("-inf")))
                k_decayed = row_of(k_j, sub, j)[None, :] * decay
                dq_b += column_of(m_p, sub, j)[:, None] * k_decayed
                dka_b += column_of(m_a, sub, j)[:, None] * k_decayed
    # column b: d(right operand)_b = sum_{I >= b} (dM_Ib^T (a_I e^(B_I - r))) e^(r - B_b), a = q, beta k
    dkp_b = tl.zeros([SUB, BK], dtype=tl.float32)
    dkc_b = tl.zeros([SUB, BK], dtype=tl.float32)
    for bi in range(blk, BLOCKS):
        rows_i = sub + bi * SUB
        ref = reference_gate(g_cum, gk_cum, tok0, bi, blk, hv, HV, K, cols, n_valid, HAS_G)
        gate_i = key_gate_rows(g_cum, gk_cum, tok0, rows_i, hv, HV, K, cols, n_valid, HAS_G)
        left_exponent = gate_i - ref[None, :]
        right_exponent = ref[None, :] - gate_b
        if factors_fit(left_exponent, rows_i < n_valid, right_exponent, valid_b):
            left = decay_factor(left_exponent, rows_i < n_valid)
            q_i = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32) * left
            k_i = (load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32) * left
                   * load_vec(beta, tok0, rows_i, HV, hv, n_valid)[:, None])
            col_factor = decay_factor(right_exponent, valid_b)
            m_ptrs, m_mask = square_ptrs(dp, tok0, rows_i, HV, hv, rows_b, n_valid)
            dkp_b += tl.dot(tl.trans(tl.load(m_ptrs, mask=m_mask, other=0.0)), q_i) * col_factor
            m_ptrs, m_mask = square_ptrs(da, tok0, rows_i, HV, hv, rows_b, n_valid)
            dkc_b += tl.dot(tl.trans(tl.load(m_ptrs, mask=m_mask, other=0.0)), k_i) * col_factor
        else:  # the diagonal block (I = b) with a strong decay: row i of dM at a time, exactly
            q_i = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            k_i = (load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                   * load_vec(beta, tok0, rows_i, HV, hv, n_valid)[:, None])
            m_ptrs, m_mask = square_ptrs(dp, tok0, rows_i, HV, hv, rows_b, n_valid)
            m_p = tl.load(m_ptrs, mask=m_mask, other=0.0)
            m_ptrs, m_mask = square_ptrs(da, tok0, rows_i, HV, hv, rows_b, n_valid)
            m_a = tl.load(m_ptrs, mask=m_mask, other=0.0)
            for i in range(0, SUB):
                keep = (sub <= i)[:, None] & (i < n_valid - bi * SUB)
                decay = tl.exp(tl.where(keep, row_of(gate_i, sub, i)[None, :] - gate_b, float("-inf")))
                dkp_b += row_of(m_p, sub, i)[:, None] * row_of(q_i, sub, i)[None, :] * decay
                dkc_b += row_of(m_a, sub, i)[:, None] * row_of(k_i, sub, i)[None, :] * decay
    q_b = load_tile(q, tok0, rows_b, H, head, K, cols, n_valid).to(tl.float32)
    k_b = load_tile(k, tok0, rows_b, H, head, K, cols, n_valid).to(tl.float32)
    beta_b = load_vec(beta, tok0, rows_b, HV, hv, n_valid)[:, None]
    # gradient buffers are per value head, fp32; this program owns rows b of its K tile
    ptrs, mask = tile_ptrs(db, tok0, rows_b, HV, hv, K, cols, n_valid)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * (q_b * dq_b - k_b * dkp_b)
             + (beta_b * k_b * dka_b - k_b * dkc_b), mask=mask)
    ptrs, mask = tile_ptrs(dq, tok0, rows_b, HV, hv, K, cols, n_valid)
    dq_b = tl.load(ptrs, mask=mask, other=0.0) + scale * dq_b
    if dq_out is not None:
        out_ptrs, _ = tile_ptrs(dq_out, tok0, rows_b, HV, hv, K, cols, n_valid)
        tl.store(out_ptrs, dq_b.to(dq_out.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, dq_b, mask=mask)
    ptrs, mask = tile_ptrs(dk, tok0, rows_b, HV, hv, K, cols, n_valid)
    dk_b = tl.load(ptrs, mask=mask, other=0.0) + scale * dkp_b + beta_b * dka_b + dkc_b
    if dk_out is not None:
        out_ptrs, _ = tile_ptrs(dk_out, tok0, rows_b, HV, hv, K, cols, n_valid)
        tl.store(out_ptrs, dk_b.to(dk_out.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, dk_b, mask=mask)
    # dbeta: this K tile's share into a buffer of its own (the caller sums the tiles in a fixed
    # order: atomics across tiles made dbeta vary in its last bits from run to run)
    store_vec(dbeta_parts + k_tile.to(tl.int64) * part_stride, tl.sum(k_b * dka_b, axis=1),
               tok0, rows_b, HV, hv, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def gated_pairs(plan, layout: ChunkLayout, q, k, g_cum, gk_cum, a_raw, scale: float):
    """With gk: the gated key-key products into a_raw (prepare inverts them there) and the
    query-key products P. -> aqk [B, T, HV, 64] fp32."""
    B, T, H, K = k.shape
    HV = gk_cum.shape[2]
    aqk = torch.empty(B, T, HV, CHUNK_ROWS, device=k.device, dtype=torch.float32)
    cfg = plan.launch("gated_pairs")
    chunk_map, cu = chunk_args(layout)
    launch(gdn_gated_pairs_kernel, (layout.num_slots * BLOCKS_PER_CHUNK * BLOCKS_PER_CHUNK, B * HV),
           q, k, g_cum, gk_cum, a_raw, aqk, chunk_map, cu, T, scale,
           H=H, HV=HV, K=K, BK=cfg.block_k, HAS_G=g_cum is not None, IS_VARLEN=layout.is_varlen,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return aqk


def pair_gradients(plan, layout: ChunkLayout, q, k, beta, g_cum, gk_cum, d_p, d_a, dq, dk, dbeta, db,
                   scale: float, final_dtype: bool = False):
    """With gk: both pairwise matrices' gradients at once, added to dq, dk, dbeta and db (after
    the WY kernel: all the adds commute). final_dtype (q/k heads = value heads): -> (dq, dk) in
    q's and k's dtype, written by the kernel (no fp32 write-back and cast); else None and the
    sums land in the fp32 dq, dk."""
    B, T, H, K = k.shape
    HV = gk_cum.shape[2]
    cfg = plan.launch("pair_grad")
    k_tiles = ceil_div(K, cfg.block_k)
    dbeta_parts = torch.empty(k_tiles, B, T, HV, device=k.device, dtype=torch.float32)
    dq_out = torch.empty_like(q) if final_dtype else None
    dk_out = torch.empty_like(k) if final_dtype else None
    chunk_map, cu = chunk_args(layout)
    launch(gdn_gated_pair_grad_kernel, (layout.num_slots * k_tiles * BLOCKS_PER_CHUNK, B * HV),
           q, k, beta, g_cum, gk_cum, d_p, d_a, dq, dk, dbeta_parts, db, dq_out, dk_out, chunk_map,
           cu, T, B * T * HV, scale, H=H, HV=HV, K=K, BK=cfg.block_k, HAS_G=g_cum is not None,
           IS_VARLEN=layout.is_varlen, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    dbeta += dbeta_parts.sum(0)
    return (dq_out, dk_out) if final_dtype else None
