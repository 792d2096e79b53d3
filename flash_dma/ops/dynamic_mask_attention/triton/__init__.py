"""The Triton backend of dynamic mask attention: one file per kernel pass, each kernel with its
launcher beside it, the shared tile walks in common.py and the host-side descriptor and stride
helpers in host.py. The plan (../plan.py) chose everything; these functions only launch it."""
from __future__ import annotations

import torch

from ....runtime.validation import last_dim_contiguous
from .backward_dkdv import dkdv
from .backward_dq import dq_by_matmul, dq_from_accumulator, dq_kernel
from .backward_preprocess import preprocess
from .forward import forward


def backward(plan, q, k, v, out, lse, dout, mask, bias):
    """(dq, dk, dv, dbias) for a BackwardPlan; dbias None where the plan has no DbiasPlan."""
    pb = plan.problem
    dout = last_dim_contiguous(dout)
    dq_acc = None
    if plan.dq_strategy.value == "fused":
        # the fp32 accumulator: cleared by the delta pass where its rows are all of q's rows
        # (varlen: q may hold rows outside every sequence, which must read 0)
        alloc = torch.empty if plan.zero_dq_in_delta else torch.zeros
        dq_acc = alloc(q.shape, device=q.device, dtype=torch.float32)
    delta = preprocess(plan, out, dout, lse, dq_acc)
    dk, dv, db_buf = dkdv(plan, q, k, v, dout, lse, delta, mask, bias, dq_acc)
    strategy = plan.dq_strategy.value
    if strategy == "fused":
        dq = dq_from_accumulator(dq_acc, pb.softmax_scale, q.dtype)
    elif strategy == "matmul":
        dq = dq_by_matmul(pb, k, db_buf)
    else:
        dq = dq_kernel(plan, q, k, v, dout, lse, delta, mask, bias)
    dbias = plan.dbias.finish(db_buf, bias) if plan.dbias is not None else None
    return dq, dk, dv, dbias


__all__ = ["forward", "backward"]
