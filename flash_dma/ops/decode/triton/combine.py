"""Merging the per-split partials of the decode kernel (the log-sum-exp merge of flash-decoding).

Each split left, per (batch, head, query) row, its output normalised by its own softmax sum and
that sum's log-sum-exp (-inf for a split that saw no visible key). The merged row is the
lse-weighted mean of the partial outputs; a row no split saw gives 0 and lse +inf.
"""
import triton
import triton.language as tl

from .rows import cache_row_and_length


@triton.jit(do_not_specialize=["new_tokens", "capacity", "cache_batch", "num_splits"])
def decode_combine_kernel(
    O_PART, LSE_PART, OUT, LSE, CACHE_SEQLENS, CACHE_BATCH_IDX,
    num_heads, seqlen_q, num_splits, new_tokens, capacity, cache_batch,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b, h, i) packed as [B, H, Sq]
    rows_total = tl.num_programs(0).to(tl.int64)
    i = row % seqlen_q
    h = (row // seqlen_q) % num_heads
    b = row // (seqlen_q * num_heads)
    _, _, row_valid = cache_row_and_length(CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity,
                                           cache_batch, HAS_BATCH_IDX)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    part_row = splits.to(tl.int64) * rows_total + row
    lse_parts = tl.load(LSE_PART + part_row, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse_parts, 0)
    seen = lse_max != float("-inf")
    weights = tl.math.exp(lse_parts - tl.where(seen, lse_max, 0.0))
    weights = tl.where(split_ok, weights, 0.0)
    total = tl.sum(weights, 0)
    parts = tl.load(O_PART + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=split_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    # an empty split's partial is 0 with weight 0: it adds nothing (and no NaN)
    out = tl.sum(tl.where(weights[:, None] > 0, parts, 0.0) * weights[:, None], 0)
    out = out / tl.where(seen, total, 1.0)
    lse = tl.where(seen, lse_max + tl.math.log(tl.where(seen, total, 1.0)), float("inf"))
    out = tl.where(row_valid, out, float("nan"))
    lse = tl.where(row_valid, lse, float("nan"))
    tl.store(OUT + b * stride_ob + i * stride_os + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(LSE + b * stride_lb + h * stride_lh + i, lse)
