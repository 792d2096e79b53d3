"""Triton kernels of the chunked gated delta rule.

Chunks are 64 tokens. Inside a chunk the gates are used as chunk-local cumulative sums; with the
per-key gate `gk` the total log decay of key channel k at row i is B_i[k] = g_cum_i + gk_cum_i[k].

Forward (interface.py chains them):
  with gk first        gdn_chunk_cumsum_kernel (gate cumsums) and gdn_gated_pairs_kernel (the gated
                       key-key and query-key products of the chunk, one 16x16 block per program).
  gdn_prepare_kernel   chunk-parallel: gate cumsums, A = StrictTril(diag(beta) (K K^T . Gamma)),
                       T = (I + A)^-1 in 16-row blocks (stored), w = T diag(beta e^B) K,
                       u = T diag(beta) V.
  gdn_fwd_h_kernel     sequential over chunks: states h[c] and v_new = u - w h[c].
  gdn_intra_kernel     chunk-parallel: o = scale (q e^B) h[c] + P v_new with P = scale Tril(q k^T . Gamma);
                       the same kernel computes P^T do for the backward.
Backward: w (and where the state pass does not form v_new from T, u) again from the forward's T
(gdn_recompute_wu_kernel; with gk the whole prepare), the states again (no per-chunk state is
kept), then
  gdn_bwd_dhu_kernel   sequential, reverse: the state gradients (the public bwd_dhu pass).
  gdn_bwd_dqkw_kernel  chunk-parallel: dq, the state/intra parts of dk, dw, gate terms.
  gdn_bwd_wy_kernel    chunk-parallel: back through T, w and u: dk, dv, dbeta, gate terms, dg.
  With gk, the gated pairwise products need a numerically safe factorisation of e^(B_i - B_j):
  gdn_gated_pair_grad_kernel does it for the two pairwise matrices, gdn_gate_grad_kernel the
  final reverse cumsum.

Gate factorisation with gk: e^(B_i - B_j) = e^(B_i - r) e^(r - B_j). Between 16-row blocks I > J,
r is B at the first row of block I, so both factors are <= 1. Inside a diagonal block r is its
middle row, so factors stay below e^(8 |gk|) (exact unless the key decay per token is below e^-11).

Varlen: programs of chunk-parallel kernels are chunk slots; a slot maps to (sequence, chunk) through
`chunk_map` (built on the device, no host sync); unused slots exit at once. Kernels with several
programs per chunk (K tiles, 16-row blocks) put them side by side on grid axis 0, so that they
share the chunk's tiles in L2 (_chunk_part_program).
"""
import triton
import triton.language as tl

CHUNK = tl.constexpr(64)
SUB = tl.constexpr(16)


# ------------------------------------------------------------------------------------------------
# Addressing helpers
# ------------------------------------------------------------------------------------------------
@triton.jit
def _chunk_of_slot(slot, batch, chunk_map, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """-> (first token (int64), valid rows, global chunk index) of a chunk slot. An unused varlen
    slot gets 0 valid rows, so every load and store of its program is masked off."""
    if IS_VARLEN:
        seq = tl.load(chunk_map + 2 * slot)
        local = tl.load(chunk_map + 2 * slot + 1)
        used = seq >= 0
        seq = tl.where(used, seq, 0)
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
        tok0 = bos + local.to(tl.int64) * 64
        n_valid = tl.where(used, tl.minimum(eos - tok0, 64), 0).to(tl.int32)
        return tok0, n_valid, slot.to(tl.int64)
    else:
        num_chunks = tl.cdiv(T, 64)
        tok0 = batch.to(tl.int64) * T + slot.to(tl.int64) * 64
        n_valid = tl.minimum(T - slot * 64, 64)
        return tok0, n_valid, batch.to(tl.int64) * num_chunks + slot


@triton.jit
def _chunk_program(chunk_map, cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A chunk-parallel program's (value head, q/k head, first token, valid rows, global chunk)
    from its grid position (chunk slot, batch x value head)."""
    hv, head, tok0, n_valid, chunk, _ = _chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, 1)
    return hv, head, tok0, n_valid, chunk


@triton.jit
def _chunk_part_program(chunk_map, cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr,
                        IS_VARLEN: tl.constexpr, PARTS: tl.constexpr):
    """The same for kernels with PARTS programs per chunk (K tiles, 16-row blocks), plus the part:
    grid axis 0 is chunk slot * PARTS + part, so that a chunk's parts, which read the same tiles,
    run side by side and share them in L2 (as a slower grid axis the tiles came from DRAM again
    for each part)."""
    pid = tl.program_id(0)
    slot = pid // PARTS
    bhv = tl.program_id(1)
    hv = bhv % HV
    tok0, n_valid, chunk = _chunk_of_slot(slot, bhv // HV, chunk_map, cu_seqlens, T, IS_VARLEN)
    return hv, hv // (HV // H), tok0, n_valid, chunk, pid % PARTS


@triton.jit
def _seq_bounds(seq, cu_seqlens, chunk_offsets, T, IS_VARLEN: tl.constexpr):
    """-> (first token, length, first global chunk) of sequence `seq` (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
        chunk0 = tl.load(chunk_offsets + seq).to(tl.int64)
        return bos, eos - bos, chunk0
    else:
        return seq.to(tl.int64) * T, T.to(tl.int64), seq.to(tl.int64) * tl.cdiv(T, 64)


@triton.jit
def _sequence_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, HV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A sequential pass's (sequence, value head, q/k head, first token, length, first global
    chunk, K rows, V columns) from its grid position (V tile, sequence x value head)."""
    v_tile = tl.program_id(0)
    seq_hv = tl.program_id(1)
    seq = seq_hv // HV
    hv = seq_hv % HV
    bos, seq_len, chunk0 = _seq_bounds(seq, cu_seqlens, chunk_offsets, T, IS_VARLEN)
    return (seq, hv, hv // (HV // H), bos, seq_len, chunk0, tl.arange(0, BK),
            v_tile * BV + tl.arange(0, BV))


@triton.jit
def _tile_ptrs(base, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    """Pointers and mask of a [rows, cols] tile of a [tokens, n_heads, D] tensor."""
    offs = ((tok0 + rows)[:, None] * n_heads + head) * D + cols[None, :]
    mask = (rows < n_valid)[:, None] & (cols < D)[None, :]
    return base + offs, mask


@triton.jit
def _load_tile(base, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    ptrs, mask = _tile_ptrs(base, tok0, rows, n_heads, head, D, cols, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, value, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    ptrs, mask = _tile_ptrs(base, tok0, rows, n_heads, head, D, cols, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _vec_ptrs(base, tok0, rows, n_heads, head, n_valid):
    return base + (tok0 + rows) * n_heads + head, rows < n_valid


@triton.jit
def _load_vec(base, tok0, rows, n_heads, head, n_valid):
    ptrs, mask = _vec_ptrs(base, tok0, rows, n_heads, head, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_vec(base, value, tok0, rows, n_heads, head, n_valid):
    ptrs, mask = _vec_ptrs(base, tok0, rows, n_heads, head, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _state_ptrs(base, index, hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, krows, vcols):
    """Pointers and mask of a [K, V] state tile at state `index` (chunk or sequence), head hv."""
    offs = ((index * HV + hv) * K + krows[:, None]).to(tl.int64) * V + vcols[None, :]
    return base + offs, (krows < K)[:, None] & (vcols < V)[None, :]


@triton.jit
def _initial_state(base, seq, hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, krows, vcols,
                   GIVEN: tl.constexpr):
    """A sequential pass's starting [BK, BV] fp32 state: from `base` (h0 or dht) or zeros."""
    if GIVEN:
        ptrs, mask = _state_ptrs(base, seq, hv, HV, K, V, krows, vcols)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        rows: tl.constexpr = krows.shape[0]
        cols: tl.constexpr = vcols.shape[0]
        return tl.zeros([rows, cols], dtype=tl.float32)


@triton.jit
def _square_ptrs(base, tok0, rows, HV: tl.constexpr, hv, cols, n_valid):
    """A [rows, cols] tile of a per-chunk [64, 64] matrix stored as [tokens, HV, 64]."""
    offs = ((tok0 + rows)[:, None] * HV + hv) * 64 + cols[None, :]
    return base + offs, (rows < n_valid)[:, None] & (cols < 64)[None, :]


@triton.jit
def _load_last(base, tok0, n_heads, head, n_valid):
    """The scalar at the chunk's last valid row of a [tokens, n_heads] tensor."""
    return tl.load(base + (tok0 + n_valid - 1) * n_heads + head).to(tl.float32)


@triton.jit
def _load_last_row(base, tok0, n_heads, head, D: tl.constexpr, cols):
    """Row n_valid - 1 (pass tok0 + n_valid - 1 as tok0) of a [tokens, n_heads, D] tensor."""
    return tl.load(base + (tok0 * n_heads + head) * D + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def _last_row_of(x, n_valid):
    """Row n_valid - 1 of a [64, N] tile."""
    return tl.sum(tl.where((tl.arange(0, 64) == n_valid - 1)[:, None], x, 0.0), axis=0)


# ------------------------------------------------------------------------------------------------
# 16-row block algebra used by the WY representation
# ------------------------------------------------------------------------------------------------
@triton.jit
def _dot32(a, b, PRECISION: tl.constexpr):
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _inv_unit_lower(a, PRECISION: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular 16x16 a: with m = -a nilpotent (m^16 = 0),
    (I + m)(I + m^2)(I + m^4)(I + m^8) = sum of m^n for n < 16."""
    idx = tl.arange(0, 16)
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
def _scalar_gamma(bi, bj, INCLUSIVE: tl.constexpr):
    """e^(b_i - b_j) on the (strictly or inclusively) lower triangle of a square block, else 0."""
    n: tl.constexpr = bi.shape[0]
    idx = tl.arange(0, n)
    if INCLUSIVE:
        keep = idx[:, None] >= idx[None, :]
    else:
        keep = idx[:, None] > idx[None, :]
    return tl.exp(tl.where(keep, bi[:, None] - bj[None, :], float("-inf")))


@triton.jit
def _store_square_block(base, value, tok0, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, hv,
                        n_valid):
    sub = tl.arange(0, 16)
    ptrs, mask = _square_ptrs(base, tok0, I * 16 + sub, HV, hv, J * 16 + sub, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _store_lower_blocks(base, tok0, HV: tl.constexpr, hv, n_valid,
                        m00, m10, m11, m20, m21, m22, m30, m31, m32, m33):
    """A lower block-triangular 64x64 matrix given by its 10 blocks; the upper blocks are zeros."""
    zero = tl.zeros([16, 16], dtype=tl.float32)
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


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _outer_and_block(part):
    """The part of a 16-row block kernel's program, laid out as outer * 4 + (16-row block)."""
    return part // 4, part % 4


@triton.jit
def _key_gate_rows(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                   HAS_G: tl.constexpr):
    """B (total per-key log decay: g_cum + gk_cum) of a [rows, BK] tile."""
    gate = _load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid)
    if HAS_G:
        gate += _load_vec(g_cum, tok0, rows, HV, hv, n_valid)[:, None]
    return gate


@triton.jit
def _reference_gate(g_cum, gk_cum, tok0, bi, bj, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                    HAS_G: tl.constexpr):
    """B at the reference row of block pair (I, J): the first row of block I below the diagonal,
    its middle row on it (at most the last valid row: rows past it carry no data)."""
    row = tl.maximum(tl.minimum(tl.where(bi == bj, bi * 16 + 8, bi * 16), n_valid - 1), 0)
    ref = _load_last_row(gk_cum, tok0 + row, HV, hv, K, cols)
    if HAS_G:
        ref += tl.load(g_cum + (tok0 + row) * HV + hv)
    return ref


@triton.jit
def _decay_factor(exponent, valid_rows):
    """e^exponent on valid rows, exactly 0 on rows past the chunk's end."""
    return tl.exp(tl.where(valid_rows[:, None], exponent, float("-inf")))


@triton.jit(do_not_specialize=["T"])
def gdn_chunk_cumsum_kernel(g, gk, g_cum, gk_cum, q, k, q_gated, k_gated, chunk_map, cu_seqlens, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                            HAS_G: tl.constexpr, STORE_Q_GATED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk-local cumulative sums of the scalar and per-key log decays (fp32), one program per
    (chunk, value head); and k e^(C_last - C) (with STORE_Q_GATED also q e^C), C the per-key cumsum
    alone, per value head in k's dtype: the state passes read them as bwd_dhu's public convention
    has them, instead of gating [64, K] tiles inside their sequential chains."""
    hv, head, tok0, n_valid, _ = _chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, 64)
    if HAS_G:
        gt = _load_vec(g, tok0, rows, HV, hv, n_valid).to(tl.float32)
        _store_vec(g_cum, tl.cumsum(gt, 0), tok0, rows, HV, hv, n_valid)
    for k_start in range(0, K, BK):
        cols = k_start + tl.arange(0, BK)
        key_cum = tl.cumsum(_load_tile(gk, tok0, rows, HV, hv, K, cols, n_valid).to(tl.float32), 0)
        _store_tile(gk_cum, key_cum, tok0, rows, HV, hv, K, cols, n_valid)
        k_rows = _load_tile(k, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
        decay_to_end = tl.exp(_last_row_of(key_cum, n_valid)[None, :] - key_cum)
        _store_tile(k_gated, k_rows * decay_to_end, tok0, rows, HV, hv, K, cols, n_valid)
        if STORE_Q_GATED:
            q_rows = _load_tile(q, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
            _store_tile(q_gated, q_rows * tl.exp(key_cum), tok0, rows, HV, hv, K, cols, n_valid)


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
    hv, head, tok0, n_valid, _, part = _chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, 16)
    bi, bj = _outer_and_block(part)
    sub = tl.arange(0, 16)
    rows_i = bi * 16 + sub
    rows_j = bj * 16 + sub
    sq_ptrs, sq_mask = _square_ptrs(aqk, tok0, rows_i, HV, hv, rows_j, n_valid)
    if bj > bi:
        tl.store(sq_ptrs, tl.zeros([16, 16], dtype=tl.float32), mask=sq_mask)
    else:
        acc_a = tl.zeros([16, 16], dtype=tl.float32)
        acc_p = tl.zeros([16, 16], dtype=tl.float32)
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            gate_i = _key_gate_rows(g_cum, gk_cum, tok0, rows_i, hv, HV, K, cols, n_valid, HAS_G)
            gate_j = _key_gate_rows(g_cum, gk_cum, tok0, rows_j, hv, HV, K, cols, n_valid, HAS_G)
            ref = _reference_gate(g_cum, gk_cum, tok0, bi, bj, hv, HV, K, cols, n_valid, HAS_G)
            left = _decay_factor(gate_i - ref[None, :], rows_i < n_valid)
            right = (_load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
                     * _decay_factor(ref[None, :] - gate_j, rows_j < n_valid))
            k_rows = _load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            q_rows = _load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32)
            acc_a += tl.dot(k_rows * left, tl.trans(right))
            acc_p += tl.dot(q_rows * left, tl.trans(right))
        off_diag = bi != bj
        a_keep = (sub[:, None] > sub[None, :]) | off_diag
        p_keep = (sub[:, None] >= sub[None, :]) | off_diag
        tl.store(sq_ptrs, tl.where(p_keep, acc_p * scale, 0.0), mask=sq_mask)
        a_ptrs, a_mask = _square_ptrs(a_raw, tok0, rows_i, HV, hv, rows_j, n_valid)
        tl.store(a_ptrs, tl.where(a_keep, acc_a, 0.0), mask=a_mask)


@triton.jit(do_not_specialize=["T"])
def gdn_prepare_kernel(k, v, beta, g, g_cum, gk_cum, w, u, ai, chunk_map, cu_seqlens, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr,
                       HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       STORE_WU: tl.constexpr, INVERSE_PRECISION: tl.constexpr):
    """Per chunk: the scalar gate's cumsums, T = (I + A)^-1 (stored) and, with STORE_WU, w and u. Without STORE_WU the caller makes w, u from the stored T with
    gdn_recompute_wu_kernel (two lighter kernels instead of one that spills).
    INVERSE_PRECISION: of the fp32 products of the blockwise inverse ("ieee" or "tf32").
    With gk the gate cumsums and the gated key products A_raw (in `ai`) come from
    gdn_chunk_cumsum_kernel and gdn_gated_pairs_kernel: phase 1 only loads them."""
    hv, head, tok0, n_valid, _ = _chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    sub = tl.arange(0, 16)
    r0, r1, r2, r3 = sub, 16 + sub, 32 + sub, 48 + sub
    beta0 = _load_vec(beta, tok0, r0, HV, hv, n_valid)
    beta1 = _load_vec(beta, tok0, r1, HV, hv, n_valid)
    beta2 = _load_vec(beta, tok0, r2, HV, hv, n_valid)
    beta3 = _load_vec(beta, tok0, r3, HV, hv, n_valid)
    if HAS_G and HAS_GK:
        b0 = _load_vec(g_cum, tok0, r0, HV, hv, n_valid)
        b1 = _load_vec(g_cum, tok0, r1, HV, hv, n_valid)
        b2 = _load_vec(g_cum, tok0, r2, HV, hv, n_valid)
        b3 = _load_vec(g_cum, tok0, r3, HV, hv, n_valid)
    elif HAS_G:
        b0, b1, b2, b3 = _cum_blocks(_load_vec(g, tok0, r0, HV, hv, n_valid),
                                     _load_vec(g, tok0, r1, HV, hv, n_valid),
                                     _load_vec(g, tok0, r2, HV, hv, n_valid),
                                     _load_vec(g, tok0, r3, HV, hv, n_valid))
        _store_vec(g_cum, b0, tok0, r0, HV, hv, n_valid)
        _store_vec(g_cum, b1, tok0, r1, HV, hv, n_valid)
        _store_vec(g_cum, b2, tok0, r2, HV, hv, n_valid)
        _store_vec(g_cum, b3, tok0, r3, HV, hv, n_valid)
    else:
        b0 = tl.zeros([16], dtype=tl.float32)
        b1, b2, b3 = b0, b0, b0

    # Phase 1: the pairwise key products of the 10 lower blocks (read back with gk).
    if HAS_GK:
        a00 = _load_square_block(ai, tok0, 0, 0, HV, hv, n_valid)
        a10 = _load_square_block(ai, tok0, 1, 0, HV, hv, n_valid)
        a11 = _load_square_block(ai, tok0, 1, 1, HV, hv, n_valid)
        a20 = _load_square_block(ai, tok0, 2, 0, HV, hv, n_valid)
        a21 = _load_square_block(ai, tok0, 2, 1, HV, hv, n_valid)
        a22 = _load_square_block(ai, tok0, 2, 2, HV, hv, n_valid)
        a30 = _load_square_block(ai, tok0, 3, 0, HV, hv, n_valid)
        a31 = _load_square_block(ai, tok0, 3, 1, HV, hv, n_valid)
        a32 = _load_square_block(ai, tok0, 3, 2, HV, hv, n_valid)
        a33 = _load_square_block(ai, tok0, 3, 3, HV, hv, n_valid)
    else:
        a00 = tl.zeros([16, 16], dtype=tl.float32)
        a10, a11, a20, a21, a22, a30, a31, a32, a33 = a00, a00, a00, a00, a00, a00, a00, a00, a00
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            k0 = _load_tile(k, tok0, r0, H, head, K, cols, n_valid)
            k1 = _load_tile(k, tok0, r1, H, head, K, cols, n_valid)
            k2 = _load_tile(k, tok0, r2, H, head, K, cols, n_valid)
            k3 = _load_tile(k, tok0, r3, H, head, K, cols, n_valid)
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

    # Phase 2: A = diag(beta) (products . Gamma), strictly lower; T = (I + A)^-1 blockwise.
    if HAS_G and not HAS_GK:
        a00 = a00 * _scalar_gamma(b0, b0, False)
        a11 = a11 * _scalar_gamma(b1, b1, False)
        a22 = a22 * _scalar_gamma(b2, b2, False)
        a33 = a33 * _scalar_gamma(b3, b3, False)
        a10 = a10 * tl.exp(b1[:, None] - b0[None, :])
        a20 = a20 * tl.exp(b2[:, None] - b0[None, :])
        a21 = a21 * tl.exp(b2[:, None] - b1[None, :])
        a30 = a30 * tl.exp(b3[:, None] - b0[None, :])
        a31 = a31 * tl.exp(b3[:, None] - b1[None, :])
        a32 = a32 * tl.exp(b3[:, None] - b2[None, :])
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
                e0 = tl.exp(_load_tile(gk_cum, tok0, r0, HV, hv, K, cols, n_valid) + b0[:, None])
                e1 = tl.exp(_load_tile(gk_cum, tok0, r1, HV, hv, K, cols, n_valid) + b1[:, None])
                e2 = tl.exp(_load_tile(gk_cum, tok0, r2, HV, hv, K, cols, n_valid) + b2[:, None])
                e3 = tl.exp(_load_tile(gk_cum, tok0, r3, HV, hv, K, cols, n_valid) + b3[:, None])
            else:
                e0, e1, e2, e3 = tl.exp(b0)[:, None], tl.exp(b1)[:, None], tl.exp(b2)[:, None], tl.exp(b3)[:, None]
            kb0 = (_load_tile(k, tok0, r0, H, head, K, cols, n_valid) * e0 * beta0[:, None]).to(kdt)
            kb1 = (_load_tile(k, tok0, r1, H, head, K, cols, n_valid) * e1 * beta1[:, None]).to(kdt)
            kb2 = (_load_tile(k, tok0, r2, H, head, K, cols, n_valid) * e2 * beta2[:, None]).to(kdt)
            kb3 = (_load_tile(k, tok0, r3, H, head, K, cols, n_valid) * e3 * beta3[:, None]).to(kdt)
            _store_tile(w, tl.dot(s00, kb0), tok0, r0, HV, hv, K, cols, n_valid)
            _store_tile(w, tl.dot(s10, kb0) + tl.dot(s11, kb1), tok0, r1, HV, hv, K, cols, n_valid)
            _store_tile(w, tl.dot(s20, kb0) + tl.dot(s21, kb1) + tl.dot(s22, kb2), tok0, r2, HV, hv, K, cols, n_valid)
            _store_tile(w, tl.dot(s30, kb0) + tl.dot(s31, kb1) + tl.dot(s32, kb2) + tl.dot(s33, kb3),
                        tok0, r3, HV, hv, K, cols, n_valid)
        vdt = u.dtype.element_ty
        s00, s10, s11, s20 = t00.to(vdt), t10.to(vdt), t11.to(vdt), t20.to(vdt)
        s21, s22, s30, s31, s32, s33 = t21.to(vdt), t22.to(vdt), t30.to(vdt), t31.to(vdt), t32.to(vdt), t33.to(vdt)
        for v_start in range(0, V, BV):
            cols = v_start + tl.arange(0, BV)
            vb0 = (_load_tile(v, tok0, r0, HV, hv, V, cols, n_valid) * beta0[:, None]).to(vdt)
            vb1 = (_load_tile(v, tok0, r1, HV, hv, V, cols, n_valid) * beta1[:, None]).to(vdt)
            vb2 = (_load_tile(v, tok0, r2, HV, hv, V, cols, n_valid) * beta2[:, None]).to(vdt)
            vb3 = (_load_tile(v, tok0, r3, HV, hv, V, cols, n_valid) * beta3[:, None]).to(vdt)
            _store_tile(u, tl.dot(s00, vb0), tok0, r0, HV, hv, V, cols, n_valid)
            _store_tile(u, tl.dot(s10, vb0) + tl.dot(s11, vb1), tok0, r1, HV, hv, V, cols, n_valid)
            _store_tile(u, tl.dot(s20, vb0) + tl.dot(s21, vb1) + tl.dot(s22, vb2), tok0, r2, HV, hv, V, cols, n_valid)
            _store_tile(u, tl.dot(s30, vb0) + tl.dot(s31, vb1) + tl.dot(s32, vb2) + tl.dot(s33, vb3),
                        tok0, r3, HV, hv, V, cols, n_valid)


@triton.jit
def _chunk_inverse(ai, beta, tok0, rows, hv, HV: tl.constexpr, n_valid):
    """The chunk's stored T = (I + A)^-1 ([64, 64], zero above the diagonal) and its beta."""
    t_ptrs, t_mask = _square_ptrs(ai, tok0, rows, HV, hv, rows, n_valid)
    return (tl.load(t_ptrs, mask=t_mask, other=0.0).to(tl.float32),
            _load_vec(beta, tok0, rows, HV, hv, n_valid))


@triton.jit
def _t_times_scaled_rows(tmat, row_scale, src, src_heads, src_head, dst, dst_heads, dst_head,
                         D: tl.constexpr, BD: tl.constexpr, tok0, rows, n_valid):
    """dst = T diag(row_scale) src for one chunk, in [64, BD] tiles over the head dim D."""
    dt = dst.dtype.element_ty
    t_dt = tmat.to(dt)
    for start in range(0, D, BD):
        cols = start + tl.arange(0, BD)
        x = _load_tile(src, tok0, rows, src_heads, src_head, D, cols, n_valid) * row_scale[:, None]
        _store_tile(dst, tl.dot(t_dt, x.to(dt)), tok0, rows, dst_heads, dst_head, D, cols, n_valid)


@triton.jit(do_not_specialize=["T"])
def gdn_recompute_wu_kernel(k, v, beta, g_cum, ai, w, u, chunk_map, cu_seqlens, T,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr,
                            HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_U: tl.constexpr):
    """The backward's w = T diag(beta e^g) K and (STORE_U) u = T diag(beta) V, from the T and gate
    cumsums that the forward kept (scalar gate only): one 64-row product per tile instead of a
    second prepare. Without u the state pass forms v_new from T itself."""
    hv, head, tok0, n_valid, _ = _chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, 64)
    tmat, beta_t = _chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
    if HAS_G:
        row_gate = tl.exp(_load_vec(g_cum, tok0, rows, HV, hv, n_valid)) * beta_t
    else:
        row_gate = beta_t
    _t_times_scaled_rows(tmat, row_gate, k, H, head, w, HV, hv, K, BK, tok0, rows, n_valid)
    if STORE_U:
        _t_times_scaled_rows(tmat, beta_t, v, HV, hv, u, HV, hv, V, BV, tok0, rows, n_valid)


@triton.jit(do_not_specialize=["T"])
def gdn_fwd_h_kernel(k, w, u, v, beta, ai, g_cum, gk_cum, h0, h, v_new, ht, cu_seqlens, chunk_offsets, T,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_H0: tl.constexpr,
                     STORE_HT: tl.constexpr, WU_FROM_T: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One program per (V tile, sequence, head): the states h[c] at each chunk start and
    v_new = u - w h[c], chunk after chunk. BK covers all of K.
    With WU_FROM_T (scalar gate or none) w and u are not read: from the chunk's T,
        v_new = T diag(beta) (v - diag(e^g) k h[c])
    (w = T diag(beta e^g) k, u = T diag(beta) v). That reads T, v and beta where the other form
    reads w and u (the same bytes at K = V) and spares the kernel that writes w and u, but adds a
    dependent product to every chunk's chain: it pays where the GPU is full, not where few
    programs run (gdn_config.states_from_inverse).
    With gk, k comes gated by the per-key decay to the chunk's end, k e^(C_last - C), per value
    head (gdn_chunk_cumsum_kernel writes it), with H = HV."""
    seq, hv, head, bos, seq_len, chunk0, krows, vcols = _sequence_program(
        cu_seqlens, chunk_offsets, T, H, HV, BK, BV, IS_VARLEN)
    rows = tl.arange(0, 64)
    state = _initial_state(h0, seq, hv, HV, K, V, krows, vcols, HAS_H0)
    for c in range(0, tl.cdiv(seq_len, 64)):
        tok0 = bos + c * 64
        n_valid = tl.minimum(seq_len - c * 64, 64).to(tl.int32)
        ptrs, mask = _state_ptrs(h, chunk0 + c, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state.to(h.dtype.element_ty), mask=mask)
        kt = _load_tile(k, tok0, rows, H, head, K, krows, n_valid)
        if HAS_G:
            bt = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)
        if WU_FROM_T:
            tmat, beta_t = _chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
            kh = tl.dot(kt, state.to(kt.dtype))
            if HAS_G:
                kh = kh * tl.exp(bt)[:, None]
            vt = _load_tile(v, tok0, rows, HV, hv, V, vcols, n_valid).to(tl.float32)
            vn = tl.dot(tmat.to(kt.dtype), ((vt - kh) * beta_t[:, None]).to(kt.dtype))
        else:
            wt = _load_tile(w, tok0, rows, HV, hv, K, krows, n_valid)
            vn = _load_tile(u, tok0, rows, HV, hv, V, vcols, n_valid).to(tl.float32) - tl.dot(wt, state.to(wt.dtype))
        _store_tile(v_new, vn, tok0, rows, HV, hv, V, vcols, n_valid)
        if HAS_G:
            b_last = _load_last(g_cum, tok0, HV, hv, n_valid)
            vn = vn * tl.exp(b_last - bt)[:, None]
            state = state * tl.exp(b_last)
        if HAS_GK:  # k comes gated (k e^(C_last - C), per value head): only the state decays here
            c_last = _load_last_row(gk_cum, tok0 + n_valid - 1, HV, hv, K, krows)
            state = state * tl.exp(c_last)[:, None]
        state += tl.dot(tl.trans(kt), vn.to(kt.dtype))
    if STORE_HT:
        ptrs, mask = _state_ptrs(ht, seq, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state, mask=mask)


@triton.jit
def _intra_matrix(q, k, g_cum, aqk, tok0, hv, head, n_valid, scale,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                  HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """P = scale Tril(q k^T . Gamma) of one chunk, [64, 64] fp32 (read back when gk made it)."""
    rows = tl.arange(0, 64)
    if HAS_GK:
        ptrs, mask = _square_ptrs(aqk, tok0, rows, HV, hv, rows, n_valid)
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        p = tl.zeros([64, 64], dtype=tl.float32)
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            p += tl.dot(_load_tile(q, tok0, rows, H, head, K, cols, n_valid),
                        tl.trans(_load_tile(k, tok0, rows, H, head, K, cols, n_valid)))
        if HAS_G:
            bt = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            return p * _scalar_gamma(bt, bt, True) * scale
        else:
            return tl.where(rows[:, None] >= rows[None, :], p * scale, 0.0)


@triton.jit
def _query_gate(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """e^B of a [64, BK] query tile (broadcastable: [64, 1] without gk)."""
    if HAS_G:
        e = tl.exp(_load_vec(g_cum, tok0, rows, HV, hv, n_valid))[:, None]
    else:
        e = tl.full([64, 1], 1.0, dtype=tl.float32)
    if HAS_GK:
        e = e * tl.exp(_load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid))
    return e


@triton.jit(do_not_specialize=["T"])
def gdn_intra_kernel(q, k, g_cum, gk_cum, aqk, h, v_new, do, out, chunk_map, cu_seqlens, T, scale,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr,
                     IS_DV: tl.constexpr):
    """IS_DV=False: o = scale (q e^B) h[c] + P v_new.  IS_DV=True: dv_local = P^T do.
    One program per (chunk, head); BK covers all of K, V in tiles of BV."""
    hv, head, tok0, n_valid, chunk = _chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, 64)
    krows = tl.arange(0, BK)
    p = _intra_matrix(q, k, g_cum, aqk, tok0, hv, head, n_valid, scale, H, HV, K, BK, HAS_G, HAS_GK)
    dt = out.dtype.element_ty
    if IS_DV:
        pt = tl.trans(p).to(dt)
    else:
        pt = p.to(dt)
        qt = _load_tile(q, tok0, rows, H, head, K, krows, n_valid)
        qg = (qt * _query_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, krows, n_valid, HAS_G, HAS_GK)
              * scale).to(dt)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        if IS_DV:
            acc = tl.dot(pt, _load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid).to(dt))
        else:
            ptrs, mask = _state_ptrs(h, chunk, hv, HV, K, V, krows, vcols)
            acc = tl.dot(qg, tl.load(ptrs, mask=mask, other=0.0).to(dt))
            acc += tl.dot(pt, _load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid).to(dt))
        _store_tile(out, acc, tok0, rows, HV, hv, V, vcols, n_valid)


# ------------------------------------------------------------------------------------------------
# Backward: the state-gradient pass
# ------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_kernel(q, k, w, do, dv, g_cum, gk_cum, dht, dh, dh0, dv2, cu_seqlens, chunk_offsets,
                       T, scale,
                       HQ: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr,
                       HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_DHT: tl.constexpr,
                       STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One program per (V tile, sequence, head), chunks from last to first. D is the gradient of
    the state at the end of the chunk:
        dh[c] = D;  dv2[c] = dv[c] + e^(g_last - g) (k[c] D)
        D = e^(g_last) e^(gk_last) D + scale (q[c] e^g)^T do[c] - w[c]^T dv2[c].
    q and k come already gated by gk (q e^gk, k e^(gk_last - gk): the public convention; the op
    passes those of gdn_chunk_cumsum_kernel). BK covers all of K."""
    seq, hv, head, bos, seq_len, chunk0, krows, vcols = _sequence_program(
        cu_seqlens, chunk_offsets, T, HQ, HV, BK, BV, IS_VARLEN)
    rows = tl.arange(0, 64)
    state = _initial_state(dht, seq, hv, HV, K, V, krows, vcols, HAS_DHT)
    dt = q.dtype.element_ty
    num_chunks = tl.cdiv(seq_len, 64)
    # dv is read one chunk ahead: without a gate the compiler folds the dv add into the MMA's
    # accumulator, and a load feeding an accumulator is not pipelined (its latency then sat in
    # the chain of dependent MMAs every chunk).
    # The per-key decay row at a chunk's end is read one chunk ahead too (a plain load there
    # stalled the first MMA of the chunk).
    last = tl.maximum(num_chunks - 1, 0)  # a length-0 sequence loads nothing
    n_last = tl.minimum(seq_len - last * 64, 64).to(tl.int32)
    dv_next = _load_tile(dv, bos + last * 64, rows, HV, hv, V, vcols, n_last)
    if HAS_GK:
        c_last_next = _load_last_row(gk_cum, tl.maximum(bos + last * 64 + n_last - 1, 0), HV, hv, K, krows)
    for c_rev in range(0, num_chunks):
        c = num_chunks - 1 - c_rev
        tok0 = bos + c * 64
        n_valid = tl.minimum(seq_len - c * 64, 64).to(tl.int32)
        c_ahead = tl.maximum(c - 1, 0)
        n_ahead = tl.minimum(seq_len - c_ahead * 64, 64).to(tl.int32)
        dvt = dv_next
        dv_next = _load_tile(dv, bos + c_ahead * 64, rows, HV, hv, V, vcols, n_ahead)
        if HAS_GK:
            c_last = c_last_next
            c_last_next = _load_last_row(gk_cum, bos + c_ahead * 64 + n_ahead - 1, HV, hv, K, krows)
        ptrs, mask = _state_ptrs(dh, chunk0 + c, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state.to(dh.dtype.element_ty), mask=mask)
        qt = _load_tile(q, tok0, rows, HQ, head, K, krows, n_valid)
        kt = _load_tile(k, tok0, rows, HQ, head, K, krows, n_valid)
        wt = _load_tile(w, tok0, rows, HV, hv, K, krows, n_valid)
        dot_t = _load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid)
        kd = tl.dot(kt, state.to(dt))
        if HAS_G:
            # (q e^g)^T do = q^T (e^g do): the gate goes on do's rows, q stays a plain load
            bt = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            b_last = _load_last(g_cum, tok0, HV, hv, n_valid)
            kd = kd * tl.exp(b_last - bt)[:, None]
            dot_t = dot_t * tl.exp(bt)[:, None]
            state = state * tl.exp(b_last)
        if HAS_GK:
            state = state * tl.exp(c_last)[:, None]
        dv2t = dvt.to(tl.float32) + kd
        _store_tile(dv2, dv2t, tok0, rows, HV, hv, V, vcols, n_valid)
        # scale on do's rows too: do then reaches the MMA from registers in every mode, which
        # measured faster than straight from its load when there is no gate (H200)
        if BK > 128:
            # both products accumulate into the state itself: as `state += A - B` three [K, BV]
            # fp32 tiles are live, which spilled at K = 256 (B2 T8192 H8 mode C 0.753 -> 0.387 ms
            # this way, H200; bench/results/s10-probes-H200-20261121.txt)
            state = tl.dot(tl.trans(qt), (dot_t * scale).to(dt), acc=state)
            state = tl.dot(tl.trans(wt), (-dv2t).to(dt), acc=state)
        else:  # 1-2% faster up to K = 128 (the same probe)
            state += tl.dot(tl.trans(qt), (dot_t * scale).to(dt)) - tl.dot(tl.trans(wt), dv2t.to(dt))
    if STORE_DH0:
        ptrs, mask = _state_ptrs(dh0, seq, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state, mask=mask)



# ------------------------------------------------------------------------------------------------
# Backward: chunk-parallel gradients
# ------------------------------------------------------------------------------------------------
@triton.jit
def _total_gate(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """B of a [64, BK] tile ([64, 1] without gk) and its value at the last valid row."""
    if HAS_G:
        bt = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)[:, None]
    else:
        bt = tl.zeros([64, 1], dtype=tl.float32)
    if HAS_GK:
        bt = bt + _load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid)
    return bt, _last_row_of(bt, n_valid)


@triton.jit(do_not_specialize=["T", "db_tile_stride"])
def gdn_bwd_dqkw_kernel(q, k, v_new, h, dh, do, dv2, g_cum, gk_cum, dq, dk, dw, db, dp,
                        chunk_map, cu_seqlens, T, db_tile_stride, scale,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr,
                        HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One program per (chunk, head, K tile). With h = h[c] and D = dh[c] (end of chunk):
        dq = scale e^B (do h^T) + scale (dP . Gamma) k,  dP = Tril(do v_new^T)
        dk = e^(B_last - B) (v_new D^T) + scale (dP . Gamma)^T q          (partial: + wy terms)
        dw = -dv2 h^T
    and the gate terms dB (before the reverse cumsum). With gk the dP products are left to
    gdn_gated_pair_grad_kernel: dP is stored instead."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, chunk, k_tile = _chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK)
    rows = tl.arange(0, 64)
    kcols = k_tile * BK + tl.arange(0, BK)
    dqg = tl.zeros([64, BK], dtype=tl.float32)
    dwa = tl.zeros([64, BK], dtype=tl.float32)
    dkl = tl.zeros([64, BK], dtype=tl.float32)
    dpa = tl.zeros([64, 64], dtype=tl.float32)
    dlast = tl.zeros([BK], dtype=tl.float32)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        do_t = _load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid)
        vn_t = _load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid)
        dv2_t = _load_tile(dv2, tok0, rows, HV, hv, V, vcols, n_valid).to(do_t.dtype)
        h_ptrs, s_mask = _state_ptrs(h, chunk, hv, HV, K, V, kcols, vcols)
        h_t = tl.load(h_ptrs, mask=s_mask, other=0.0)
        dh_ptrs, s_mask = _state_ptrs(dh, chunk, hv, HV, K, V, kcols, vcols)
        dh_t = tl.load(dh_ptrs, mask=s_mask, other=0.0)
        dqg += tl.dot(do_t, tl.trans(h_t))
        dwa += tl.dot(dv2_t, tl.trans(h_t))
        dkl += tl.dot(vn_t, tl.trans(dh_t))
        dpa += tl.dot(do_t, tl.trans(vn_t))
        dlast += tl.sum(h_t.to(tl.float32) * dh_t.to(tl.float32), axis=1)
    # each finished tile is stored as soon as it is complete: fewer live at once (it spilled)
    _store_tile(dw, -dwa, tok0, rows, HV, hv, K, kcols, n_valid)
    qt = _load_tile(q, tok0, rows, H, head, K, kcols, n_valid)
    kt = _load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
    bt, b_last = _total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
    dq_t = dqg * tl.exp(bt) * scale
    dk_t = dkl * tl.exp(b_last[None, :] - bt)
    # B_last: from the kept part of every k (sum of k dk here) and from e^(B_last) h[c]
    last_extra = tl.sum(kt.to(tl.float32) * dk_t, axis=0) + tl.exp(b_last) * dlast
    if HAS_GK:
        gate = qt.to(tl.float32) * dq_t - kt.to(tl.float32) * dk_t
        gate += tl.where((rows == n_valid - 1)[:, None], last_extra[None, :], 0.0)
        if k_tile == 0:
            dp_ptrs, dp_mask = _square_ptrs(dp, tok0, rows, HV, hv, rows, n_valid)
            tl.store(dp_ptrs, tl.where(rows[:, None] >= rows[None, :], dpa, 0.0), mask=dp_mask)
        _store_tile(dq, dq_t, tok0, rows, HV, hv, K, kcols, n_valid)
        _store_tile(dk, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
        _store_tile(db, gate, tok0, rows, HV, hv, K, kcols, n_valid)
    else:
        if HAS_G:
            b_row = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            pg = dpa * _scalar_gamma(b_row, b_row, True) * scale
        else:
            pg = tl.where(rows[:, None] >= rows[None, :], dpa * scale, 0.0)
        # the intra-chunk parts accumulate into dq and dk themselves (one live tile each); the
        # gate rows are then q . dq - k . dk of the totals
        dq_t = tl.dot(pg.to(kt.dtype), kt, acc=dq_t)
        gate_rows = tl.sum(qt.to(tl.float32) * dq_t, axis=1)
        _store_tile(dq, dq_t, tok0, rows, HV, hv, K, kcols, n_valid)
        dk_t = tl.dot(tl.trans(pg).to(qt.dtype), qt, acc=dk_t)
        gate_rows -= tl.sum(kt.to(tl.float32) * dk_t, axis=1)
        _store_tile(dk, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
        gate_rows += tl.where(rows == n_valid - 1, tl.sum(last_extra, axis=0), 0.0)
        if HAS_G:  # one partial sum over this K tile's keys; the wy kernel adds the tiles
            _store_vec(db + k_tile.to(tl.int64) * db_tile_stride, gate_rows, tok0, rows, HV, hv, n_valid)


@triton.jit
def _reverse_cumsum(x):
    """sum over s >= i of x[s], down a chunk's rows (axis 0)."""
    return tl.sum(x, axis=0) - tl.cumsum(x, axis=0) + x


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
    dg (the gate terms summed and reverse-cumsummed). With gk, dA is stored for the pair kernel."""
    hv, head, tok0, n_valid, _ = _chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, 64)
    tmat, beta_t = _chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
    kdt = k.dtype.element_ty
    vdt = v.dtype.element_ty
    d_t = tl.zeros([64, 64], dtype=tl.float32)
    dbeta_t = tl.zeros([64], dtype=tl.float32)
    tt_v = tl.trans(tmat).to(vdt)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        du_t = _load_tile(du, tok0, rows, HV, hv, V, vcols, n_valid).to(vdt)
        v_t = _load_tile(v, tok0, rows, HV, hv, V, vcols, n_valid)
        d_t += tl.dot(du_t, tl.trans((v_t * beta_t[:, None]).to(vdt)))
        dvb = tl.dot(tt_v, du_t)
        _store_tile(dv, dvb * beta_t[:, None], tok0, rows, HV, hv, V, vcols, n_valid)
        dbeta_t += tl.sum(dvb * v_t.to(tl.float32), axis=1)
    kkt = tl.zeros([64, 64], dtype=tl.float32)
    for k_start in range(0, K, BK):
        kcols = k_start + tl.arange(0, BK)
        k_t = _load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
        dw_t = _load_tile(dw, tok0, rows, HV, hv, K, kcols, n_valid).to(kdt)
        bt, _b_last = _total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
        kb = (k_t * tl.exp(bt) * beta_t[:, None]).to(kdt)
        d_t += tl.dot(dw_t, tl.trans(kb))
    if not HAS_GK:
        # K K^T in a loop of its own, each operand from its own load: as `k_t @ k_t^T` inside the
        # loop above (one tile as both operands beside its other uses), Triton 3.6's pipeline on
        # Hopper let dbeta and dg change from run to run (errors 1.6e-2 -> 4e-3 against fp64 at
        # B1 T4096 H4 bf16 once separated; bench/results/s9-probes-H200-20261121.txt).
        for k_start in range(0, K, BK):
            kcols = k_start + tl.arange(0, BK)
            k_rows = _load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
            kkt += tl.dot(k_rows, tl.trans(_load_tile(k, tok0, rows, H, head, K, kcols, n_valid)))
    # dA = -T^T dT T^T on the strict lower triangle, with 16-bit operands as the other products
    # here (tf32 before: 1134 -> 1020 us at B8 T4096 H32, errors against fp64 unchanged; s11 probes)
    tt_k = tl.trans(tmat).to(kdt)
    d_a = -tl.dot(tl.dot(tt_k, d_t.to(kdt)).to(kdt), tt_k)
    d_a = tl.where(rows[:, None] > rows[None, :], d_a, 0.0)
    if HAS_GK:
        da_ptrs, da_mask = _square_ptrs(da, tok0, rows, HV, hv, rows, n_valid)
        tl.store(da_ptrs, d_a, mask=da_mask)
        d_ag = d_a  # unused
    else:
        if HAS_G:
            b_row = _load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            d_ag = d_a * _scalar_gamma(b_row, b_row, False)
        else:
            d_ag = d_a
        dbeta_t += tl.sum(d_ag * kkt, axis=1)
    gate_t = tl.zeros([64], dtype=tl.float32)
    if HAS_G and not HAS_GK:  # dqkw's partial gate row sums, one per dqkw K tile
        for i in range(NK):
            gate_t += _load_vec(db + i * db_tile_stride, tok0, rows, HV, hv, n_valid)
    if not HAS_GK:
        x_dab = d_ag * beta_t[:, None]
        sym_dab = (x_dab + tl.trans(x_dab)).to(kdt)
    for k_start in range(0, K, BK):
        kcols = k_start + tl.arange(0, BK)
        # dqkw's part of dk first: an elementwise operand, not pipelined like the product operands,
        # so its load latency overlaps the product below (the WY kernel's top stall where it was
        # read after it; ncu, s11)
        dk_t = _load_tile(dk, tok0, rows, HV, hv, K, kcols, n_valid).to(tl.float32)
        k_t = _load_tile(k, tok0, rows, H, head, K, kcols, n_valid)
        dw_t = _load_tile(dw, tok0, rows, HV, hv, K, kcols, n_valid).to(kdt)
        bt, _b_last = _total_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, kcols, n_valid, HAS_G, HAS_GK)
        kbase = k_t.to(tl.float32) * tl.exp(bt)
        dkb = tl.dot(tt_k, dw_t)
        dk_t += dkb * tl.exp(bt) * beta_t[:, None]
        dbeta_t += tl.sum(dkb * kbase, axis=1)
        gate_w = kbase * beta_t[:, None] * dkb
        if HAS_GK:
            db_ptrs, db_mask = _tile_ptrs(db, tok0, rows, HV, hv, K, kcols, n_valid)
            tl.store(db_ptrs, tl.load(db_ptrs, mask=db_mask, other=0.0) + gate_w, mask=db_mask)
        else:
            # diag(beta) dA k + (dA diag(beta))^T k as one product: (X + X^T) k, X = diag(beta) dA
            dk_t = tl.dot(sym_dab, k_t, acc=dk_t)
            gate_t += tl.sum(gate_w, axis=1)
        _store_tile(dk_out, dk_t, tok0, rows, HV, hv, K, kcols, n_valid)
    _store_vec(dbeta, dbeta_t, tok0, rows, HV, hv, n_valid)
    if HAS_G and not HAS_GK:
        m = d_ag * kkt * beta_t[:, None]  # dA . A
        gate_t += tl.sum(m, axis=1) - tl.sum(m, axis=0)
        _store_vec(dg, _reverse_cumsum(gate_t), tok0, rows, HV, hv, n_valid)


@triton.jit
def _load_square_block(base, tok0, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, hv, n_valid):
    sub = tl.arange(0, 16)
    ptrs, mask = _square_ptrs(base, tok0, I * 16 + sub, HV, hv, J * 16 + sub, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_gated_pair_grad_kernel(q, k, beta, g_cum, gk_cum, dp, da, dq, dk, dbeta_parts, db,
                               chunk_map, cu_seqlens, T, part_stride, scale,
                               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                               HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Gradients through the two gated pairwise matrices of a chunk (lower triangles), per key gate,
        P_ij = scale sum_k q_i[k] k_j[k] e^(B_i[k] - B_j[k]),  A_ij = sum_k beta_i k_i[k] k_j[k] e^(...),
    given dP (stored by the dqkw kernel) and dA (by the wy kernel): adds to dq, dk, dbeta and the
    per-key gate terms db, with the forward's factorisation around reference rows. Both share
    their decay factors and k's right-hand factor, so one program does both. One program per
    (chunk, head, K tile, 16-row block b) (part K tile * 4 + b on grid axis 0): row b of dP, dA gives the
    gradients of row b's q and beta k, column b those of row b's k."""
    NK: tl.constexpr = (K + BK - 1) // BK
    hv, head, tok0, n_valid, _, part = _chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, NK * 4)
    k_tile, blk = _outer_and_block(part)
    sub = tl.arange(0, 16)
    rows_b = blk * 16 + sub
    valid_b = rows_b < n_valid
    cols = k_tile * BK + tl.arange(0, BK)
    gate_b = _key_gate_rows(g_cum, gk_cum, tok0, rows_b, hv, HV, K, cols, n_valid, HAS_G)
    # row b: d(left operand)_b = sum_{J <= b} (dM_bJ (k_J e^(r - B_J))) e^(B_b - r), M = P, A
    dq_b = tl.zeros([16, BK], dtype=tl.float32)
    dka_b = tl.zeros([16, BK], dtype=tl.float32)
    for bj in range(0, blk + 1):
        rows_j = bj * 16 + sub
        ref = _reference_gate(g_cum, gk_cum, tok0, blk, bj, hv, HV, K, cols, n_valid, HAS_G)
        gate_j = _key_gate_rows(g_cum, gk_cum, tok0, rows_j, hv, HV, K, cols, n_valid, HAS_G)
        right = (_load_tile(k, tok0, rows_j, H, head, K, cols, n_valid).to(tl.float32)
                 * _decay_factor(ref[None, :] - gate_j, rows_j < n_valid))
        row_factor = _decay_factor(gate_b - ref[None, :], valid_b)
        m_ptrs, m_mask = _square_ptrs(dp, tok0, rows_b, HV, hv, rows_j, n_valid)
        dq_b += tl.dot(tl.load(m_ptrs, mask=m_mask, other=0.0), right) * row_factor
        m_ptrs, m_mask = _square_ptrs(da, tok0, rows_b, HV, hv, rows_j, n_valid)
        dka_b += tl.dot(tl.load(m_ptrs, mask=m_mask, other=0.0), right) * row_factor
    # column b: d(right operand)_b = sum_{I >= b} (dM_Ib^T (a_I e^(B_I - r))) e^(r - B_b), a = q, beta k
    dkp_b = tl.zeros([16, BK], dtype=tl.float32)
    dkc_b = tl.zeros([16, BK], dtype=tl.float32)
    for bi in range(blk, 4):
        rows_i = bi * 16 + sub
        ref = _reference_gate(g_cum, gk_cum, tok0, bi, blk, hv, HV, K, cols, n_valid, HAS_G)
        gate_i = _key_gate_rows(g_cum, gk_cum, tok0, rows_i, hv, HV, K, cols, n_valid, HAS_G)
        left = _decay_factor(gate_i - ref[None, :], rows_i < n_valid)
        q_i = _load_tile(q, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32) * left
        k_i = (_load_tile(k, tok0, rows_i, H, head, K, cols, n_valid).to(tl.float32) * left
               * _load_vec(beta, tok0, rows_i, HV, hv, n_valid)[:, None])
        col_factor = _decay_factor(ref[None, :] - gate_b, valid_b)
        m_ptrs, m_mask = _square_ptrs(dp, tok0, rows_i, HV, hv, rows_b, n_valid)
        dkp_b += tl.dot(tl.trans(tl.load(m_ptrs, mask=m_mask, other=0.0)), q_i) * col_factor
        m_ptrs, m_mask = _square_ptrs(da, tok0, rows_i, HV, hv, rows_b, n_valid)
        dkc_b += tl.dot(tl.trans(tl.load(m_ptrs, mask=m_mask, other=0.0)), k_i) * col_factor
    q_b = _load_tile(q, tok0, rows_b, H, head, K, cols, n_valid).to(tl.float32)
    k_b = _load_tile(k, tok0, rows_b, H, head, K, cols, n_valid).to(tl.float32)
    beta_b = _load_vec(beta, tok0, rows_b, HV, hv, n_valid)[:, None]
    # gradient buffers are per value head, fp32; this program owns rows b of its K tile
    ptrs, mask = _tile_ptrs(db, tok0, rows_b, HV, hv, K, cols, n_valid)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * (q_b * dq_b - k_b * dkp_b)
             + (beta_b * k_b * dka_b - k_b * dkc_b), mask=mask)
    ptrs, mask = _tile_ptrs(dq, tok0, rows_b, HV, hv, K, cols, n_valid)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * dq_b, mask=mask)
    ptrs, mask = _tile_ptrs(dk, tok0, rows_b, HV, hv, K, cols, n_valid)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * dkp_b + beta_b * dka_b + dkc_b,
             mask=mask)
    # dbeta: this K tile's share into a buffer of its own (the caller sums the tiles in a fixed
    # order: atomics across tiles made dbeta vary in its last bits from run to run)
    _store_vec(dbeta_parts + k_tile.to(tl.int64) * part_stride, tl.sum(k_b * dka_b, axis=1),
               tok0, rows_b, HV, hv, n_valid)


@triton.jit(do_not_specialize=["T"])
def gdn_gate_grad_kernel(db, dg, dgk, chunk_map, cu_seqlens, T,
                         HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                         HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """With gk: the per-key gate terms dB, reverse-cumsummed within the chunk, are dgk; their sum
    over keys, reverse-cumsummed, is dg. BK covers all of K (a loop-carried row sum here trips
    Triton 3.6's thread-locality pass on Hopper)."""
    slot = tl.program_id(0)
    bhv = tl.program_id(1)
    hv = bhv % HV
    tok0, n_valid, _ = _chunk_of_slot(slot, bhv // HV, chunk_map, cu_seqlens, T, IS_VARLEN)
    rows = tl.arange(0, 64)
    cols = tl.arange(0, BK)
    d = _load_tile(db, tok0, rows, HV, hv, K, cols, n_valid)
    _store_tile(dgk, _reverse_cumsum(d), tok0, rows, HV, hv, K, cols, n_valid)
    if HAS_G:
        _store_vec(dg, _reverse_cumsum(tl.sum(d, axis=1)), tok0, rows, HV, hv, n_valid)
