"""The autograd Function of dynamic mask attention: plans each pass (plan.py) and hands the plan
to its backend. run_forward and run_backward are the passes themselves, shared with the custom
ops (custom_op.py)."""
from __future__ import annotations

import torch

from ...runtime.autograd import first_order_only
from ...runtime.hardware import device_guard
from . import triton as triton_backend
from .cute import backend as cute_backend
from .plan import AttentionProblem, plan_backward, plan_forward

# The dispatch point: a plan's backend name -> the module with its forward(plan, ...) and
# backward(plan, ...).
BACKENDS = {"triton": triton_backend, "cute": cute_backend}


def run_forward(problem: AttentionProblem, q, k, v, mask, bias):
    """-> (out, lse, the forward plan)."""
    plan = plan_forward(problem, q, mask, bias)
    out, lse = BACKENDS[plan.backend.value].forward(plan, q, k, v, mask, bias)
    return out, lse, plan


def run_backward(forward_plan, q, k, v, out, lse, dout, mask, bias, want_dbias: bool, deterministic: bool):
    """-> (dq, dk, dv, dbias or None)."""
    with device_guard(q.device):
        plan = plan_backward(forward_plan, q, mask, bias, want_dbias, deterministic)
        return BACKENDS[plan.backend.value].backward(plan, q, k, v, out, lse, dout, mask, bias)


class DynamicMaskAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, problem: AttentionProblem, deterministic: bool):
        out, lse, plan = run_forward(problem, q, k, v, mask, bias)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (a launch per backward)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.plan, ctx.deterministic = plan, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached out (lse never carries one): every gradient is zero
            return None, None, None, None, None, None, None
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias = run_backward(ctx.plan, q, k, v, out, lse, dout, mask, bias, want_dbias,
                                         ctx.deterministic)
        return first_order_only("dynamic mask attention", (dq, dk, dv, None, dbias, None, None),
                                (q, k, v, bias))
