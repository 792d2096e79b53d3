"""Pieces every Triton kernel of dynamic mask attention shares: row and tile loads, the scores of
one tile, and the query-major key walk of the forward and the dq kernel.

Layout follows FlashAttention: q [B, Sq, H, D], k/v [B, Sk, Hk, D]; varlen packs sequences along
the token axis and passes cu_seqlens. Mask and bias are read through four strides each, so any
broadcast shape costs nothing to pass (a broadcast dim has stride 0 or is flagged *_BCAST, which
loads a vector instead of a tile).

How the key axis is walked (KV_MODE, chosen on the host by sparsity.py):
  KV_DENSE       every key tile; the causal rule cuts the range short;
  KV_BLOCK_LIST  only listed tiles: first the "full" ones (every entry kept and visible: no mask
                 load, no checks), then the "partial" ones (mask and checks applied);
  KV_GATHERED    key-wise masks: the kept keys, compacted, so the work is O(Sq * kept).
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

from ....runtime.triton_math import exp2_split
from .. import sparsity

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# the walk modes of sparsity.py, as the kernels compare them
KV_DENSE = tl.constexpr(sparsity.KV_DENSE)
KV_BLOCK_LIST = tl.constexpr(sparsity.KV_BLOCK_LIST)
KV_GATHERED = tl.constexpr(sparsity.KV_GATHERED)

# Which pass the shared query-major walk serves (walk_keys_query_major)
FORWARD_PASS = tl.constexpr(0)
DQ_PASS = tl.constexpr(1)


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
                                   Q_BCAST=BIAS_Q_BCAST, K_BCAST=BIAS_K_BCAST, KEY_ROWS=KEY_ROWS,
                                   BOUNDS=BOUNDS)
    if APPLY_MASK:
        keep = _load_pair_tile(mask_base, q_local, k_pos, stride_mq, stride_mk, q_ok, k_ok, 0,
                               Q_BCAST=MASK_Q_BCAST, K_BCAST=MASK_K_BCAST, KEY_ROWS=KEY_ROWS,
                               BOUNDS=BOUNDS)
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
    3 and 2). Not done in the key-major backward (it spills more) nor for gathered keys (slower
    there); docs/perf/attention.md has the measurements."""
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
        k = _load_rows(k_base, k_pos, seqlen_k, stride_ks, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=BOUNDS)
        v = _load_rows(v_base, k_pos, seqlen_k, stride_vs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=BOUNDS)
    bias, keep = _load_bias_and_keep(mask_base, bias_base, local_m, k_pos, offs_m < seqlen_q,
                                     k_pos < seqlen_k, stride_mq, stride_mk, stride_bq, stride_bk,
                                     bias_desc, bias_b, bias_h, q0, k_start,
                                     APPLY_MASK=APPLY_MASK and CHECK, HAS_BIAS=HAS_BIAS,
                                     MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
                                     BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST,
                                     KEY_ROWS=False, BOUNDS=BOUNDS,
                                     BIAS_BY_DESC=BIAS_DESC and CONTIG)
    s = _scores_log2(q, k, bias, keep, offs_m, k_pos, seqlen_q, seqlen_k, qk_scale,
                     IS_CAUSAL=IS_CAUSAL, APPLY_MASK=APPLY_MASK, HAS_BIAS=HAS_BIAS, CHECK=CHECK,
                     BOUNDS=BOUNDS, KEY_ROWS=False)
    return k, v, s



@triton.jit
def _query_major_step(m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base,
                      offs_m, local_m, k_pos, k_start, k_tok0, seqlen_q, seqlen_k, qk_scale,
                      stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                      k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0,
                      PASS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
                      BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, CHECK: tl.constexpr,
                      BOUNDS: tl.constexpr, CONTIG: tl.constexpr, KV_DESC: tl.constexpr,
                      BIAS_DESC: tl.constexpr, EXP2_POLY: tl.constexpr):
    """One key tile of a query-major pass, on the carried (m_i, l_i, acc). FORWARD_PASS:
    online-softmax update of (running max, running sum, output accumulator). DQ_PASS: acc += dS k
    (unscaled), from the saved log-sum-exp (lse2, log2 units) and delta; m_i and l_i pass through.
    (The carried values are in the order the forward defines them: Triton orders a loop's
    carried values by definition, and that order shows in the compiled code.)"""
    k, v, s = _key_tile_scores(q, k_base, v_base, mask_base, bias_base, offs_m, local_m, k_pos,
                               seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs, stride_mq,
                               stride_mk, stride_bq, stride_bk, offs_d, k_desc, v_desc, k_start,
                               k_tok0, hk, bias_desc, bias_b, bias_h, q0, HEAD_DIM=HEAD_DIM,
                               BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=APPLY_MASK,
                               HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST,
                               MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                               BIAS_K_BCAST=BIAS_K_BCAST, CHECK=CHECK, BOUNDS=BOUNDS,
                               CONTIG=CONTIG, KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC)
    if PASS == FORWARD_PASS:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - (-inf)) never makes a NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = exp2_split(s - m_safe[:, None], EXP2_POLY)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        acc = acc + tl.dot(ds.to(k.dtype), k)
        m_new = m_i
    return m_new, l_i, acc


@triton.jit
def walk_keys_query_major(m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base,
                          offs_m, local_m, offs_n, offs_d, m_block, b64, h, hk, seqlen_q, seqlen_k,
                          qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq,
                          stride_bk, LIST_COUNT, LIST_INDEX, stride_cb, stride_ch, stride_cq,
                          stride_ib, stride_ih, stride_iq, stride_ik, list_head_div, k_desc,
                          v_desc, k_tok0, bias_desc, bias_b, bias_h, q0,
                          PASS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
                          BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
                          KV_MODE: tl.constexpr, KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr,
                          WARP_SPECIALIZE: tl.constexpr, EXP2_POLY: tl.constexpr):
    """The key walk of one query tile, shared by the forward (PASS=FORWARD_PASS) and the dq kernel
    (DQ_PASS): every key tile the walk mode visits, interior tiles without checks first. Returns
    the carried (m_i, l_i, acc) (see _query_major_step)."""
    if KV_MODE == KV_DENSE:
        n_full, n_iter = _dense_key_split(m_block, seqlen_q, seqlen_k, IS_CAUSAL, BLOCK_M, BLOCK_N)
        for it in tl.range(0, n_full, warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=False, BOUNDS=False, CONTIG=True,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
        for it in range(n_full, n_iter):
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, it * BLOCK_N + offs_n, it * BLOCK_N, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=True, BOUNDS=True, CONTIG=False,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
    elif KV_MODE == KV_BLOCK_LIST:
        hl = h // list_head_div
        counts = LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq
        lists = LIST_INDEX + b64 * stride_ib + hl * stride_ih + m_block * stride_iq
        n_full = tl.load(counts)
        n_part = tl.load(counts + 1)
        entry = _list_entry(lists, 0, n_full)
        for it in range(0, n_full):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists, it + 1, n_full)
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=False, BOUNDS=False, CONTIG=True,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
        # partial tiles ascend, so only the last one can be the ragged tile at the sequence's end
        entry = _list_entry(lists + stride_ik, 0, n_part - 1)
        for it in range(0, n_part - 1):
            k_start = entry * BLOCK_N
            entry = _list_entry(lists + stride_ik, it + 1, n_part - 1)
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=True, BOUNDS=False, CONTIG=True,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
        for it in range(tl.maximum(n_part - 1, 0), n_part):  # the last one, bounds-checked
            k_start = tl.load(lists + stride_ik + it) * BLOCK_N
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_start + offs_n, k_start, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=True, BOUNDS=True, CONTIG=False,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
    else:  # KV_GATHERED: compacted kept keys; only the causal rule is checked (the mask made them)
        hl = h // list_head_div
        kept = tl.load(LIST_COUNT + b64 * stride_cb + hl * stride_ch + m_block * stride_cq)
        keys = LIST_INDEX + b64 * stride_ib + hl * stride_ih
        n_iter = tl.cdiv(kept, BLOCK_N)
        for it in range(0, n_iter - 1):
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, BOUNDS=False)
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=IS_CAUSAL, BOUNDS=False, CONTIG=False,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
        for it in range(tl.maximum(n_iter - 1, 0), n_iter):  # the last one, bounds-checked
            k_pos = _gathered_key_positions(it, keys, kept, seqlen_k, BLOCK_N, BOUNDS=True)
            m_i, l_i, acc = _query_major_step(
                m_i, l_i, acc, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m,
                local_m, k_pos, 0, k_tok0, seqlen_q, seqlen_k,
                qk_scale, stride_ks, stride_vs, stride_mq, stride_mk, stride_bq, stride_bk, offs_d,
                k_desc, v_desc, hk, bias_desc, bias_b, bias_h, q0, PASS=PASS, HEAD_DIM=HEAD_DIM,
                BLOCK_D=BLOCK_D, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                BIAS_K_BCAST=BIAS_K_BCAST, CHECK=True, BOUNDS=True, CONTIG=False,
                KV_DESC=KV_DESC, BIAS_DESC=BIAS_DESC, EXP2_POLY=EXP2_POLY)
    return m_i, l_i, acc
