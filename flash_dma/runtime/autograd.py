"""Autograd helpers shared by the ops."""
from __future__ import annotations

import torch


class _NoSecondDerivative(torch.autograd.Function):
    """Passes gradients through; differentiating them raises (see first_order_only)."""

    @staticmethod
    def forward(ctx, op_name: str, anchor: torch.Tensor, *grads):
        ctx.op_name = op_name
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"{ctx.op_name}: second derivatives (double backward through its "
                           "gradients) are not supported")


def first_order_only(op_name: str, grads: tuple, inputs: tuple) -> tuple:
    """The kernels' gradients carry no autograd graph. Under create_graph=True they would then
    act as constants in a second derivative and give a silently wrong one; instead they come back
    attached to a node that raises if anything differentiates through them. Without create_graph
    (grad mode is off during the backward) this is a no-op."""
    if not torch.is_grad_enabled():
        return grads
    anchor = next((t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad), None)
    present = [i for i, g in enumerate(grads) if g is not None]
    if anchor is None or not present:
        return grads
    wrapped = _NoSecondDerivative.apply(op_name, anchor, *(grads[i] for i in present))
    out = list(grads)
    for i, g in zip(present, wrapped):
        out[i] = g
    return tuple(out)
