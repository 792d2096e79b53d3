"""Plain PyTorch reference of decoding with a KV cache, written from the spec (float64).

It does what flash_dma_with_kvcache promises, one batch row at a time: the row's cache is read
(through the block table when paged, at cache_batch_idx's row otherwise), the new tokens are
written at cache_seqlens, and the queries attend over the row's valid prefix (cached plus new
tokens) with the mask, bias and bottom-right causal rule of the dynamic-mask-attention spec,
the mask and bias being indexed by key position in the sequence. Works on copies: returns the
caches as they should be after the call. For tests only.
"""
from __future__ import annotations

import torch

from ..dynamic_mask_attention.reference import attention_reference


def _row_of(t: torch.Tensor | None, b: int) -> torch.Tensor | None:
    return None if t is None else t[b if t.shape[0] > 1 else 0][None]


def decode_reference(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                     block_table=None, attn_mask=None, attn_bias=None, is_causal=True,
                     softmax_scale=None, dtype=torch.float64):
    """-> (out [B, Sq, H, D] in `dtype`, lse [B, H, Sq], k_cache after, v_cache after)."""
    batch, seqlen_q = q.shape[:2]
    k_after, v_after = k_cache.clone(), v_cache.clone()
    new = 0 if k is None else k.shape[1]
    if block_table is not None:
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]

    def positions(b: int, n: int):
        """(cache tensor index, token index) of the row's first n key positions."""
        pos = torch.arange(n)
        if block_table is not None:
            pages = block_table[b].long().cpu()[pos // page]
            return pages, pos % page
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return torch.full_like(pos, row), pos

    outs, lses = [], []
    for b in range(batch):
        cached = lengths[b]
        if new:
            idx, tok = positions(b, cached + new)
            idx, tok = idx[cached:], tok[cached:]
            k_after[idx.to(k_cache.device), tok.to(k_cache.device)] = k[b]
            v_after[idx.to(k_cache.device), tok.to(k_cache.device)] = v[b]
        seqlen_k = cached + new
        idx, tok = (t.to(k_cache.device) for t in positions(b, seqlen_k))
        keys = k_after[idx, tok][None]  # [1, seqlen_k, Hk, D]
        values = v_after[idx, tok][None]
        mask = _row_of(attn_mask, b)
        bias = _row_of(attn_bias, b)
        mask = None if mask is None else (mask if mask.shape[3] == 1 else mask[..., :seqlen_k])
        bias = None if bias is None else (bias if bias.shape[3] == 1 else bias[..., :seqlen_k])
        out, lse = attention_reference(q[b:b + 1], keys, values, mask, bias, is_causal,
                                       softmax_scale, dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_after, v_after
