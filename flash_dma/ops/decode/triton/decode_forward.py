"""Split-over-keys decode kernel (flash-decoding) with GQA packing.

Grid (splits, B * Hk, row blocks). One program serves one kv head of one batch row: the
H / Hk query heads that read it times the Sq query rows, packed as the rows of one tile (row
r is query head hk * group + r // Sq, query r % Sq), so every key tile is loaded once for the
whole group instead of once per query head. The program walks its split's share of the keys
(whole key tiles), keeps the online softmax in fp32 and writes either the final output (one
split) or a partial (output normalised by its own sum, and its log-sum-exp) that combine.py
merges.

The key axis is walked in one of two ways:
  dense   positions [0, seqlen_k) of the sequence (cached + appended tokens), in tiles;
  gather  a key-wise mask's kept positions, compacted beforehand (compact.py), so only the kept
          keys are read; with one set per query head (MASK_PER_HEAD) the list is the union of
          the group's sets and each row still applies its own.
Either way a tile is a vector of logical key positions translated one by one into cache
offsets (rows.cache_token_offsets): a contiguous cache or a paged one, and gathered keys,
all take the same path.

Lengths, page sizes and counts are runtime values; offsets into the caches, the mask and the
bias are int64 (a cache passes 2^31 elements at B64 S32768 Hk8 D128).
"""
import triton
import triton.language as tl

from .rows import cache_row_and_length, cache_token_offsets

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _pair_row_offsets(b64, h, i, stride_b, stride_h, stride_q, head_div):
    """Row offsets (int64) of a broadcastable [B, H, Sq, S_max] mask or bias for the packed rows
    (query head h, query i); broadcast dims come with stride 0."""
    return b64 * stride_b + (h // head_div).to(tl.int64) * stride_h + i.to(tl.int64) * stride_q


@triton.jit(do_not_specialize=["new_tokens", "capacity", "cache_batch", "num_pages", "num_splits"])
def decode_split_kernel(
    Q, K_CACHE, V_CACHE, OUT, LSE, O_PART, LSE_PART,
    CACHE_SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE, MASK, BIAS, KEPT_COUNT, KEPT_INDEX,
    softmax_scale, seqlen_q, new_tokens, capacity, cache_batch, num_pages, page_shift,
    num_kv_heads, group, num_splits,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_tb,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div,
    stride_cb, stride_ch, stride_ib, stride_ih,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr, SPLIT: tl.constexpr,
    MASK_PER_HEAD: tl.constexpr,
):
    split = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    b64 = b.to(tl.int64)

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    g = rows // seqlen_q
    i = rows % seqlen_q
    h = hk * group + tl.where(row_ok, g, 0)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM

    cache_row, cached, row_valid = cache_row_and_length(
        CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity, cache_batch, HAS_BATCH_IDX)
    seqlen_k = tl.where(row_valid, cached + new_tokens, 0)

    q_ptrs = (Q + b64 * stride_qb + i.to(tl.int64)[:, None] * stride_qs
              + h.to(tl.int64)[:, None] * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = softmax_scale * LOG2E

    mask_rows = _pair_row_offsets(b64, h, i, stride_mb, stride_mh, stride_mq, mask_head_div)
    bias_rows = _pair_row_offsets(b64, h, i, stride_bb, stride_bh, stride_bq, bias_head_div)
    # bottom-right causal: query i sees keys up to seqlen_k - Sq + i
    last_visible = seqlen_k - seqlen_q + i

    # this split's share of the walk, in whole key tiles: key positions (dense) or slots of the
    # compacted kept-key list (gather)
    if GATHER:
        walk_len = tl.load(KEPT_COUNT + b64 * stride_cb + hk * stride_ch)
        walk_len = tl.where(row_valid, walk_len, 0)
        kept_keys = KEPT_INDEX + b64 * stride_ib + hk.to(tl.int64) * stride_ih
    else:
        walk_len = seqlen_k
    tiles_per_split = tl.cdiv(tl.cdiv(walk_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, walk_len)

    k_head = hk.to(tl.int64) * stride_kh
    v_head = hk.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        slot = tile_start + offs_n
        key_ok = slot < end
        if GATHER:
            k_pos = tl.load(kept_keys + slot, mask=key_ok, other=0)
        else:
            k_pos = tl.where(key_ok, slot, 0)
        k_off = cache_token_offsets(k_pos, cache_row, BLOCK_TABLE, stride_tb, num_pages,
                                    page_shift, stride_kb, stride_ks, PAGED)
        v_off = cache_token_offsets(k_pos, cache_row, BLOCK_TABLE, stride_tb, num_pages,
                                    page_shift, stride_vb, stride_vs, PAGED)
        kv_ok = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K_CACHE + k_head + k_off[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V_CACHE + v_head + v_off[:, None] + offs_d[None, :], mask=kv_ok, other=0.0)
        pair_ok = row_ok[:, None] & key_ok[None, :]
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if HAS_BIAS:
            bias = tl.load(BIAS + bias_rows[:, None] + k_pos.to(tl.int64)[None, :] * stride_bk,
                           mask=pair_ok, other=0.0)
            s += bias.to(tl.float32) * LOG2E
        visible = pair_ok
        if IS_CAUSAL:
            visible = visible & (k_pos[None, :] <= last_visible[:, None])
        if HAS_MASK and (MASK_PER_HEAD or not GATHER):
            keep = tl.load(MASK + mask_rows[:, None] + k_pos.to(tl.int64)[None, :] * stride_mk,
                           mask=pair_ok, other=0)
            visible = visible & (keep != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no visible key so far keeps m = -inf: subtract 0 so that no NaN appears
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2
    row_h = h.to(tl.int64)
    store_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # an empty split contributes weight exp(-inf) = 0 to the merge; an invalid row saw no
        # key (seqlen_k = 0) and the merge marks it
        lse = tl.where(empty, float("-inf"), lse)
        # partials are packed [splits, B, H, Sq] rows (of HEAD_DIM values for the output)
        batch = tl.num_programs(1) // num_kv_heads
        part_row = ((split.to(tl.int64) * batch + b64) * (num_kv_heads * group) + row_h) * seqlen_q + i
        tl.store(O_PART + part_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_ok)
        tl.store(LSE_PART + part_row, lse, mask=row_ok)
    else:
        out = tl.where(row_valid, out, float("nan"))
        lse = tl.where(empty, float("inf"), lse)
        lse = tl.where(row_valid, lse, float("nan"))
        o_ptrs = (OUT + b64 * stride_ob + i.to(tl.int64)[:, None] * stride_os
                  + row_h[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=store_ok)
        tl.store(LSE + b64 * stride_lb + row_h * stride_lh + i, lse, mask=row_ok)
