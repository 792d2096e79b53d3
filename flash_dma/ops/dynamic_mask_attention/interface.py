"""Public functions of dynamic mask attention.

flash_dma_func        q [B, Sq, H, D], k/v [B, Sk, Hk, D]
flash_dma_varlen_func q [total_q, H, D], k/v [total_k, Hk, D], int32 or int64 cu_seqlens
topk_mask_from_bias   a keep-mask of the largest bias entries (sparsity.py)

Both attention functions check their inputs and lower to one AttentionProblem (checks.py); the
autograd Function (autograd.py) plans each pass (plan.py) and runs the plan's backend (triton/).
Traced by torch.compile they call the custom ops of custom_op.py instead, which do the same
inside one graph node each (fullgraph=True and dynamic shapes work).
"""
from __future__ import annotations

from ...runtime.custom_ops import use_custom_ops
from ...runtime.hardware import device_guard
from . import compaction
from .autograd import DynamicMaskAttentionFunction
from .checks import deterministic_requested, lower_call
from .custom_op import attention_fwd
from .sparsity import topk_mask_from_bias

__all__ = ["flash_dma_func", "flash_dma_varlen_func", "topk_mask_from_bias"]


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
    deterministic = deterministic_requested(deterministic)
    if use_custom_ops():  # traced by torch.compile: one custom op node (custom_op.py)
        out, lse = attention_fwd(q, k, v, attn_mask, attn_bias, None, None, 0, 0, bool(is_causal),
                                 softmax_scale, False, deterministic)
    else:
        lowered = lower_call(q, k, v, attn_mask, attn_bias, is_causal, softmax_scale, varlen=False)
        kept = compaction.plan(q, k, attn_mask, attn_bias, is_causal, deterministic)
        if kept is not None:  # a top-k key-wise mask: dense attention over the kept keys
            k_kept, v_kept, bias_kept = compaction.compact(q, k, v, attn_bias, kept)
            lowered = lower_call(q, k_kept, v_kept, None, bias_kept, is_causal, softmax_scale, varlen=False)
        problem, q, k, v, mask, bias, device = lowered
        with device_guard(device):
            out, lse = DynamicMaskAttentionFunction.apply(q, k, v, mask, bias, problem, deterministic)
    return (out, lse) if return_lse else out


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
    deterministic = deterministic_requested(deterministic)
    if use_custom_ops():  # traced by torch.compile: one custom op node (custom_op.py)
        out, lse = attention_fwd(q, k, v, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, bool(is_causal), softmax_scale, True, deterministic)
    else:
        problem, q, k, v, mask, bias, device = lower_call(
            q, k, v, attn_mask, attn_bias, is_causal, softmax_scale, True, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k)
        with device_guard(device):
            out, lse = DynamicMaskAttentionFunction.apply(q, k, v, mask, bias, problem, deterministic)
    return (out, lse) if return_lse else out
