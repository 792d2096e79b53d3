"""Dynamic mask attention as torch.library custom ops, for torch.compile.

flash_dma::attention_fwd  (q, k, v, mask?, bias?, cu_seqlens_q?, cu_seqlens_k?, ...) -> (out, lse)
flash_dma::attention_bwd  (dout, q, k, v, out, lse, ...) -> (dq, dk, dv, dbias)

Both serve the padded and the packed layout (varlen). A plan is a Python object and cannot cross
an op's boundary, so the backward re-plans from the saved tensors and the scalar arguments: the
same checks (checks.lower_call) and the same plan functions as the eager autograd Function
(autograd.py), whose passes (run_forward, run_backward) run here too. The fake implementations
give the outputs' shapes, dtypes and strides for tracing with symbolic sizes. The public
functions call these ops only while torch.compile traces them (interface.py): eagerly the
autograd Function runs, which keeps its plan from the forward for the backward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...runtime.custom_ops import absent, present
from ...runtime.hardware import device_guard
from .autograd import run_backward, run_forward
from .checks import lower_call
from .plan import plan_forward


@torch.library.custom_op("flash_dma::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, attn_bias: Tensor | None,
                  cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int,
                  max_seqlen_k: int, is_causal: bool, softmax_scale: float | None, varlen: bool,
                  deterministic: bool) -> tuple[Tensor, Tensor]:
    """deterministic: for the backward only (it travels with the forward's arguments)."""
    problem, q, k, v, mask, bias, device = lower_call(
        q, k, v, attn_mask, attn_bias, is_causal, softmax_scale, varlen, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k)
    with device_guard(device):
        out, lse, _ = run_forward(problem, q, k, v, mask, bias)
    # contiguous, as the fake implementation says, whichever backend ran (no copy where it already is)
    return out.contiguous(), lse.contiguous()


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, is_causal, softmax_scale, varlen, deterministic):
    out = q.new_empty(q.shape)
    if varlen:  # q [total_q, H, D] -> lse [H, total_q]
        lse_shape = (q.shape[1], q.shape[0])
    else:  # q [B, Sq, H, D] -> lse [B, H, Sq]
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flash_dma::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  attn_mask: Tensor | None, attn_bias: Tensor | None, cu_seqlens_q: Tensor | None,
                  cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                  softmax_scale: float | None, varlen: bool, deterministic: bool,
                  want_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dbias), contiguous; dbias is an empty placeholder unless want_dbias."""
    problem, q, k, v, mask, bias, device = lower_call(
        q, k, v, attn_mask, attn_bias, is_causal, softmax_scale, varlen, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k)
    with device_guard(device):
        forward_plan = plan_forward(problem, q, mask, bias)
    want_dbias = want_dbias and bias is not None
    dq, dk, dv, dbias = run_backward(forward_plan, q, k, v, out, lse, dout, mask, bias, want_dbias,
                                     deterministic)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), \
        dbias.contiguous() if want_dbias else absent(q)


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, is_causal, softmax_scale, varlen, deterministic,
                        want_dbias):
    dbias = attn_bias.new_empty(attn_bias.shape) if want_dbias and attn_bias is not None else absent(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, is_causal, scale, varlen, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, cu_q, cu_k)
    ctx.arguments = (max_q, max_k, is_causal, scale, varlen, deterministic)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    if dout is None:  # no gradient reached out (lse never carries one): every gradient is zero
        return (None,) * 13
    q, k, v, out, lse, mask, bias, cu_q, cu_k = ctx.saved_tensors
    want_dbias = bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = attention_bwd(dout, q, k, v, out, lse, mask, bias, cu_q, cu_k, *ctx.arguments,
                                      want_dbias)
    return (dq, dk, dv, None, present(dbias, want_dbias)) + (None,) * 8


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
