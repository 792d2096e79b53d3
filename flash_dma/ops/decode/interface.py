"""Decoding with a KV cache: argument checks and the public function.

flash_dma_with_kvcache follows FlashAttention's flash_attn_with_kvcache: optional new tokens
are written into the cache in place (append.py), then the queries attend over each row's
cached plus new tokens with the split-over-keys kernel (decode_forward.py) and, when the keys
were split, the merge (combine.py). A key-wise mask is compacted to its kept keys first
(compact.py) so that only those are read. The kernels run on the device's current stream with
no host synchronisation (unless check_inputs), so a call can be captured in a CUDA graph.

Values that live on the device (cache_seqlens, cache_batch_idx, block_table) are not read back
on the hot path. The kernels clamp every address computed from them into the tensors instead:
a row whose length or cache row is out of range gets NaN output and lse and no write, a page id
outside the pool is read as some page of the pool and never written. check_inputs=True reads
them back (a host synchronisation) and raises ValueError before anything is written.
"""
from __future__ import annotations

import math

import torch

from ...runtime.config import head_dim_block
from ...runtime.hardware import device_guard
from ...runtime.launch import launch
from ...runtime.validation import check_head_dim, check_same_device, check_tensor, last_dim_contiguous
from ..dynamic_mask_attention.checks import softmax_scale_or_default, validate_pair
from ..dynamic_mask_attention.triton.host import pair_strides
from .plan import plan_decode
from .triton.append import append_kv_kernel
from .triton.combine import decode_combine_kernel
from .triton.compact import compact_kept_keys_kernel
from .triton.decode_forward import decode_split_kernel

_INPUT_DTYPES = (torch.float16, torch.bfloat16)
MAX_QUERIES = 16  # query rows per call: one token, or a speculative-decoding draft
_COMPACT_CHUNK = 1024


def _check_cache(q, k_cache, v_cache, paged: bool):
    layout = "[num_blocks, page_size, Hk, D]" if paged else "[B_cache, S_max, Hk, D]"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dims=4, dtypes=_INPUT_DTYPES)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: its last dim must be contiguous (the cache is written in "
                             f"place, so it cannot be copied), got strides {t.stride()}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)} {layout}, "
                         f"got {tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache: expected head dim {q.shape[3]} like q {layout}, "
                         f"got shape {tuple(k_cache.shape)}")
    heads, kv_heads = q.shape[2], k_cache.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k_cache: its {kv_heads} heads must divide q's {heads} heads (GQA/MQA)")


def _check_new_tokens(q, k, v, k_cache, cache_seqlens):
    if (k is None) != (v is None):
        raise ValueError("k, v: give both new keys and new values, or neither")
    if k is None:
        return 0
    batch = q.shape[0]
    want = (batch, None, k_cache.shape[2], k_cache.shape[3])
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, dims=4, dtypes=_INPUT_DTYPES)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if any(w is not None and w != s for w, s in zip(want, t.shape)):
            raise ValueError(f"{name}: expected shape [{batch}, Sq_new, {want[2]}, {want[3]}] "
                             f"(batch, new tokens, kv heads, head dim), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required with new tokens k, v (where to write them)")
    return k.shape[1]


def _check_index(name: str, t, dims: int, batch: int, what: str):
    """An int32 index tensor of `dims` dims whose first is the batch (and others non-empty)."""
    check_tensor(name, t, dims=dims, dtypes=(torch.int32,))
    if t.shape[0] != batch or 0 in t.shape[1:]:
        raise ValueError(f"{name}: expected shape {what}, got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: its last dim must be contiguous, got strides {t.stride()}")


def _check_values(batch, lengths, new_tokens, capacity, cache_batch_idx, cache_batch,
                  block_table, num_pages, page_size):
    """check_inputs=True: the device-side values, read back (one synchronisation)."""
    cached = lengths.tolist()
    for b, n in enumerate(cached):
        if n < 0 or n + new_tokens > capacity:
            raise ValueError(f"cache_seqlens: row {b} holds {n} tokens; with {new_tokens} new "
                             f"ones it must lie in [0, {capacity - new_tokens}] (capacity {capacity})")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.tolist()
        bad = [r for r in rows if not 0 <= r < cache_batch]
        if bad:
            raise ValueError(f"cache_batch_idx: entries must lie in [0, {cache_batch}) (k_cache's "
                             f"batch), got {bad[:4]}")
        if new_tokens and len(set(rows)) != len(rows):
            raise ValueError("cache_batch_idx: rows must be distinct when new tokens are written")
    if block_table is not None:
        table = block_table.tolist()
        for b in range(batch):
            used = math.ceil((cached[b] + new_tokens) / page_size)
            bad = [p for p in table[b][:used] if not 0 <= p < num_pages]
            if bad:
                raise ValueError(f"block_table: row {b} points past the pool of {num_pages} pages "
                                 f"(k_cache's dim 0): {bad[:4]}")


def _lengths(cache_seqlens, batch: int, capacity: int, new_tokens: int, device) -> torch.Tensor:
    """cache_seqlens as an int32 [B] device tensor (checked here when it is a host int)."""
    if cache_seqlens is None:
        # (a fill, not a copy from the host: it can be captured in a CUDA graph)
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens: expected an int32 tensor [B] or a Python int, got "
                        f"{type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= capacity - new_tokens:
            raise ValueError(f"cache_seqlens: {cache_seqlens} cached tokens plus {new_tokens} new "
                             f"ones do not fit the cache's capacity {capacity}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    check_tensor("cache_seqlens", cache_seqlens, dims=1, dtypes=(torch.int32,))
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens: expected shape [{batch}] (one length per batch row), "
                         f"got {tuple(cache_seqlens.shape)}")
    return cache_seqlens.contiguous()  # (the kernels read entry b at offset b)


def _keywise_gather(mask) -> bool:
    """Whether the mask is key-wise, served by gathering its kept keys: one list per (batch row,
    kv head), the union of the group's sets where the mask has one per query head."""
    return mask is not None and mask.shape[2] == 1 and mask.shape[3] > 1


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (no custom op for decoding yet)
@torch.no_grad()
def flash_dma_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, attn_mask=None, attn_bias=None,
                           is_causal=True, softmax_scale=None, num_splits=None, return_lse=False,
                           check_inputs=False):
    """Attention of a few new queries over a KV cache (decoding), FlashAttention's
    flash_attn_with_kvcache with dynamic-mask-attention's mask and bias. Inference only: no
    gradient.

    q: [B, Sq, H, D], Sq 1..16 (speculative decoding), fp16/bf16, D a multiple of 8 up to 256.
    k_cache, v_cache: [B_cache, S_max, Hk, D], or paged [num_blocks, page_size, Hk, D] with
    block_table [B, max_blocks] int32 (page_size a power of two >= 16; capacity max_blocks *
    page_size). k, v: optional new tokens [B, Sq_new, Hk, D], written into the cache in place at
    positions cache_seqlens .. cache_seqlens + Sq_new - 1 before attending. cache_seqlens: int32
    [B] tensor or Python int, the tokens already cached (None: the whole capacity, without new
    tokens). cache_batch_idx: int32 [B], the cache row of each batch row (contiguous caches
    only; distinct rows when appending). The queries attend over cache_seqlens + Sq_new keys;
    is_causal (bottom-right) lets query i see keys up to that length - Sq + i. attn_mask (bool,
    True = keep) and attn_bias broadcast to [B, H, Sq, S_max] (each dim 1 or full, heads 1, Hk
    or H), indexed by key position in the sequence; a key-wise mask [B|1, Hk|H|1, 1, S_max] is
    served by reading only its kept keys (with H sets, the union of a group's). num_splits: how many programs share a row's keys
    (None or 0: chosen from the SM count, batch, heads and capacity). Returns out
    [B, Sq, H, D] and, with return_lse, lse [B, H, Sq] (fp32; +inf for a row that sees no key).
    check_inputs=True reads back cache_seqlens, cache_batch_idx and block_table and raises on
    values out of range; without it such rows give NaN (see the module doc).
    """
    check_tensor("q", q, dims=4, dtypes=_INPUT_DTYPES)
    batch, seqlen_q, heads, head_dim = q.shape
    if not 1 <= seqlen_q <= MAX_QUERIES:
        raise ValueError(f"q: expected 1 to {MAX_QUERIES} query rows (dim 1), got {seqlen_q}")
    check_head_dim("q", head_dim)
    paged = block_table is not None
    _check_cache(q, k_cache, v_cache, paged)
    kv_heads = k_cache.shape[2]
    new_tokens = _check_new_tokens(q, k, v, k_cache, cache_seqlens)
    seqlens_tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    device = check_same_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v,
                                "cache_seqlens": seqlens_tensor, "cache_batch_idx": cache_batch_idx,
                                "block_table": block_table, "attn_mask": attn_mask,
                                "attn_bias": attn_bias})
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported with block_table (the table already "
                             "says where each row's pages are)")
        _check_index("block_table", block_table, 2, batch, f"[{batch}, max_blocks]")
        page_size = k_cache.shape[1]
        if page_size < 16 or page_size & (page_size - 1):
            raise ValueError(f"k_cache: paged caches need a page size (dim 1) that is a power of "
                             f"two >= 16, got {page_size}")
        capacity = block_table.shape[1] * page_size
        cache_batch, num_pages, page_shift = batch, k_cache.shape[0], page_size.bit_length() - 1
    else:
        capacity, cache_batch = k_cache.shape[1], k_cache.shape[0]
        num_pages, page_shift, page_size = 1, 0, capacity
        if cache_batch_idx is not None:
            _check_index("cache_batch_idx", cache_batch_idx, 1, batch,
                         f"[{batch}] (one cache row per batch row)")
        elif cache_batch != batch:
            raise ValueError(f"k_cache: expected batch {batch} like q (or give cache_batch_idx), "
                             f"got shape {tuple(k_cache.shape)}")
    if new_tokens > capacity:
        raise ValueError(f"k: {new_tokens} new tokens do not fit the cache's capacity {capacity}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 0):
        raise TypeError(f"num_splits: expected None or a non-negative int, got {num_splits!r}")
    words = ("Sq", "S_max, the cache's capacity")
    mask = validate_pair("attn_mask", attn_mask, batch, heads, kv_heads, seqlen_q, capacity,
                          (torch.bool,), device, words)
    bias = validate_pair("attn_bias", attn_bias, batch, heads, kv_heads, seqlen_q, capacity,
                          (q.dtype, torch.float32), device, words)
    scale = softmax_scale_or_default(softmax_scale, head_dim)
    lengths = _lengths(cache_seqlens, batch, capacity, new_tokens, device)
    if check_inputs:
        _check_values(batch, lengths, new_tokens, capacity, cache_batch_idx, cache_batch,
                      block_table, num_pages, page_size)
    q = last_dim_contiguous(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=device)
    if batch == 0:
        return (out, lse) if return_lse else out
    with device_guard(device):
        if new_tokens:
            _append(k, v, k_cache, v_cache, lengths, cache_batch_idx, block_table, new_tokens,
                    capacity, cache_batch, num_pages, page_shift)
        _decode(q, k_cache, v_cache, out, lse, lengths, cache_batch_idx, block_table, mask, bias,
                bool(is_causal), scale, num_splits, new_tokens, capacity, cache_batch, num_pages,
                page_shift)
    return (out, lse) if return_lse else out


def _append(k, v, k_cache, v_cache, lengths, cache_batch_idx, block_table, new_tokens, capacity,
            cache_batch, num_pages, page_shift):
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    batch, _, kv_heads, head_dim = k.shape
    dummy = lengths
    launch(append_kv_kernel, (batch, new_tokens),
           k, v, k_cache, v_cache, lengths, _or(cache_batch_idx, dummy), _or(block_table, dummy),
           new_tokens, capacity, cache_batch, num_pages, page_shift, kv_heads,
           *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
           block_table.stride(0) if block_table is not None else 0,
           HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
           BLOCK_H=1 << (kv_heads - 1).bit_length(), PAGED=block_table is not None,
           HAS_BATCH_IDX=cache_batch_idx is not None, num_warps=4 if head_dim * kv_heads >= 1024 else 1)


def _or(t, dummy):
    return t if t is not None else dummy


def _decode(q, k_cache, v_cache, out, lse, lengths, cache_batch_idx, block_table, mask, bias,
            is_causal, scale, num_splits, new_tokens, capacity, cache_batch, num_pages, page_shift):
    batch, seqlen_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    device = q.device
    dummy = lse
    gather = _keywise_gather(mask)
    # a key-wise mask with one set per query head (H > Hk): the program's list is its group's
    # union, and every row applies its own set on the gathered keys
    mask_per_head = gather and mask.shape[1] == heads and heads != kv_heads
    if gather:
        kept_count = torch.empty((batch, kv_heads), dtype=torch.int32, device=device)
        kept_index = torch.empty((batch, kv_heads, capacity), dtype=torch.int32, device=device)
        m_strides = pair_strides(mask)
        launch(compact_kept_keys_kernel, (batch * kv_heads,),
               mask.view(torch.uint8), kept_count, kept_index, lengths, _or(cache_batch_idx, lengths),
               kv_heads, group, group if mask_per_head else 1, heads // mask.shape[1],
               new_tokens, capacity, cache_batch, capacity,
               m_strides[0], m_strides[1], m_strides[3], *kept_count.stride(), *kept_index.stride()[:2],
               CHUNK=_COMPACT_CHUNK if device.type == "cuda" else 64,
               HAS_BATCH_IDX=cache_batch_idx is not None, num_warps=4 if device.type == "cuda" else 1)
        walk_count, walk_index = kept_count, kept_index
        count_strides, index_strides = kept_count.stride(), kept_index.stride()[:2]
    else:
        walk_count = walk_index = dummy
        count_strides = index_strides = (0, 0)
    plan = plan_decode(device, batch=batch, kv_heads=kv_heads, packed_rows=group * seqlen_q,
                       max_keys=capacity, head_dim=head_dim, num_splits=num_splits,
                       walk="gathered" if gather else ("paged" if block_table is not None else "contiguous"))
    split = plan.num_splits > 1
    if split:
        o_part = torch.empty((plan.num_splits, batch, heads, seqlen_q, head_dim),
                             dtype=torch.float32, device=device)
        lse_part = torch.empty((plan.num_splits, batch, heads, seqlen_q), dtype=torch.float32,
                               device=device)
    else:
        o_part = lse_part = dummy
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    m_strides = pair_strides(mask)
    b_strides = pair_strides(bias)
    launch(decode_split_kernel, (plan.num_splits, batch * kv_heads, plan.row_blocks),
           q, k_cache, v_cache, out, lse, o_part, lse_part,
           lengths, _or(cache_batch_idx, lengths), _or(block_table, lengths),
           _or(mask_u8, dummy), _or(bias, dummy), walk_count, walk_index,
           scale, seqlen_q, new_tokens, capacity, cache_batch, num_pages, page_shift,
           kv_heads, group, plan.num_splits,
           *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
           *lse.stride()[:2],
           block_table.stride(0) if block_table is not None else 0,
           *m_strides, heads // mask.shape[1] if mask is not None else 1,
           *b_strides, heads // bias.shape[1] if bias is not None else 1,
           *count_strides, *index_strides,
           HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), BLOCK_M=plan.block_m,
           BLOCK_N=plan.block_n, IS_CAUSAL=is_causal, PAGED=block_table is not None,
           HAS_BATCH_IDX=cache_batch_idx is not None, HAS_MASK=mask is not None,
           HAS_BIAS=bias is not None, GATHER=gather, SPLIT=split, MASK_PER_HEAD=mask_per_head,
           num_warps=plan.num_warps, num_stages=plan.num_stages)
    if split:
        launch(decode_combine_kernel, (batch * heads * seqlen_q,),
               o_part, lse_part, out, lse, lengths, _or(cache_batch_idx, lengths),
               heads, seqlen_q, plan.num_splits, new_tokens, capacity, cache_batch,
               *out.stride()[:3], *lse.stride()[:2],
               HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim),
               BLOCK_S=max(2, 1 << (plan.num_splits - 1).bit_length()),
               HAS_BATCH_IDX=cache_batch_idx is not None,
               num_warps=4 if device.type == "cuda" else 1)
