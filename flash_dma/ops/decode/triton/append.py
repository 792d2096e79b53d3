"""Writing the new tokens' keys and values into the cache, in place, before the decode kernel reads it.

A launch of its own: inside the decode kernel the splits of one row would race (one split
reading a slot another has not written yet). Grid (B, Sq_new): a program copies one token's
keys and values for every kv head to cache position cache_seqlens[b] + t (through the block
table when paged). Rows that rows.cache_row_and_length finds invalid, and tokens whose page id
lies outside the pool, are not written.
"""
import triton
import triton.language as tl

from .rows import cache_row_and_length


@triton.jit(do_not_specialize=["new_tokens", "capacity", "cache_batch", "num_pages"])
def append_kv_kernel(
    K_NEW, V_NEW, K_CACHE, V_CACHE, CACHE_SEQLENS, CACHE_BATCH_IDX, BLOCK_TABLE,
    new_tokens, capacity, cache_batch, num_pages, page_shift, num_kv_heads,
    stride_knb, stride_kns, stride_knh,
    stride_vnb, stride_vns, stride_vnh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    row, cached, ok = cache_row_and_length(CACHE_SEQLENS, CACHE_BATCH_IDX, b, new_tokens, capacity,
                                           cache_batch, HAS_BATCH_IDX)
    pos = cached + t
    if PAGED:
        page = tl.load(BLOCK_TABLE + row * stride_tb + (pos >> page_shift))
        ok = ok & (page >= 0) & (page < num_pages)
        page = tl.where(ok, page, 0).to(tl.int64)
        k_dst = page * stride_kb + (pos & ((1 << page_shift) - 1)).to(tl.int64) * stride_ks
        v_dst = page * stride_vb + (pos & ((1 << page_shift) - 1)).to(tl.int64) * stride_vs
    else:
        k_dst = row * stride_kb + pos.to(tl.int64) * stride_ks
        v_dst = row * stride_vb + pos.to(tl.int64) * stride_vs
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    tile_ok = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & ok
    heads64 = heads.to(tl.int64)[:, None]
    k = tl.load(K_NEW + b * stride_knb + t * stride_kns + heads64 * stride_knh + offs_d[None, :],
                mask=tile_ok)
    v = tl.load(V_NEW + b * stride_vnb + t * stride_vns + heads64 * stride_vnh + offs_d[None, :],
                mask=tile_ok)
    tl.store(K_CACHE + k_dst + heads64 * stride_kh + offs_d[None, :], k, mask=tile_ok)
    tl.store(V_CACHE + v_dst + heads64 * stride_vh + offs_d[None, :], v, mask=tile_ok)
