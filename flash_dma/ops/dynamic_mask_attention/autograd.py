"""The autograd Function of dynamic mask attention: plans each pass (plan.py) and hands the plan
to its backend."""
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


class DynamicMaskAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, problem: AttentionProblem, deterministic: bool):
        plan = plan_forward(problem, q, mask, bias)
        out, lse = BACKENDS[plan.backend.value].forward(plan, q, k, v, mask, bias)
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
        with device_guard(q.device):
            plan = plan_backward(ctx.plan, q, mask, bias, want_dbias, ctx.deterministic)
            dq, dk, dv, dbias = BACKENDS[plan.backend.value].backward(
                plan, q, k, v, out, lse, dout, mask, bias)
        return first_order_only("dynamic mask attention", (dq, dk, dv, None, dbias, None, None),
                                (q, k, v, bias))
