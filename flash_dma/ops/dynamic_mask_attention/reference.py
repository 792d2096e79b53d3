"""Plain PyTorch reference of dynamic mask attention, written from the spec (float64 by default).

Differentiable, so tests take reference gradients with torch.autograd. Slow and quadratic in
memory: for tests only.
"""
from __future__ import annotations

import math

import torch


def heads_to(t: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """Expand a head axis of size Hk (1 < Hk < H) to H: query head h reads head h // (H // Hk)."""
    size = t.shape[dim]
    if size in (1, num_heads):
        return t
    return t.repeat_interleave(num_heads // size, dim=dim)


def attention_reference(q, k, v, attn_mask=None, attn_bias=None, is_causal=False,
                        softmax_scale=None, dtype=torch.float64):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] -> (out [B, Sq, H, D] in `dtype`, lse [B, H, Sq])."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    qh = q.to(dtype).transpose(1, 2)
    kh = heads_to(k.to(dtype).transpose(1, 2), heads, 1)
    vh = heads_to(v.to(dtype).transpose(1, 2), heads, 1)
    scores = scale * qh @ kh.transpose(-1, -2)
    if attn_bias is not None:
        scores = scores + heads_to(attn_bias.to(dtype), heads, 1)
    visible = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        visible = visible & heads_to(attn_mask, heads, 1)
    if is_causal:
        rows = torch.arange(seqlen_q, device=q.device).view(-1, 1)
        cols = torch.arange(seqlen_k, device=q.device).view(1, -1)
        visible = visible & (cols <= rows + (seqlen_k - seqlen_q))
    scores = scores.masked_fill(~visible, float("-inf"))
    has_key = visible.any(-1, keepdim=True)
    # rows with no visible key: softmax of zeros, then zeroed, so neither value nor gradient is NaN
    safe = torch.where(has_key, scores, torch.zeros((), dtype=dtype, device=q.device))
    probs = torch.softmax(safe, dim=-1) * has_key
    out = (probs @ vh).transpose(1, 2)
    lse = torch.where(has_key[..., 0], torch.logsumexp(safe, -1).detach(),
                      torch.full((), float("inf"), dtype=dtype, device=q.device))
    return out, lse


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, attn_mask=None,
                               attn_bias=None, is_causal=False, softmax_scale=None,
                               dtype=torch.float64):
    """Packed layout: one attention_reference per sequence; mask/bias padded per sequence."""
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    heads = q.shape[1]
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        sq, sk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]

        def per_seq(t):
            if t is None:
                return None
            t = t[n if t.shape[0] > 1 else 0][None]
            t = t[:, :, :sq] if t.shape[2] > 1 else t
            return t[..., :sk] if t.shape[3] > 1 else t

        qs = q[cu_q[n]:cu_q[n + 1]][None]
        ks = k[cu_k[n]:cu_k[n + 1]][None]
        vs = v[cu_k[n]:cu_k[n + 1]][None]
        if sq == 0:
            outs.append(qs[0].to(dtype))
            lses.append(torch.empty(heads, 0, dtype=dtype, device=q.device))
            continue
        out, lse = attention_reference(qs, ks, vs, per_seq(attn_mask), per_seq(attn_bias),
                                       is_causal, softmax_scale if softmax_scale is not None
                                       else 1.0 / math.sqrt(q.shape[-1]), dtype)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
