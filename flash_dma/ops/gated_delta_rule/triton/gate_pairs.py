"""With the per-key gate gk: the gated key-key and query-key products of a chunk (forward, which
also forms the gate cumsums and gated q, k from the same tiles) and the gradients through both
(backward). Each pass is two kernels: whole [64, 64] products, one
program per chunk (and K tile in the backward), where every key's log decay spans at most 120
over the chunk (per-token decays above about e^-1.9 on average); then 16-row block by block,
with the gate factorisation around reference rows described in common.py, on the same grid,
for the chunks the first left (its programs flag them; the others exit at once).
Two kernels rather than two branches of one: the blockwise branch's registers slowed the whole-
chunk form."""
import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .. import launch_table
from ..layout import CHUNK as CHUNK_ROWS, ChunkLayout
from .common import (
    BLOCKS, CHUNK, SUB, chunk_args, chunk_part_program, chunk_program, column_of, decay_factor, factors_fit,
    key_gate_rows, load_tile, load_vec, reference_gate, row_of, square_ptrs, store_tile, store_vec, tile_ptrs
)
from .key_gates import gate_buffers, key_gate_tile, scalar_gate_cumsum


# The whole-chunk form's largest factor exponent: with the reference at the middle of each key's
# range, a chunk whose log decays span up to twice this takes [64, 64] products at once. Its
# factors stay below e^60, which leaves fp32 room for the sums of the kept pairs (e^88.7
# overflows; the forward's dropped pairs above the diagonal may reach it).
CHUNK_FACTOR_EXPONENT = tl.constexpr(60.0)


@triton.jit
def chunk_reference(gate, valid_rows):
    """Per key column of a chunk's [64, BK] total log decay B: the reference r = (max + min) / 2
    over the valid rows, and whether the half range (max - min) / 2, the largest exponent of
    e^(B - r) and e^(r - B) there, is at most CHUNK_FACTOR_EXPONENT (r = 0 where no row is
    valid). NaN gates: the GPU's reductions skip NaN, so NaN reaches the products as it would
    the blockwise form's."""
    some = tl.sum(valid_rows.to(tl.int32), axis=0) > 0
    high = tl.where(some, tl.max(tl.where(valid_rows[:, None], gate, float("-inf")), axis=0), 0.0)
    low = tl.where(some, tl.min(tl.where(valid_rows[:, None], gate, float("inf")), axis=0), 0.0)
    return 0.5 * (high + low), 0.5 * (high - low) <= CHUNK_FACTOR_EXPONENT


@triton.jit
def chunk_factors(gate, ref, keep):
    """e^(B - r) and e^(r - B) of a [64, BK] tile where keep (broadcast to it), else 0."""
    return (tl.exp(tl.where(keep, gate - ref[None, :], float("-inf"))),
            tl.exp(tl.where(keep, ref[None, :] - gate, float("-inf"))))


@triton.jit
def blocks_flag(needs_blocks):
    """This program's entry of needs_blocks, one int8 per program of a whole-chunk kernel (chunk
    slot and K tile on grid axis 0, batch x value head on axis 1); its blockwise kernel runs on
    the same grid."""
    return needs_blocks + tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def store_gated_block(q, k, g_cum, gk_cum, a_raw, aqk, tok0, hv, head, n_valid, bi, bj, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, HAS_G: tl.constexpr):
    """Block (I, J) of both gated products, factorised around the block pair's reference row
    (zeros above the diagonal)."""
    sub = tl.arange(0, SUB)
    rows_i = sub + bi * SUB
    rows_j = sub + bj * SUB
    sq_ptrs, sq_mask = square_ptrs(aqk, tok0, rows_i, HV, hv, rows_j, n_valid)
    a_ptrs, a_mask = square_ptrs(a_raw, tok0, rows_i, HV, hv, rows_j, n_valid)
    if bj > bi:
        tl.store(sq_ptrs, tl.zeros([SUB, SUB], dtype=tl.float32), mask=sq_mask)
        tl.store(a_ptrs, tl.zeros([SUB, SUB], dtype=tl.float32), mask=a_mask)
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
            k_rows = load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            q_rows = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            if factors_fit(left_exponent, rows_i < n_valid, right_exponent, rows_j < n_valid):
                left = decay_factor(left_exponent, rows_i < n_valid)
                right = (load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
                         * decay_factor(right_exponent, rows_j < n_valid))
                acc_a += tl.dot(k_rows * left, tl.trans(right))
                acc_p += tl.dot(q_rows * left, tl.trans(right))
            else:  # a diagonal block (I = J) with a strong decay: column j at a time, exactly
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
        tl.store(a_ptrs, tl.where(a_keep, acc_a, 0.0), mask=a_mask)


@triton.jit(do_not_specialize=["T"])
def gdn_gated_pairs_kernel(q, k, g, gk, g_cum, gk_cum, q_gated, k_gated, a_raw, aqk, needs_blocks, chunk_map,
                           cu_seqlens, T, scale,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                           HAS_G: tl.constexpr, STORE_Q_GATED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """With the per-key gate: a chunk's gate cumsums and gated k (and q) (key_gates.key_gate_tile)
    and, from the same tiles, its gated pair products, one program per (chunk, value head), with
    B the total per-key log decay,
        A_raw[i, j] = sum_k k_i[k] k_j[k] e^(B_i[k] - B_j[k])           (strictly lower)
        Aqk[i, j]   = scale sum_k q_i[k] k_j[k] e^(B_i[k] - B_j[k])     (lower, diagonal included)
    as [64, 64] products around each key's middle reference r: (a e^(B - r)) (k e^(r - B))^T
    (the pairs above the diagonal may overflow to inf near the limit; they are dropped).
    Where some key's decay spans more than 2 CHUNK_FACTOR_EXPONENT over the chunk no product is
    stored and needs_blocks[program] is set: gdn_gated_pair_blocks_kernel forms that chunk.
    gdn_prepare_kernel takes A_raw on from here."""
    hv, head, tok0, n_valid, _ = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    valid = rows < n_valid
    if HAS_G:
        g_rows = scalar_gate_cumsum(g, g_cum, tok0, rows, hv, HV, n_valid)
    acc_a = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    acc_p = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    misfits = tl.zeros([BK], dtype=tl.int32)
    for k_start in range(0, K, BK):  # optimistic: the products are kept only if every key fits
        cols = k_start + tl.arange(0, BK)
        gate, k_rows, q_rows = key_gate_tile(gk, gk_cum, q, k, q_gated, k_gated, tok0, rows, hv, head, cols,
                                             n_valid, H, HV, K, STORE_Q_GATED)
        if HAS_G:
            gate += g_rows[:, None]
        ref, key_fits = chunk_reference(gate, valid)
        misfits += (key_fits == 0).to(tl.int32)
        if tl.sum(misfits, axis=0) == 0:  # once a key does not fit, the products are not kept
            left, right = chunk_factors(gate, ref, valid[:, None])
            right = k_rows * right
            acc_a += tl.dot(k_rows * left, tl.trans(right))
            acc_p += tl.dot(q_rows * left, tl.trans(right))
    fits = tl.sum(misfits, axis=0) == 0
    tl.store(blocks_flag(needs_blocks), (fits == 0).to(tl.int8))
    if fits:
        sq_ptrs, sq_mask = square_ptrs(aqk, tok0, rows, HV, hv, rows, n_valid)
        tl.store(sq_ptrs, tl.where(rows[:, None] >= rows[None, :], acc_p * scale, 0.0), mask=sq_mask)
        a_ptrs, a_mask = square_ptrs(a_raw, tok0, rows, HV, hv, rows, n_valid)
        tl.store(a_ptrs, tl.where(rows[:, None] > rows[None, :], acc_a, 0.0), mask=a_mask)


@triton.jit(do_not_specialize=["T"])
def gdn_gated_pair_blocks_kernel(q, k, g, gk, g_cum, gk_cum, q_gated, k_gated, a_raw, aqk, needs_blocks,
                                 chunk_map, cu_seqlens, T, scale,
                                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                                 HAS_G: tl.constexpr, STORE_Q_GATED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The same products 16x16 block by block, factorised around reference rows as in common.py,
    for the chunks gdn_gated_pairs_kernel left (needs_blocks): one program per chunk, as there;
    the others exit at once. (It takes the whole-chunk kernel's arguments; the gates are formed
    there.)"""
    hv, head, tok0, n_valid, _ = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    if tl.load(blocks_flag(needs_blocks)) != 0:
        for bi in range(0, BLOCKS):
            for bj in range(0, BLOCKS):
                store_gated_block(q, k, g_cum, gk_cum, a_raw, aqk, tok0, hv, head, n_valid, bi, bj, scale,
                                  H, HV, K, BK, HAS_G)


@triton.jit
def chunk_pair_gradients(q, k, beta, dp, da, gate, ref, tok0, rows, hv, head, n_valid, cols,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    """The whole-chunk form of the four gradient tiles ([64, BK]) of gdn_gated_pair_grad_kernel:
    rows  d(left operand) = (dM (k e^(r - B))) e^(B - r),
    columns d(right operand) = (dM^T (a e^(B - r))) e^(r - B),  M = P, A; a = q, beta k.
    dM is masked to its triangle here, so the factors of the pairs it drops never meet a product."""
    left, right = chunk_factors(gate, ref, (rows < n_valid)[:, None])
    k_rows = load_tile(k, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
    # the triangles by the loads' masks, not a select after them: half the bytes, fewer registers
    m_ptrs, m_mask = square_ptrs(dp, tok0, rows, HV, hv, rows, n_valid)
    d_p = tl.load(m_ptrs, mask=m_mask & (rows[:, None] >= rows[None, :]), other=0.0)
    m_ptrs, m_mask = square_ptrs(da, tok0, rows, HV, hv, rows, n_valid)
    d_a = tl.load(m_ptrs, mask=m_mask & (rows[:, None] > rows[None, :]), other=0.0)
    # bf16 products for bf16 inputs (bf16 has fp32's range: the factors reach e^60); fp16's range
    # ends at e^11, so fp16 and fp32 inputs multiply in fp32
    dt = tl.bfloat16 if k.dtype.element_ty == tl.bfloat16 else tl.float32
    k_right = (k_rows * right).to(dt)
    d_p = d_p.to(dt)
    d_a = d_a.to(dt)
    dq_c = tl.dot(d_p, k_right) * left
    dka_c = tl.dot(d_a, k_right) * left
    q_left = (load_tile(q, tok0, rows, H, head, K, cols, n_valid).to(tl.float32) * left).to(dt)
    bk_left = (k_rows * left * load_vec(beta, tok0, rows, HV, hv, n_valid)[:, None]).to(dt)
    dkp_c = tl.dot(tl.trans(d_p), q_left) * right
    dkc_c = tl.dot(tl.trans(d_a), bk_left) * right
    return dq_c, dka_c, dkp_c, dkc_c


@triton.jit
def pair_grad_tile(base, tok0, rows, HV: tl.constexpr, hv, cols, n_valid):
    """A [rows, cols] tile of dP or dA (bf16 for bf16 inputs), widened to fp32."""
    ptrs, mask = square_ptrs(base, tok0, rows, HV, hv, cols, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def block_pair_gradients(q, k, beta, g_cum, gk_cum, dp, da, tok0, hv, head, n_valid, blk, cols,
                         H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, HAS_G: tl.constexpr):
    """The same four tiles for the 16 rows of block b ([16, BK]), block pair by block pair:
    row b of dP, dA gives the gradients of row b's q and beta k, column b those of row b's k.
    The products are fp32 here (exact where the decays are strong), so dP and dA are widened;
    for bf16 inputs they arrive rounded to bf16 (common.pair_gradient_dtype)."""
    BK: tl.constexpr = cols.shape[0]
    sub = tl.arange(0, SUB)
    rows_b = sub + blk * SUB
    valid_b = rows_b < n_valid
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
            dq_b += tl.dot(pair_grad_tile(dp, tok0, rows_b, HV, hv, rows_j, n_valid), right) * row_factor
            dka_b += tl.dot(pair_grad_tile(da, tok0, rows_b, HV, hv, rows_j, n_valid), right) * row_factor
        else:  # the diagonal block (J = b) with a strong decay: column j of dM at a time, exactly
            k_j = load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
            m_p = pair_grad_tile(dp, tok0, rows_b, HV, hv, rows_j, n_valid)
            m_a = pair_grad_tile(da, tok0, rows_b, HV, hv, rows_j, n_valid)
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
            dkp_b += tl.dot(tl.trans(pair_grad_tile(dp, tok0, rows_i, HV, hv, rows_b, n_valid)), q_i) * col_factor
            dkc_b += tl.dot(tl.trans(pair_grad_tile(da, tok0, rows_i, HV, hv, rows_b, n_valid)), k_i) * col_factor
        else:  # the diagonal block (I = b) with a strong decay: row i of dM at a time, exactly
            q_i = load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            k_i = (load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
                   * load_vec(beta, tok0, rows_i, HV, hv, n_valid)[:, None])
            m_p = pair_grad_tile(dp, tok0, rows_i, HV, hv, rows_b, n_valid)
            m_a = pair_grad_tile(da, tok0, rows_i, HV, hv, rows_b, n_valid)
            for i in range(0, SUB):
                keep = (sub <= i)[:, None] & (i < n_valid - bi * SUB)
                decay = tl.exp(tl.where(keep, row_of(gate_i, sub, i)[None, :] - gate_b, float("-inf")))
                dkp_b += row_of(m_p, sub, i)[:, None] * row_of(q_i, sub, i)[None, :] * decay
                dkc_b += row_of(m_a, sub, i)[:, None] * row_of(k_i, sub, i)[None, :] * decay
    return dq_b, dka_b, dkp_b, dkc_b


@triton.jit
def finish_pair_gradients(q, k, beta, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts, part, dq_out, dk_out, tok0, rows,
                          hv, head, n_valid, cols, chunk, scale, dq_r, dka_r, dkp_r, dkc_r,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, HAS_G: tl.constexpr):
    """Adds rows `rows` of the four gradient tiles to the dq and dk of the dqkw pass and the dk
    terms of the WY pass (dk_wy), writes dq and dk (into the fp32 buffers dq, dk, or finished to
    dq_out, dk_out), this K tile's dbeta share and (HAS_G) its share of the scalar gate's terms
    (the row sums) at offset `part` of dbeta_parts and dg_parts, and returns the per-key gate
    terms db of all three passes (zero past n_valid).
    Each part's gate terms are its operand times its gradient, signed as its decay's exponent:
        db = q dq - k (dk_dqkw - dk_wy + scale dkp - beta dka + dkc)  (+ d_last on the last row).
    This program owns these rows of its K tile."""
    q_r = load_tile(q, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
    k_r = load_tile(k, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
    beta_r = load_vec(beta, tok0, rows, HV, hv, n_valid)[:, None]
    last = tl.load(d_last + (chunk.to(tl.int64) * HV + hv) * K + cols, mask=cols < K, other=0.0)
    # gradient buffers are per value head, fp32
    ptrs, mask = tile_ptrs(dq, tok0, rows, HV, hv, K, cols, n_valid)
    dq_r = tl.load(ptrs, mask=mask, other=0.0) + scale * dq_r
    gate = q_r * dq_r
    if dq_out is not None:
        out_ptrs, _ = tile_ptrs(dq_out, tok0, rows, HV, hv, K, cols, n_valid)
        tl.store(out_ptrs, dq_r.to(dq_out.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, dq_r, mask=mask)
    ptrs, mask = tile_ptrs(dk, tok0, rows, HV, hv, K, cols, n_valid)
    dk_first = tl.load(ptrs, mask=mask, other=0.0)
    dk_second = load_tile(dk_wy, tok0, rows, HV, hv, K, cols, n_valid)
    dk_pairs = scale * dkp_r + beta_r * dka_r + dkc_r
    store_vec(dbeta_parts + part, tl.sum(k_r * dka_r, axis=1), tok0, rows, HV, hv, n_valid)
    gate -= k_r * (dk_first - dk_second + dk_pairs - 2.0 * beta_r * dka_r)
    dk_r = dk_first + dk_second + dk_pairs
    if dk_out is not None:
        out_ptrs, _ = tile_ptrs(dk_out, tok0, rows, HV, hv, K, cols, n_valid)
        tl.store(out_ptrs, dk_r.to(dk_out.dtype.element_ty), mask=mask)
    else:
        tl.store(ptrs, dk_r, mask=mask)
    gate += tl.where((rows == n_valid - 1)[:, None], last[None, :], 0.0)
    gate = tl.where((rows < n_valid)[:, None], gate, 0.0)
    if HAS_G:
        store_vec(dg_parts + part, tl.sum(gate, axis=1), tok0, rows, HV, hv, n_valid)
    return gate


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_gated_pair_grad_kernel(q, k, beta, g_cum, gk_cum, dp, da, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts, dgk,
                               dq_out, dk_out,
                               needs_blocks, chunk_map, cu_seqlens, T, part_stride, scale,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                               HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Gradients through the two gated pairwise matrices of a chunk (lower triangles), per key gate,
        P_ij = scale sum_k q_i[k] k_j[k] e^(B_i[k] - B_j[k]),  A_ij = sum_k beta_i k_i[k] k_j[k] e^(...),
    given dP (stored by the dqkw kernel) and dA (by the wy kernel): adds to dq, dk (both passes'
    parts), and from the per-key gate terms of all three passes writes dgk (their reverse cumsum
    down the chunk, since gk enters through its chunk-local cumsum), this K tile's dbeta share
    and (HAS_G) its share of dg's terms. Both products share their
    decay factors and k's right-hand factor, so one program does both: one per (chunk, value
    head, K tile) (part K tile on grid axis 0), as [64, 64] products around each key's middle
    reference. Where the tile's decays span more
    than 2 CHUNK_FACTOR_EXPONENT over the chunk it sets needs_blocks[program] instead, for
    gdn_gated_pair_grad_blocks_kernel.
    dq_out, dk_out (H = HV; or None): the finished dq and dk in their own dtype, written there
    instead of adding into the fp32 buffers (this program is the last to touch its tile)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, chunk, k_tile = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK)
    rows = tl.arange(0, CHUNK)
    cols = k_tile * BK + tl.arange(0, BK)
    gate = key_gate_rows(g_cum, gk_cum, tok0, rows, hv, HV, K, cols, n_valid, HAS_G)
    ref, key_fits = chunk_reference(gate, rows < n_valid)
    fits = tl.sum((key_fits == 0).to(tl.int32), axis=0) == 0
    tl.store(blocks_flag(needs_blocks), (fits == 0).to(tl.int8))
    if fits:
        dq_c, dka_c, dkp_c, dkc_c = chunk_pair_gradients(q, k, beta, dp, da, gate, ref, tok0, rows, hv,
                                                         head, n_valid, cols, H, HV, K)
        # dbeta: this K tile's share into a buffer of its own (the gate-gradient kernel sums the
        # tiles in a fixed order: atomics across tiles made dbeta vary in its last bits from run to run)
        terms = finish_pair_gradients(q, k, beta, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts,
                                      k_tile.to(tl.int64) * part_stride, dq_out, dk_out, tok0, rows, hv, head,
                                      n_valid, cols, chunk, scale, dq_c, dka_c, dkp_c, dkc_c, H, HV, K, HAS_G)
        # dgk down the chunk by Triton's reverse scan (as sum - cumsum + x, common.reverse_cumsum,
        # ptxas spilled 120 bytes under the kernel's register cap where it spills 32)
        store_tile(dgk, tl.cumsum(terms, 0, reverse=True), tok0, rows, HV, hv, K, cols, n_valid)


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_gated_pair_grad_blocks_kernel(q, k, beta, g_cum, gk_cum, dp, da, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts,
                                      dgk, dq_out, dk_out,
                                      needs_blocks, chunk_map, cu_seqlens, T, part_stride, scale,
                                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                                      HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The same gradients 16-row block by block, with the forward's factorisation around
    reference rows, for the (chunk, K tile)s gdn_gated_pair_grad_kernel left (needs_blocks): one
    program per (chunk, value head, K tile), as there; the others exit at once. Each block's gate
    terms wait in dgk (fp32) until the last block, then the whole tile is reverse-cumsummed in
    place (no sum carried through the loop)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, chunk, k_tile = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK)
    if tl.load(blocks_flag(needs_blocks)) != 0:
        cols = k_tile * BK + tl.arange(0, BK)
        for blk in range(0, BLOCKS):
            rows = tl.arange(0, SUB) + blk * SUB
            dq_b, dka_b, dkp_b, dkc_b = block_pair_gradients(q, k, beta, g_cum, gk_cum, dp, da, tok0, hv, head,
                                                             n_valid, blk, cols, H, HV, K, HAS_G)
            terms = finish_pair_gradients(q, k, beta, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts,
                                          k_tile.to(tl.int64) * part_stride, dq_out, dk_out, tok0, rows, hv, head,
                                          n_valid, cols, chunk, scale, dq_b, dka_b, dkp_b, dkc_b, H, HV, K, HAS_G)
            store_tile(dgk, terms, tok0, rows, HV, hv, K, cols, n_valid)
        tl.debug_barrier()  # every thread's block stores are seen by the tile's loads below
        rows = tl.arange(0, CHUNK)
        whole = load_tile(dgk, tok0, rows, HV, hv, K, cols, n_valid)  # reverse-scanned as in the whole-chunk kernel
        store_tile(dgk, tl.cumsum(whole, 0, reverse=True), tok0, rows, HV, hv, K, cols, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def _whole_chunk_then_blocks(plan, pass_name: str, cfg, kernels: tuple, grid: tuple, *args, **constants):
    """Launches a pass's whole-chunk kernel under its entry cfg, then its blockwise kernel on the
    same grid and K tiles (cfg's BK) with its own warps and stages."""
    for kernel, own in zip(kernels, (cfg, plan.launch(launch_table.BLOCKWISE_OF[pass_name]))):
        launch(kernel, grid, *args, BK=cfg.block_k, **constants, **own.launch_options())


def gated_pairs(plan, layout: ChunkLayout, q, k, g, gk, a_raw, scale: float, store_q_gated: bool):
    """With gk: the gate cumsums and gated k (q with store_q_gated), and the gated key-key
    products into a_raw (prepare inverts them there) and the query-key products P.
    -> (g_cum or None, gk_cum, k_gated, q_gated or None, aqk [B, T, HV, 64] in q's dtype)."""
    B, T, H, K = k.shape
    HV = gk.shape[2]
    g_cum, gk_cum, k_gated, q_gated = gate_buffers(q, k, g, gk, store_q_gated)
    # P in q's dtype: its readers (the output and local-dv products) round it to that first
    aqk = torch.empty(B, T, HV, CHUNK_ROWS, device=k.device, dtype=q.dtype)
    chunk_map, cu = chunk_args(layout)
    grid = (layout.num_slots, B * HV)
    needs_blocks = torch.empty(grid[0] * grid[1], device=k.device, dtype=torch.int8)
    _whole_chunk_then_blocks(plan, "gated_pairs", plan.launch("gated_pairs"),
                             (gdn_gated_pairs_kernel, gdn_gated_pair_blocks_kernel), grid,
                             q, k, g, gk, g_cum, gk_cum, q_gated, k_gated, a_raw, aqk, needs_blocks, chunk_map, cu,
                             T, scale, H=H, HV=HV, K=K, HAS_G=g is not None, STORE_Q_GATED=store_q_gated,
                             IS_VARLEN=layout.is_varlen)
    return g_cum, gk_cum, k_gated, q_gated, aqk


def pair_gradients(plan, layout: ChunkLayout, q, k, beta, g_cum, gk_cum, d_p, d_a, dq, dk, dk_wy, d_last,
                   scale: float, final_dtype: bool = False):
    """With gk: both pairwise matrices' gradients at once, added to dqkw's dq, dk and the WY
    pass's dk terms dk_wy, and from the per-key gate terms of all three (d_last: dqkw's last-row
    extra per chunk state) dgk itself. final_dtype (q/k heads = value heads): the finished dq, dk
    in q's and k's dtype, written by the kernel (no fp32 write-back and cast); else the sums land
    in the fp32 dq, dk. -> ((dq, dk) or None, dgk fp32 [B, T, HV, K], dbeta shares fp32
    [NK, B, T, HV], with g the shares of dg's terms [NK, B, T, HV] or None): dgk is written over
    dk_wy (each element after its own read), which keeps the backward's peak memory; the
    gate-gradient pass sums the shares (key_gates.gate_gradients)."""
    B, T, H, K = k.shape
    HV = gk_cum.shape[2]
    cfg = plan.launch("pair_grad")
    k_tiles = ceil_div(K, cfg.block_k)
    dbeta_parts = torch.empty(k_tiles, B, T, HV, device=k.device, dtype=torch.float32)
    dg_parts = torch.empty_like(dbeta_parts) if g_cum is not None else None
    dgk = dk_wy
    dq_out = torch.empty_like(q) if final_dtype else None
    dk_out = torch.empty_like(k) if final_dtype else None
    chunk_map, cu = chunk_args(layout)
    grid = (layout.num_slots * k_tiles, B * HV)
    needs_blocks = torch.empty(grid[0] * grid[1], device=k.device, dtype=torch.int8)
    _whole_chunk_then_blocks(plan, "pair_grad", cfg, (gdn_gated_pair_grad_kernel, gdn_gated_pair_grad_blocks_kernel),
                             grid, q, k, beta, g_cum, gk_cum, d_p, d_a, dq, dk, dk_wy, d_last, dbeta_parts, dg_parts,
                             dgk, dq_out, dk_out, needs_blocks, chunk_map, cu, T, B * T * HV, scale, H=H, HV=HV, K=K,
                             HAS_G=g_cum is not None, IS_VARLEN=layout.is_varlen)
    return ((dq_out, dk_out) if final_dtype else None), dgk, dbeta_parts, dg_parts
