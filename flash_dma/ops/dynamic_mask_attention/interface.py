"""Public functions of dynamic mask attention.

flash_dma_func        q [B, Sq, H, D], k/v [B, Sk, Hk, D]
flash_dma_varlen_func q [total_q, H, D], k/v [total_k, Hk, D], int32 or int64 cu_seqlens
topk_mask_from_bias   a keep-mask of the largest bias entries (sparsity.py)

Both attention functions check their inputs (checks.py) and lower to one AttentionProblem; the
autograd Function (autograd.py) plans each pass (plan.py) and runs the plan's backend (triton/).
"""
from __future__ import annotations

import torch

from ...runtime.hardware import device_guard
from ...runtime.validation import check_cu_seqlens, check_same_device, cu_seqlens_values, \
    last_dim_contiguous
from .autograd import DynamicMaskAttentionFunction
from .checks import check_max_seqlens, check_qkv, deterministic_requested, \
    softmax_scale_or_default, validate_pair
from .plan import AttentionProblem
from .sparsity import topk_mask_from_bias

__all__ = ["flash_dma_func", "flash_dma_varlen_func", "topk_mask_from_bias"]


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def flash_dma_func(q, k, v, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None,
                   return_lse=False, deterministic=False):
    """Dynamic mask attention: softmax(scale q k^T + attn_bias, hidden where attn_mask is False) v.

    q: [B, Sq, H, D]; k, v: [B, Sk, Hk, D] with H % Hk == 0; fp16 or bf16; D a multiple of 8
    up to 256. attn_mask (bool, True = keep) and attn_bias (q's dtype or fp32) broadcast to
    [B, H, Sq, Sk]: each dim 1 or full, the head dim 1, Hk or H. is_causal hides key j from
    query i when j > i + Sk - Sq. Returns out [B, Sq, H, D], and lse [B, H, Sq] (fp32, natural
    log, +inf for rows that see no key) with return_lse. Gradients reach q, k, v and attn_bias
    (in attn_bias's own shape). By default dq is summed over key tiles with fp32 atomics (and so
    is dbias over broadcast dims): bitwise run-to-run repeatability is not guaranteed.
    deterministic=True (or torch.use_deterministic_algorithms(True)) fixes every reduction order:
    dq from a separate kernel, dbias from one fp32 partial per contributor summed in order.
    """
    check_qkv(q, k, v, varlen=False)
    device = check_same_device({"q": q, "k": k, "v": v, "attn_mask": attn_mask, "attn_bias": attn_bias})
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    words = ("Sq", "Sk")
    mask = validate_pair("attn_mask", attn_mask, batch, heads, kv_heads, seqlen_q, seqlen_k,
                          (torch.bool,), device, words)
    bias = validate_pair("attn_bias", attn_bias, batch, heads, kv_heads, seqlen_q, seqlen_k,
                          (q.dtype, torch.float32), device, words)
    pb = AttentionProblem(batch, heads, kv_heads, head_dim, seqlen_q, seqlen_k, False, bool(is_causal),
                  softmax_scale_or_default(softmax_scale, head_dim), None, None)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    with device_guard(device):
        out, lse = DynamicMaskAttentionFunction.apply(q, k, v, mask, bias, pb,
                                                      deterministic_requested(deterministic))
    return (out, lse) if return_lse else out


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def flash_dma_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None,
                          return_lse=False, deterministic=False):
    """Dynamic mask attention over packed sequences.

    q: [total_q, H, D]; k, v: [total_k, Hk, D]; cu_seqlens_q/k: int32 or int64 [N + 1] offsets
    starting at 0, never decreasing, the last at most total_q/total_k; max_seqlen_q/k: host ints,
    at least the longest sequence. The offsets are checked on the host once per tensor (one
    synchronisation the first time a cu_seqlens tensor is seen), so bad values raise a ValueError
    naming the argument instead of reaching a kernel.
    attn_mask/attn_bias are padded per sequence: ({1|N}, {1|Hk|H}, {1|max_seqlen_q},
    {1|max_seqlen_k}), indexed by (sequence, head, position in the sequence). Sequences of
    length 0 are fine. Returns out [total_q, H, D], and lse [H, total_q] with return_lse.
    """
    check_qkv(q, k, v, varlen=True)
    device = check_same_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                "cu_seqlens_k": cu_seqlens_k, "attn_mask": attn_mask,
                                "attn_bias": attn_bias})
    n_seq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, n_seq)
    check_max_seqlens(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    cu_seqlens_q = cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    cu_seqlens_k = cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    _, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    words = ("max_seqlen_q", "max_seqlen_k")
    mask = validate_pair("attn_mask", attn_mask, n_seq, heads, kv_heads, max_seqlen_q,
                          max_seqlen_k, (torch.bool,), device, words)
    bias = validate_pair("attn_bias", attn_bias, n_seq, heads, kv_heads, max_seqlen_q,
                          max_seqlen_k, (q.dtype, torch.float32), device, words)
    pb = AttentionProblem(n_seq, heads, kv_heads, head_dim, max_seqlen_q, max_seqlen_k, True,
                  bool(is_causal), softmax_scale_or_default(softmax_scale, head_dim), cu_seqlens_q, cu_seqlens_k)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    with device_guard(device):
        out, lse = DynamicMaskAttentionFunction.apply(q, k, v, mask, bias, pb,
                                                      deterministic_requested(deterministic))
    return (out, lse) if return_lse else out
