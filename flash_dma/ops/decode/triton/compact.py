"""Kept-key lists of a key-wise mask, built on the device for each call.

A key-wise mask [B|1, Hk|1, 1, S_max] keeps one set of keys per (batch row, kv head); one of
[B|1, H, 1, S_max] (H > Hk) one per query head, and a decode program, which serves the whole
group of query heads of a kv head, reads the union of its group's sets (and applies each head's
own set as it goes). The decode kernel reads only those keys: this kernel compacts each (row,
kv head)'s kept positions below the row's key length (cached + appended tokens) into an
ascending int32 list and writes its count. One
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
    num_kv_heads, group, heads_per_list, mask_head_div, new_tokens, capacity, cache_batch, seqlen_max,
    stride_mb, stride_mh, stride_mk, stride_cb, stride_ch, stride_ib, stride_ih,
    CHUNK: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
):
    bhk = tl.program_id(0)
    b = (bhk // num_kv_heads).to(tl.int64)
    hk = bhk % num_kv_heads
    _, cached, ok = cache_row_and_length(CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity,
                                         cache_batch, HAS_BATCH_IDX)
    limit = tl.minimum(tl.where(ok, cached + new_tokens, 0), seqlen_max)
    # the mask heads whose union this list is: query heads hk * group .. + heads_per_list - 1,
    # each reading mask head h // mask_head_div (heads_per_list is 1 unless the mask has H heads)
    mask_base = MASK + b * stride_mb
    first_head = hk * group
    out_row = KEPT_INDEX + b * stride_ib + hk.to(tl.int64) * stride_ih
    offs = tl.arange(0, CHUNK)
    count = tl.zeros([], tl.int32)  # (a tensor from the start: it is carried by the loop)
    for chunk_start in range(0, limit, CHUNK):
        pos = chunk_start + offs
        keep = tl.zeros([CHUNK], tl.int1)
        for j in range(0, heads_per_list):
            head = ((first_head + j) // mask_head_div).to(tl.int64)
            kept = tl.load(mask_base + head * stride_mh + pos.to(tl.int64) * stride_mk,
                           mask=pos < limit, other=0)
            keep = keep | (kept != 0)
        keep_i = keep.to(tl.int32)
        slot = count + tl.cumsum(keep_i, 0) - 1
        tl.store(out_row + slot, pos, mask=keep)
        count += tl.sum(keep_i, 0)
    tl.store(KEPT_COUNT + b * stride_cb + hk * stride_ch, count)
