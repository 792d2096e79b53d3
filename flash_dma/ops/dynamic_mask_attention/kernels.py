"""Triton kernels of dynamic mask attention (forward, and the three backward passes).

Layout follows FlashAttention: q [B, Sq, H, D], k/v [B, Sk, Hk, D]; varlen packs sequences along
the token axis and passes cu_seqlens. Mask and bias are read through four strides each, so any
broadcast shape costs nothing to pass (a broadcast dim has stride 0 or is flagged *_BCAST, which
loads a vector instead of a tile).

How the key axis is walked (KV_MODE, chosen on the host by sparsity.py):
  0 DENSE       every key tile; the causal rule cuts the range short;
  1 BLOCK_LIST  only listed tiles: first the "full" ones (every entry kept and visible: no mask
                load, no checks), then the "partial" ones (mask and checks applied);
  2 GATHER      key-wise masks: the kept keys, compacted, so the work is O(Sq * kept).
The key-major backward kernel (dk, dv, dbias) walks query tiles with the transposed lists.

Two compile-time switches per tile keep interior tiles lean:
  CHECK   apply visibility (causal rule, keep-mask) with a where();
  BOUNDS  the tile may hold keys past the sequence: guard loads and hide those keys. Lengths are
          runtime values, so a guard on keys stops Triton from vectorising the bias and mask
          loads along keys; only the one ragged tile per row pays for it.

Softmax runs in base 2: scores are multiplied by log2(e) once, exp2 replaces exp. The saved
log-sum-exp is in natural log, as FlashAttention returns it; fully hidden rows get +inf so
that every probability recomputed from it is exactly 0.

Lengths are runtime arguments (never constexpr), so one compilation serves every length.
Offsets that can pass 2^31 (token rows times strides) are computed in int64.
"""
import triton
import triton.language as tl

from ...runtime.triton_math import exp2_split

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

KV_DENSE = 0
KV_BLOCK_LIST = 1
KV_GATHER = 2

# Where dq comes from (DQ_MODE of the key-major kernel): a separate query-major kernel (DQ_NONE
# here), or this kernel adds dS k into an fp32 accumulator, by element atomics or by TMA bulk
# reductions (Hopper and later).
DQ_NONE = tl.constexpr(0)
DQ_ATOMIC = tl.constexpr(1)
DQ_TMA_REDUCE = tl.constexpr(2)

# Orientation of the key-major backward tile, (without, with) a bias or mask to read: keys on
# rows (True) or queries on rows (False). Measured on an H200: see bench/results/.
DKDV_KEY_ROWS = {False: True, True: True}


def dkdv_key_rows(reads_pairs: bool) -> bool:
    return DKDV_KEY_ROWS[reads_pairs]


@triton.jit
def _sequence_span(cu_seqlens, b, fixed_len, IS_VARLEN: tl.constexpr):
    """(first token row of sequence b, its length): from cu_seqlens, or b's slot of a batch."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens + b)
        length = tl.load(cu_seqlens + b + 1) - start
        return start.to(tl.int64), length
    else:
        return tl.full([], 0, tl.int64), fixed_len


@triton.jit
def _load_pair_tile(base, q_idx, k_idx, stride_q, stride_k, q_ok, k_ok, other,
                    Q_BCAST: tl.constexpr, K_BCAST: tl.constexpr, KEY_ROWS: tl.constexpr,
                    BOUNDS: tl.constexpr):
    """Load a (query, key) tile of a broadcastable [.., Sq|1, Sk|1] tensor (mask or bias).

    Returns something that broadcasts to [M, N] (queries along rows), or to [N, M] when
    KEY_ROWS. A broadcast axis is loaded once as a vector, not as a full tile. Query rows are
    always guarded (a query tile may overhang the sequence); keys only when BOUNDS.
    """
    if KEY_ROWS:
        qi = q_idx[None, :]
        kj = k_idx[:, None]
        qok = q_ok[None, :]
        kok = k_ok[:, None]
    else:
        qi = q_idx[:, None]
        kj = k_idx[None, :]
        qok = q_ok[:, None]
        kok = k_ok[None, :]
    if Q_BCAST:
        if K_BCAST:
            val = tl.load(base)
        elif BOUNDS:
            val = tl.load(base + kj * stride_k, mask=kok, other=other)
        else:
            val = tl.load(base + kj * stride_k)
    else:
        if K_BCAST:
            val = tl.load(base + qi * stride_q, mask=qok, other=other)
        elif BOUNDS:
            val = tl.load(base + qi * stride_q + kj * stride_k, mask=qok & kok, other=other)
        else:
            val = tl.load(base + qi * stride_q + kj * stride_k, mask=qok, other=other)
    return val


@triton.jit
def _load_bias_and_keep(mask_base, bias_base, q_local, k_pos, q_ok, k_ok,
                        stride_mq, stride_mk, stride_bq, stride_bk, bias_desc, bias_b, bias_h, q0, k0,
                        APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                        MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
                        BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
                        KEY_ROWS: tl.constexpr, BOUNDS: tl.constexpr, BIAS_BY_DESC: tl.constexpr):
    """The bias and keep-mask tiles of one (query, key) tile. Issued before the tile's first dot so
    that their memory latency hides behind the matrix work. BIAS_BY_DESC: a whole [M, N] bias
    tile at (q0, k0) comes by the tensor-memory accelerator (asynchronous, pipelined)."""
    bias = 0.0
    keep = 1
    if HAS_BIAS:
        if BIAS_BY_DESC:
            tile = bias_desc.load([bias_b, bias_h, q0, k0]).reshape(q_local.shape[0], k_pos.shape[0])
            bias = tl.trans(tile) if KEY_ROWS else tile
        else:
            bias = _load_pair_tile(bias_base, q_local, k_pos, stride_bq, stride_bk, q_ok, k_ok, 0.0,
                                   BIAS_Q_BCAST, BIAS_K_BCAST, KEY_ROWS, BOUNDS)
    if APPLY_MASK:
        keep = _load_pair_tile(mask_base, q_local, k_pos, stride_mq, stride_mk, q_ok, k_ok, 0,
                               MASK_Q_BCAST, MASK_K_BCAST, KEY_ROWS, BOUNDS)
    return bias, keep


@triton.jit
def _scores_log2(q, k, bias, keep, q_pos, k_pos, seqlen_q, seqlen_k, qk_scale,
                 IS_CAUSAL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 CHECK: tl.constexpr, BOUNDS: tl.constexpr, KEY_ROWS: tl.constexpr):
    """Scores in log2 units: (scale q k^T + bias) * log2(e), -inf where a key is hidden.
    KEY_ROWS computes the transposed tile k q^T (key-major pass)."""
    if KEY_ROWS:
        s = tl.dot(k, tl.trans(q))
        kj = k_pos[:, None]
        qi = q_pos[None, :]
    else:
        s = tl.dot(q, tl.trans(k))
        kj = k_pos[None, :]
        qi = q_pos[:, None]
    s = s * qk_scale
    if HAS_BIAS:
        s += bias.to(tl.float32) * LOG2E
    if BOUNDS:
        s = tl.where(kj < seqlen_k, s, float("-inf"))
    if CHECK:
        if IS_CAUSAL:
            # bottom-right aligned: key j is hidden from query i when j > i + (Sk - Sq)
            s = tl.where(kj <= qi + (seqlen_k - seqlen_q), s, float("-inf"))
        if APPLY_MASK:
            s = tl.where(keep != 0, s, float("-inf"))
    return s


@triton.jit
def _dense_key_split(m_block, seqlen_q, seqlen_k, IS_CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dense walk of one query tile: (key tiles needing no check, key tiles in all).

    Interior tiles come first; the rest (the causal diagonal, the ragged last tile) are checked.
    """
    if IS_CAUSAL:
        shift = seqlen_k - seqlen_q
        first_row = m_block * BLOCK_M
        hi = tl.minimum(tl.maximum(first_row + BLOCK_M + shift, 0), seqlen_k)
        n_full = tl.minimum(tl.maximum(first_row + shift + 1, 0) // BLOCK_N, seqlen_k // BLOCK_N)
        return n_full, tl.cdiv(hi, BLOCK_N)
    else:
        return seqlen_k // BLOCK_N, tl.cdiv(seqlen_k, BLOCK_N)


@triton.jit
def _gathered_key_positions(it, list_index, kept_count, seqlen_k, BLOCK_N: tl.constexpr,
                            BOUNDS: tl.constexpr):
    """Key positions of the it-th tile of compacted keys; past the kept ones: seqlen_k (no key)."""
    slot = it * BLOCK_N + tl.arange(0, BLOCK_N)
    if BOUNDS:
        pos = tl.load(list_index + slot, mask=slot < kept_count, other=0)
        return tl.where(slot < kept_count, pos, seqlen_k)
    else:
        return tl.load(list_index + slot)


@triton.jit
def _list_entry(entries, it, count):
    """Entry `it` of a tile list, 0 past its `count` entries. The query-major walks read each
    entry one tile ahead: an entry loaded in the iteration that uses it made Triton's pipeliner
    give the tile loads one buffer fewer (at 3 stages 2 K/V buffers and 1 bias buffer instead of
    3 and 2). H200, B2 H16 S4096 D128 full bias, forward: all tiles listed 1.03 -> 0.74 ms (the
    dense walk: 0.71), 1/8 of the tiles 0.179 -> 0.141 ms; the dq kernel: even. Not done in the
    key-major backward (all tiles 3.54 -> 3.98 ms: it spills more) nor for gathered keys
    (top-1024 forward 0.569 -> 0.636 ms)."""
    return tl.load(entries + it, mask=it < count, other=0)


@triton.jit
def _load_rows(base, pos, limit, stride_s, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BOUNDS: tl.constexpr):
    """[len(pos), BLOCK_D] rows of a [tokens, D] view; rows >= limit and padded dims read 0."""
    ptrs = base + pos.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
    if BOUNDS:
        return tl.load(ptrs, mask=(pos[:, None] < limit) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _store_rows(base, pos, limit, stride_s, offs_d, value, HEAD_DIM: tl.constexpr):
    ptrs = base + pos.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
    tl.store(ptrs, value, mask=(pos[:, None] < limit) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _query_tile_program(CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, kv_group, IS_VARLEN: tl.constexpr):
    """Who this program is in a query-tile-major grid (query tile, batch or sequence x head), and
    where its sequence lies: (m_block, b as int64, h, kv head, q row0, Sq, k row0, Sk)."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    q_row0, seqlen_q = _sequence_span(CU_Q, b, seqlen_q, IS_VARLEN)
    k_row0, seqlen_k = _sequence_span(CU_K, b, seqlen_k, IS_VARLEN)
    return m_block, b.to(tl.int64), h, h // kv_group, q_row0, seqlen_q, k_row0, seqlen_k


@triton.jit
def _key_tile_scores(q, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
                     seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq, stride_mk,
                     stride_bq, stride_bk, offs_d, k_desc, v_desc, k_start, k_tok0, hk,
                     bias_desc, bias_b, bias_h, q0,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr,
                     MASK_K_BCAST: tl.constexpr, BIAS_Q_BCAST: tl.constexpr,
                     BIAS_K_BCAST: tl.constexpr, CHECK: tl.constexpr, BOUNDS: tl.constexpr,
                     CONTIG: tl.constexpr, KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr):
    """Query-major step shared by the forward and dq: load a key tile (k, v, bias, mask) and
    return (k, v, scores in log2 units with hidden keys at -inf). CONTIG: the tile is whole keys
    k_start.. inside the sequence, so the descriptors (when the host made them) can serve it:
    k and v from row k_tok0 + k_start of a [tokens, Hk, D] view, the bias at (q0, k_start)."""
    if KV_DESC and CONTIG:
        k = k_desc.load([k_tok0 + k_start, hk, 0]).reshape(k_pos.shape[0], BLOCK_D)
        v = v_desc.load([k_tok0 + k_start, hk, 0]).reshape(k_pos.shape[0], BLOCK_D)
    else:
        k = _load_rows(k_base, k_pos, seqlen_k, stride_ks, offs_d, HEAD_DIM, BLOCK_D, BOUNDS)
        v = _load_rows(v_base, k_pos, seqlen_k, stride_vs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS)
    bias, keep = _load_bias_and_keep(mask_base, bias_base, local_m, k_pos, offs_m < seqlen_q,
                                     k_pos < seqlen_k, stride_mq, stride_mk, stride_bq, stride_bk,
                                     bias_desc, bias_b, bias_h, q0, k_start,
                                     APPLY_MASK and CHECK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                                     BIAS_Q_BCAST, BIAS_K_BCAST, False, BOUNDS, BIAS_DESC and CONTIG)
    s = _scores_log2(q, k, bias, keep, offs_m, k_pos, seqlen_q, seqlen_k, qk_scale,
                     IS_CAUSAL, APPLY_MASK, HAS_BIAS, CHECK, BOUNDS, False)
    return k, v, s


# ----------------------------------------------------------------------------------- forward

@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
              k_start, k_tok0, seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq,
              stride_mk, stride_bq, stride_bk, offs_d, k_desc, v_desc, hk, bias_desc, bias_b,
              bias_h, q0,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
              APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr,
              MASK_K_BCAST: tl.constexpr, BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
              CHECK: tl.constexpr, BOUNDS: tl.constexpr, CONTIG: tl.constexpr,
              KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr, EXP2_POLY: tl.constexpr):
    """One key tile of the forward: online-softmax update of (acc, running max, running sum)."""
    k, v, s = _key_tile_scores(q, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
                               seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq,
                               stride_mk, stride_bq, stride_bk, offs_d, k_desc, v_desc, k_start,
                               k_tok0, hk, bias_desc, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D,
                               IS_CAUSAL, APPLY_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                               BIAS_Q_BCAST, BIAS_K_BCAST, CHECK, BOUNDS, CONTIG, KV_DESC,
                               BIAS_DESC)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead so that
    # exp2(-inf - (-inf)) never makes a NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp2_split(s - m_safe[:, None], EXP2_POLY)
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "stride_cb",
                               "stride_ch", "stride_cq", "stride_ib", "stride_ih", "stride_iq",
                               "stride_ik"])
def attn_fwd_kernel(
    Q, K, V, K_DESC, V_DESC, O, LSE, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT, LIST_INDEX,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_cb, stride_ch, stride_cq,
    stride_ib, stride_ih, stride_iq, stride_ik,
    num_heads, kv_group, mask_head_div, bias_head_div, list_head_div,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
    BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, KV_MODE: tl.constexpr,
    KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    EXP2_POLY: tl.constexpr,
):
    m_block, b64, h, hk, q_row0, seqlen_q, k_row0, seqlen_k = _query_tile_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, kv_group, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_base = Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs
    k_base = K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks
    v_base = V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs
    block_q0 = (m_block * BLOCK_M).to(tl.int64)
    mask_base = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh + block_q0 * stride_mq
    bias_base = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh + block_q0 * stride_bq

    q = _load_rows(q_base, offs_m, seqlen_q, stride_qs, offs_d, HEAD_DIM, BLOCK_D, True)
    qk_scale = softmax_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # first key row of this sequence in K/V seen as [tokens, Hk, D] (the descriptors' view)
    k_tok0 = (k_row0 + b64 * seqlen_k).to(tl.int32) if not IS_VARLEN else k_row0.to(tl.int32)
    # the bias tile's coordinates in its own [B|1, heads, Sq, Sk] descriptor
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)
    bias_h = h // bias_head_div
    q0 = m_block * BLOCK_M
    if KV_MODE == 0:
        n_full, n_iter = _dense_key_split(m_block, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
        for it in tl.range(0, n_full, warp_specialize=WARP_SPECIALIZE):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, False, False, True, KV_DESC, BIAS_DESC,
                EXP2_POLY)
        for it in range(n_full, n_iter):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC,
                EXP2_POLY)
    elif KV_MODE == 1:
        hl = h // list_head_div
        counts = LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq
        lists = LIST_INDEX + b64 * stride_ib + hl * stride_ih + m_block * stride_iq
        n_full = tl.load(counts)
        n_part = tl.load(counts + 1)
        entry = _list_entry(lists, 0, n_full)
        for it in range(0, n_full):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists, it + 1, n_full)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, False, False, True, KV_DESC, BIAS_DESC,
                EXP2_POLY)
        # partial tiles ascend, so only the last one can be the ragged tile at the sequence's end
        entry = _list_entry(lists + stride_ik, 0, n_part - 1)
        for it in range(0, n_part - 1):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists + stride_ik, it + 1, n_part - 1)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, False, True, KV_DESC, BIAS_DESC,
                EXP2_POLY)
        for it in range(tl.maximum(n_part - 1, 0), n_part):  # the last one, bounds-checked
            k_start = tl.load(lists + stride_ik + it) * BLOCK_N
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC,
                EXP2_POLY)
    else:
        hl = h // list_head_div
        kept = tl.load(LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq)
        keys = LIST_INDEX + b64 * stride_ib + hl * stride_ih
        n_iter = tl.cdiv(kept, BLOCK_N)
        for it in range(0, n_iter - 1):
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, False)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, IS_CAUSAL, False, False, KV_DESC, BIAS_DESC,
                EXP2_POLY)
        for it in range(tl.maximum(n_iter - 1, 0), n_iter):  # the last one, bounds-checked
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, True)
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC,
                EXP2_POLY)

    empty_row = l_i == 0.0
    out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    lse = tl.where(empty_row, float("inf"), (m_i + tl.math.log2(l_i)) * LN2)
    o_base = O + b64 * stride_ob + h * stride_oh + q_row0 * stride_os
    _store_rows(o_base, offs_m, seqlen_q, stride_os, offs_d, out.to(O.dtype.element_ty), HEAD_DIM)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + q_row0 + offs_m, lse, mask=offs_m < seqlen_q)


# ---------------------------------------------------------------------------------- backward

@triton.jit(do_not_specialize=["seqlen_q", "stride_lb", "stride_lh"])
def attn_bwd_delta_kernel(
    O, DO, DELTA, DQ_ACC, CU_Q, seqlen_q,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_ab, stride_as, stride_ah,
    stride_lb, stride_lh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    ZERO_DQ_ACC: tl.constexpr,
):
    """delta = rowsum(dO * O): the softmax-gradient correction term, one value per query row.
    ZERO_DQ_ACC: also clear the same rows of the fp32 dq accumulator that the key-major pass adds
    into (one pass over the rows instead of a separate fill)."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    q_row0, seqlen_q = _sequence_span(CU_Q, b, seqlen_q, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + b64 * stride_ob + h * stride_oh + q_row0 * stride_os, offs_m, seqlen_q,
                   stride_os, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_db + h * stride_dh + q_row0 * stride_ds, offs_m, seqlen_q,
                    stride_ds, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b64 * stride_lb + h * stride_lh + q_row0 + offs_m, delta, mask=offs_m < seqlen_q)
    if ZERO_DQ_ACC:
        _store_rows(DQ_ACC + b64 * stride_ab + h * stride_ah + q_row0 * stride_as, offs_m, seqlen_q,
                    stride_as, offs_d, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), HEAD_DIM)


@triton.jit
def scale_cast_kernel(SRC, DST, n, scale, BLOCK: tl.constexpr):
    """DST = SRC * scale in DST's dtype, over n contiguous elements (the fp32 dq accumulator into
    dq). torch's mixed-dtype elementwise path ran at ~2.9 TB/s here (H200)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(SRC + offs, mask=ok)
    tl.store(DST + offs, (x * scale).to(DST.dtype.element_ty), mask=ok)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
             k_start, k_tok0, seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq,
             stride_mk, stride_bq, stride_bk, offs_d, k_desc, v_desc, hk, bias_desc, bias_b,
             bias_h, q0,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr,
             APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr,
             MASK_K_BCAST: tl.constexpr, BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
             CHECK: tl.constexpr, BOUNDS: tl.constexpr, CONTIG: tl.constexpr,
              KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr):
    k, v, s = _key_tile_scores(q, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
                               seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq,
                               stride_mk, stride_bq, stride_bk, offs_d, k_desc, v_desc, k_start,
                               k_tok0, hk, bias_desc, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D,
                               IS_CAUSAL, APPLY_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                               BIAS_Q_BCAST, BIAS_K_BCAST, CHECK, BOUNDS, CONTIG, KV_DESC,
                               BIAS_DESC)
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "stride_cb",
                               "stride_ch", "stride_cq", "stride_ib", "stride_ih", "stride_iq",
                               "stride_ik"])
def attn_bwd_dq_kernel(
    Q, K, V, K_DESC, V_DESC, DO, DQ, LSE, DELTA, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT,
    LIST_INDEX,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_cb, stride_ch, stride_cq,
    stride_ib, stride_ih, stride_iq, stride_ik,
    num_heads, kv_group, mask_head_div, bias_head_div, list_head_div,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
    BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, KV_MODE: tl.constexpr,
    KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr,
):
    """dq = scale * sum_j dS_ij k_j, query-tile-major: walks keys exactly as the forward does."""
    m_block, b64, h, hk, q_row0, seqlen_q, k_row0, seqlen_k = _query_tile_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, kv_group, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks
    v_base = V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs
    block_q0 = (m_block * BLOCK_M).to(tl.int64)
    mask_base = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh + block_q0 * stride_mq
    bias_base = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh + block_q0 * stride_bq

    q = _load_rows(Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs, offs_m, seqlen_q,
                   stride_qs, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + b64 * stride_dob + h * stride_doh + q_row0 * stride_dos, offs_m, seqlen_q,
                    stride_dos, offs_d, HEAD_DIM, BLOCK_D, True)
    row_stat = b64 * stride_lb + h * stride_lh + q_row0 + offs_m
    lse2 = tl.load(LSE + row_stat, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + row_stat, mask=offs_m < seqlen_q, other=0.0)
    qk_scale = softmax_scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # first key row of this sequence in K/V seen as [tokens, Hk, D] (the descriptors' view)
    k_tok0 = (k_row0 + b64 * seqlen_k).to(tl.int32) if not IS_VARLEN else k_row0.to(tl.int32)
    # the bias tile's coordinates in its own [B|1, heads, Sq, Sk] descriptor
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)
    bias_h = h // bias_head_div
    q0 = m_block * BLOCK_M
    if KV_MODE == 0:
        n_full, n_iter = _dense_key_split(m_block, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
        for it in range(0, n_full):
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, False, False, True, KV_DESC, BIAS_DESC)
        for it in range(n_full, n_iter):
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC)
    elif KV_MODE == 1:
        hl = h // list_head_div
        counts = LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq
        lists = LIST_INDEX + b64 * stride_ib + hl * stride_ih + m_block * stride_iq
        n_full = tl.load(counts)
        n_part = tl.load(counts + 1)
        entry = _list_entry(lists, 0, n_full)
        for it in range(0, n_full):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists, it + 1, n_full)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, False, False, True, KV_DESC, BIAS_DESC)
        # partial tiles ascend, so only the last one can be the ragged tile at the sequence's end
        entry = _list_entry(lists + stride_ik, 0, n_part - 1)
        for it in range(0, n_part - 1):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists + stride_ik, it + 1, n_part - 1)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, False, True, KV_DESC, BIAS_DESC)
        for it in range(tl.maximum(n_part - 1, 0), n_part):  # the last one, bounds-checked
            k_start = tl.load(lists + stride_ik + it) * BLOCK_N
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC)
    else:
        hl = h // list_head_div
        kept = tl.load(LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq)
        keys = LIST_INDEX + b64 * stride_ib + hl * stride_ih
        n_iter = tl.cdiv(kept, BLOCK_N)
        for it in range(0, n_iter - 1):
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, False)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, IS_CAUSAL, False, False, KV_DESC, BIAS_DESC)
        for it in range(tl.maximum(n_iter - 1, 0), n_iter):  # the last one, bounds-checked
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, True)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d, K_DESC, V_DESC, hk,
                B_DESC, bias_b, bias_h, q0, HEAD_DIM, BLOCK_D, IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST,
                BIAS_Q_BCAST, BIAS_K_BCAST, True, True, False, KV_DESC, BIAS_DESC)

    dq_base = DQ + b64 * stride_dqb + h * stride_dqh + q_row0 * stride_dqs
    _store_rows(dq_base, offs_m, seqlen_q, stride_dqs, offs_d,
                (dq * softmax_scale).to(DQ.dtype.element_ty), HEAD_DIM)


@triton.jit
def _write_dbias(ptr, value, ok, DBIAS_ATOMIC: tl.constexpr):
    if DBIAS_ATOMIC:
        tl.atomic_add(ptr, value.to(tl.float32), mask=ok, sem="relaxed")
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_dq_share(dq_base, dq_desc, dq_row0, dq_h, m_block, offs_m, q_ok, offs_d, stride_dqs, part,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DQ_MODE: tl.constexpr):
    """Add one key tile's share of dq (dS k, unscaled, fp32) into the fp32 dq accumulator that all
    key tiles of the sequence add into: element atomics, or one bulk reduction by the tensor-memory
    accelerator (DQ_TMA_REDUCE: the add happens in L2, the SM only issues it)."""
    if DQ_MODE == DQ_TMA_REDUCE:
        # rows past the sequence carry exact zeros (their probabilities are 0), but they land in
        # the next sequence's rows: clear them anyway, so that nothing but 0 can ever leak there
        part = tl.where(q_ok[:, None], part, 0.0)
        dq_desc.atomic_add([dq_row0 + m_block * BLOCK_M, dq_h, 0],
                           part.reshape(BLOCK_M, 1, part.shape[1]))
    else:
        ptrs = dq_base + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
        tl.atomic_add(ptrs, part, mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")


@triton.jit
def _dkdv_tile(dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA, stat_base,
               mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
               seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
               stride_bq, stride_bk, stride_dbq, stride_dbk, bias_desc, dbias_desc, bias_b, bias_h, k0,
               dq_base, dq_desc, dq_row0, dq_h, stride_dqs,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               IS_CAUSAL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
               MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
               BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
               HAS_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
               CHECK: tl.constexpr, BOUNDS: tl.constexpr, KEY_ROWS: tl.constexpr,
               BIAS_BY_DESC: tl.constexpr, DQ_MODE: tl.constexpr, DBIAS_DESC: tl.constexpr):
    """One query tile against this program's key tile: accumulates dk, dv, and writes or
    accumulates dbias (and, with DQ_MODE, adds this key tile's share of dq). KEY_ROWS computes
    the transposed tile (keys on rows: P^T and dS^T feed the dk/dv products directly); otherwise
    queries are on rows, as bias and dbias lie in memory, and P and dS are transposed into the
    products."""
    offs_m = m_block * BLOCK_M + local_m
    q_ok = offs_m < seqlen_q
    block_q0 = tl.full([], 0, tl.int64) + m_block * BLOCK_M  # int64 before it meets the strides
    # query rows past the sequence read lse = +inf, so their probabilities are exactly 0
    q = _load_rows(q_base, offs_m, seqlen_q, stride_qs, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(do_base, offs_m, seqlen_q, stride_dos, offs_d, HEAD_DIM, BLOCK_D, True)
    lse2 = tl.load(LSE + stat_base + offs_m, mask=q_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + stat_base + offs_m, mask=q_ok, other=0.0)
    bias, keep = _load_bias_and_keep(mask_head + block_q0 * stride_mq, bias_head + block_q0 * stride_bq,
                                     local_m, k_pos, q_ok, k_ok, stride_mq, stride_mk, stride_bq,
                                     stride_bk, bias_desc, bias_b, bias_h, m_block * BLOCK_M, k0,
                                     APPLY_MASK and CHECK, HAS_BIAS, MASK_Q_BCAST,
                                     MASK_K_BCAST, BIAS_Q_BCAST, BIAS_K_BCAST, KEY_ROWS, BOUNDS,
                                     BIAS_BY_DESC)
    s = _scores_log2(q, k, bias, keep, offs_m, k_pos, seqlen_q, seqlen_k, qk_scale,
                     IS_CAUSAL, APPLY_MASK, HAS_BIAS, CHECK, BOUNDS, KEY_ROWS)
    if KEY_ROWS:  # [keys, queries]
        p = tl.math.exp2(s - lse2[None, :])
        dv += tl.dot(p.to(do.dtype), do)
        ds = p * (tl.dot(v, tl.trans(do)) - delta[None, :])
        ds_in = ds.to(q.dtype)
        dk += tl.dot(ds_in, q)
        if DQ_MODE != DQ_NONE:  # (dS^T)^T k, as k^T dS^T: k is the operand already in shared memory
            _add_dq_share(dq_base, dq_desc, dq_row0, dq_h, m_block, offs_m, q_ok, offs_d,
                          stride_dqs,
                          tl.trans(tl.dot(tl.trans(k), ds_in)), HEAD_DIM, BLOCK_M, DQ_MODE)
        qi = local_m[None, :]
        kj = k_pos[:, None]
        tile_ok = q_ok[None, :]
        tile_ok_bounds = q_ok[None, :] & k_ok[:, None]
    else:  # [queries, keys]
        p = tl.math.exp2(s - lse2[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        ds_in = ds.to(q.dtype)
        dk += tl.dot(tl.trans(ds_in), q)
        if DQ_MODE != DQ_NONE:
            _add_dq_share(dq_base, dq_desc, dq_row0, dq_h, m_block, offs_m, q_ok, offs_d,
                          stride_dqs,
                          tl.dot(ds_in, k), HEAD_DIM, BLOCK_M, DQ_MODE)
        qi = local_m[:, None]
        kj = k_pos[None, :]
        tile_ok = q_ok[:, None]
        tile_ok_bounds = q_ok[:, None] & k_ok[None, :]
    if HAS_DBIAS:
        db_tile = dbias_head + block_q0 * stride_dbq
        if BIAS_Q_BCAST:
            db_keys += tl.sum(ds, 1 if KEY_ROWS else 0)
        elif BIAS_K_BCAST:
            _write_dbias(db_tile + local_m * stride_dbq, tl.sum(ds, 0 if KEY_ROWS else 1), q_ok, DBIAS_ATOMIC)
        elif DBIAS_DESC:  # the whole tile by the tensor-memory accelerator (asynchronous; it
            # clips rows and keys past the tensor's edges)
            tile = (tl.trans(ds) if KEY_ROWS else ds).to(dbias_head.dtype.element_ty)
            dbias_desc.store([bias_b, bias_h, m_block * BLOCK_M, k0],
                             tile.reshape(1, 1, BLOCK_M, tile.shape[1]))
        elif BOUNDS:
            _write_dbias(db_tile + qi * stride_dbq + kj * stride_dbk, ds, tile_ok_bounds, DBIAS_ATOMIC)
        else:
            _write_dbias(db_tile + qi * stride_dbq + kj * stride_dbk, ds, tile_ok, DBIAS_ATOMIC)
    return dk, dv, db_keys


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "slot_stride_b",
                               "slot_stride_h", "slot_stride_n", "stride_cb", "stride_ch",
                               "stride_cn", "stride_ib", "stride_ih", "stride_in", "stride_ik"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DBIAS, LSE, DELTA, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT, LIST_INDEX,
    DQ_ACC, DQ_DESC, DB_DESC,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    slot_stride_b, slot_stride_h, slot_stride_n,
    stride_cb, stride_ch, stride_cn,
    stride_ib, stride_ih, stride_in, stride_ik,
    num_heads, kv_group, mask_head_div, bias_head_div, list_head_div,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
    BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, KEY_ROWS: tl.constexpr,
    BIAS_DESC: tl.constexpr, DQ_MODE: tl.constexpr, DBIAS_DESC: tl.constexpr,
):
    """dk, dv (and dbias) for one key tile of one kv head, summed over the heads of its group.

    Each program owns its key rows, so dk and dv need no atomics and no per-query-head buffer.
    dbias: written tile by tile, or reduced along a broadcast axis in registers; when several
    programs add into one bias entry (a bias shared by batch or heads, or broadcast along keys)
    the host asks for fp32 atomics (DBIAS_ATOMIC) or gives each program its own slot
    (deterministic mode) and sums the slots afterwards.
    """
    # gathered key tiles are not contiguous in the bias: no whole-tile dbias stores there
    tl.static_assert(not (DBIAS_DESC and KV_MODE == 2))
    n_block = tl.program_id(0)
    bhk = tl.program_id(1)
    num_kv_heads = num_heads // kv_group
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    q_row0, seqlen_q = _sequence_span(CU_Q, b, seqlen_q, IS_VARLEN)
    k_row0, seqlen_k = _sequence_span(CU_K, b, seqlen_k, IS_VARLEN)
    # first row of this sequence in the dq accumulator's [tokens, H, D] view (descriptor coordinate)
    if IS_VARLEN:
        dq_row0 = q_row0.to(tl.int32)
    else:
        dq_row0 = b * seqlen_q
    b64 = b.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    local_m = tl.arange(0, BLOCK_M)

    if KV_MODE == 2:
        hl0 = (hk * kv_group) // list_head_div  # gathered keys are one set per kv head (host checks)
        kept_total = tl.load(LIST_COUNT + b64 * stride_cb + hl0 * stride_ch)
        if n_block * BLOCK_N >= kept_total:
            return
        slot = n_block * BLOCK_N + offs_n
        k_pos = tl.load(LIST_INDEX + b64 * stride_ib + hl0 * stride_ih + slot,
                        mask=slot < kept_total, other=0)
        k_pos = tl.where(slot < kept_total, k_pos, seqlen_k)
        ragged = (n_block + 1) * BLOCK_N > kept_total
        first_key = tl.min(k_pos, 0)
        last_key = tl.max(tl.where(slot < kept_total, k_pos, 0), 0)
    else:
        if n_block * BLOCK_N >= seqlen_k:
            return
        k_pos = n_block * BLOCK_N + offs_n
        ragged = (n_block + 1) * BLOCK_N > seqlen_k
        first_key = n_block * BLOCK_N
        last_key = first_key + BLOCK_N - 1

    k = _load_rows(K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks, k_pos, seqlen_k,
                   stride_ks, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs, k_pos, seqlen_k,
                   stride_vs, offs_d, HEAD_DIM, BLOCK_D, True)
    k_ok = k_pos < seqlen_k
    qk_scale = softmax_scale * LOG2E
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)  # bias descriptor coordinates
    k0 = n_block * BLOCK_N
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Dense and gathered walks: query tiles [m_lo, m_full) cross the causal diagonal and are
    # checked; from m_full on, every row sees every key of this tile.
    n_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_lo = 0
    m_full = 0
    if IS_CAUSAL:
        shift = seqlen_k - seqlen_q
        m_lo = tl.maximum(first_key - shift, 0) // BLOCK_M
        m_full = tl.minimum(tl.cdiv(tl.maximum(last_key - shift, 0), BLOCK_M), n_m_blocks)
    # a ragged key tile is checked against every query tile. Loop bounds are settled here, outside
    # the head loop: Triton fuses the nested loops only when their bounds are invariant.
    m_check = tl.where(ragged, n_m_blocks, m_full)

    for g in range(0, kv_group):
        h = hk * kv_group + g
        q_base = Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs
        dq_base = DQ_ACC + b64 * stride_dqb + h * stride_dqh + q_row0 * stride_dqs
        do_base = DO + b64 * stride_dob + h * stride_doh + q_row0 * stride_dos
        stat_base = b64 * stride_lb + h * stride_lh + q_row0
        mask_head = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh
        bias_head = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh
        bias_h = h // bias_head_div
        dbias_head = (DBIAS + b64 * stride_dbb + (h // bias_head_div) * stride_dbh
                      + (b64 * slot_stride_b + (h % bias_head_div) * slot_stride_h
                         + n_block * slot_stride_n))
        db_keys = tl.zeros([BLOCK_N], tl.float32)  # dbias summed over queries (Sq-broadcast bias)
        if KV_MODE == 1:
            hl = h // list_head_div
            counts = LIST_COUNT + b64 * stride_cb + hl * stride_ch + n_block * stride_cn
            lists = LIST_INDEX + b64 * stride_ib + hl * stride_ih + n_block * stride_in
            n_full = tl.load(counts)
            n_part = tl.load(counts + 1)
            for it in range(0, n_full):  # (a ragged key tile is never listed as full)
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + it), q_base, do_base, LSE, DELTA,
                    stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
                    seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
                    stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs,
                    HEAD_DIM, BLOCK_D, BLOCK_M,
                    IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST, BIAS_Q_BCAST,
                    BIAS_K_BCAST, HAS_DBIAS, DBIAS_ATOMIC, False, False, KEY_ROWS,
                    BIAS_DESC and KV_MODE != 2, DQ_MODE, DBIAS_DESC)
            # partial tiles are bounds-checked only when this key tile is ragged
            n_lean = tl.where(ragged, 0, n_part)
            for it in range(0, n_lean):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + stride_ik + it), q_base, do_base,
                    LSE, DELTA, stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok,
                    local_m, offs_d, seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos,
                    stride_mq, stride_mk, stride_bq, stride_bk, stride_dbq, stride_dbk,
                    B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs, HEAD_DIM, BLOCK_D, BLOCK_M,
                    IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST,
                    MASK_K_BCAST, BIAS_Q_BCAST, BIAS_K_BCAST, HAS_DBIAS, DBIAS_ATOMIC, True, False, KEY_ROWS,
                    BIAS_DESC and KV_MODE != 2, DQ_MODE, DBIAS_DESC)
            for it in range(n_lean, n_part):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + stride_ik + it), q_base, do_base,
                    LSE, DELTA, stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok,
                    local_m, offs_d, seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos,
                    stride_mq, stride_mk, stride_bq, stride_bk, stride_dbq, stride_dbk,
                    B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs, HEAD_DIM, BLOCK_D, BLOCK_M,
                    IS_CAUSAL, HAS_MASK, HAS_BIAS, MASK_Q_BCAST,
                    MASK_K_BCAST, BIAS_Q_BCAST, BIAS_K_BCAST, HAS_DBIAS, DBIAS_ATOMIC, True, True, KEY_ROWS,
                    False, DQ_MODE, DBIAS_DESC)
        else:
            for m_block in range(m_lo, m_check):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA,
                    stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
                    seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
                    stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs,
                    HEAD_DIM, BLOCK_D, BLOCK_M,
                    IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST, BIAS_Q_BCAST,
                    BIAS_K_BCAST, HAS_DBIAS, DBIAS_ATOMIC, True, True, KEY_ROWS,
                    False, DQ_MODE, DBIAS_DESC)
            for m_block in range(tl.maximum(m_check, m_lo), n_m_blocks):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA,
                    stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
                    seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
                    stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs,
                    HEAD_DIM, BLOCK_D, BLOCK_M,
                    IS_CAUSAL, False, HAS_BIAS, MASK_Q_BCAST, MASK_K_BCAST, BIAS_Q_BCAST,
                    BIAS_K_BCAST, HAS_DBIAS, DBIAS_ATOMIC, False, False, KEY_ROWS,
                    BIAS_DESC and KV_MODE != 2, DQ_MODE, DBIAS_DESC)
        if HAS_DBIAS:
            if BIAS_Q_BCAST:
                if BIAS_K_BCAST:
                    _write_dbias(dbias_head, tl.sum(db_keys, 0), n_block >= 0, DBIAS_ATOMIC)
                else:
                    _write_dbias(dbias_head + k_pos * stride_dbk, db_keys, k_ok, DBIAS_ATOMIC)

    _store_rows(DK + b64 * stride_dkb + hk * stride_dkh + k_row0 * stride_dks, k_pos, seqlen_k,
                stride_dks, offs_d, (dk * softmax_scale).to(DK.dtype.element_ty), HEAD_DIM)
    _store_rows(DV + b64 * stride_dvb + hk * stride_dvh + k_row0 * stride_dvs, k_pos, seqlen_k,
                stride_dvs, offs_d, dv.to(DV.dtype.element_ty), HEAD_DIM)
