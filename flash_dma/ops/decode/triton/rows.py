"""Per-batch-row facts that every decode kernel derives the same way from the call's arguments."""
import triton
import triton.language as tl


@triton.jit
def cache_row_and_length(CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity, cache_batch,
                         HAS_BATCH_IDX: tl.constexpr):
    """(cache row, tokens already cached, row is valid) for batch row b.

    A row is invalid when its cached length is negative, leaves no room for the new tokens
    (cached + new_tokens > capacity) or its cache row lies outside the cache. The kernels then
    neither read nor write the cache for it (its output is NaN); the cache row and length they
    return are clamped in range so that no address computed from them leaves the tensors.
    """
    cached = tl.load(CACHE_SEQLENS + b)
    if HAS_BATCH_IDX:
        row = tl.load(CACHE_BATCH_IDX + b)
    else:
        row = b
    ok = (cached >= 0) & (cached <= capacity - new_tokens) & (row >= 0) & (row < cache_batch)
    row = tl.where(ok, row, 0)
    cached = tl.where(ok, cached, 0)
    return row.to(tl.int64), cached, ok


@triton.jit
def cache_token_offsets(pos, row64, BLOCK_TABLE, stride_tb, num_pages, page_shift,
                        stride_cb, stride_cs, PAGED: tl.constexpr):
    """Element offsets (int64) of logical key positions `pos` of one sequence inside a cache
    tensor, before the head and head-dim offsets. Contiguous: row * batch stride + pos * token
    stride. Paged: the page holding pos comes from the sequence's block-table row (page ids are
    clamped into the pool, so a bad table entry reads some page, never outside the pool), then
    page * page stride + (pos mod page size) * token stride. Positions are translated one by one,
    so a tile may straddle pages of any size."""
    if PAGED:
        page = tl.load(BLOCK_TABLE + row64 * stride_tb + (pos >> page_shift))
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        in_page = pos & ((1 << page_shift) - 1)
        return page * stride_cb + in_page.to(tl.int64) * stride_cs
    else:
        return row64 * stride_cb + pos.to(tl.int64) * stride_cs
