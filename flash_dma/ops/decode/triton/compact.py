"""Kept-key lists of a key-wise mask, built on the device for each call.

A key-wise mask [B|1, Hk|1, 1, S_max] keeps one set of keys per (batch row, kv head). The decode
kernel reads only those keys: this kernel compacts each row's kept positions below the row's
key length (cached + appended tokens) into an ascending int32 list and writes its count. One
program per (b, kv head) scans the mask in chunks with a prefix sum; there is no host
synchronisation and no sort (the argsort of sparsity.py's planner costs O(S log S) per row, and
a decoding mask changes every step, so nothing could be remembered between calls anyway).
"""
import triton
import triton.language as tl

from .rows import cache_row_and_length


@triton.jit(do_not_specialize=["new_tokens", "capacity", "cache_batch", "seqlen_max"])
def compact_kept_keys_kernel(
    MASK, KEPT_COUNT, KEPT_INDEX, CACHE_SEQLENS, CACHE_BATCH_IDX,
    num_kv_heads, mask_head_div, new_tokens, capacity, cache_batch, seqlen_max,
    stride_mb, stride_mh, stride_mk, stride_cb, stride_ch, stride_ib, stride_ih,
    CHUNK: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
):
    bhk = tl.program_id(0)
    b = (bhk // num_kv_heads).to(tl.int64)
    hk = bhk % num_kv_heads
    _, cached, ok = cache_row_and_length(CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity,
                                         cache_batch, HAS_BATCH_IDX)
    limit = tl.minimum(tl.where(ok, cached + new_tokens, 0), seqlen_max)
    mask_row = MASK + b * stride_mb + (hk // mask_head_div).to(tl.int64) * stride_mh
    out_row = KEPT_INDEX + b * stride_ib + hk.to(tl.int64) * stride_ih
    offs = tl.arange(0, CHUNK)
    count = tl.zeros([], tl.int32)  # (a tensor from the start: it is carried by the loop)
    for chunk_start in range(0, limit, CHUNK):
        pos = chunk_start + offs
        keep = tl.load(mask_row + pos.to(tl.int64) * stride_mk, mask=pos < limit, other=0) != 0
        keep_i = keep.to(tl.int32)
        slot = count + tl.cumsum(keep_i, 0) - 1
        tl.store(out_row + slot, pos, mask=keep)
        count += tl.sum(keep_i, 0)
    tl.store(KEPT_COUNT + b * stride_cb + hk * stride_ch, count)
