"""The CuTe backend's launchers, in the shape the attention autograd dispatches to
(forward(plan, ...), backward(plan, ...)), like the Triton backend's: plain attention through
plain.py, a mask and/or bias through masked.py (fixed lengths; plan.py sends nothing else)."""
from __future__ import annotations

from ....runtime.rows import zero_rows_past
from . import masked, plain


def _varlen_args(pb) -> dict:
    if not pb.is_varlen:
        return {}
    return {"cu_seqlens_q": pb.cu_q, "cu_seqlens_k": pb.cu_k,
            "max_seqlen_q": pb.seqlen_q, "max_seqlen_k": pb.seqlen_k}


def _zero_rows_outside(cu, *tensors):
    """Varlen rows past the last offset belong to no sequence and no kernel writes them: 0, as
    the Triton backend gives."""
    zero_rows_past(cu, 0, *tensors)


def forward(plan, q, k, v, mask, bias):
    pb = plan.problem
    if mask is not None or bias is not None:
        return masked.forward(q, k, v, mask, bias, causal=pb.is_causal,
                              softmax_scale=pb.softmax_scale, path=plan.bias_path)
    out, lse = plain.forward(q, k, v, causal=pb.is_causal, softmax_scale=pb.softmax_scale,
                             **_varlen_args(pb))
    if pb.is_varlen:
        _zero_rows_outside(pb.cu_q, out)
    return out, lse


def backward(plan, q, k, v, out, lse, dout, mask, bias):
    pb = plan.problem
    if mask is not None or bias is not None:
        return masked.backward(dout, q, k, v, out, lse, mask, bias, causal=pb.is_causal,
                               softmax_scale=pb.softmax_scale, dbias_mode=plan.dbias_reduce,
                               deterministic=plan.deterministic, path=plan.bias_path)
    dq, dk, dv = plain.backward(dout, q, k, v, out, lse, causal=pb.is_causal,
                                softmax_scale=pb.softmax_scale, deterministic=plan.deterministic,
                                **_varlen_args(pb))
    if pb.is_varlen:
        _zero_rows_outside(pb.cu_q, dq)
        _zero_rows_outside(pb.cu_k, dk, dv)
    return dq, dk, dv, None
