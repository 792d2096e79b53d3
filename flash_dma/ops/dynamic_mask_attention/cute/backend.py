"""The CuTe backend's launchers, in the shape the attention autograd dispatches to
(forward(plan, ...), backward(plan, ...)), like the Triton backend's. Today they run plain
attention through plain.py; plan.py sends nothing else here."""
from __future__ import annotations

from . import plain


def _varlen_args(pb) -> dict:
    if not pb.is_varlen:
        return {}
    return {"cu_seqlens_q": pb.cu_q, "cu_seqlens_k": pb.cu_k,
            "max_seqlen_q": pb.seqlen_q, "max_seqlen_k": pb.seqlen_k}


def forward(plan, q, k, v, mask, bias):
    pb = plan.problem
    return plain.forward(q, k, v, causal=pb.is_causal, softmax_scale=pb.softmax_scale,
                         **_varlen_args(pb))


def backward(plan, q, k, v, out, lse, dout, mask, bias):
    pb = plan.problem
    dq, dk, dv = plain.backward(dout, q, k, v, out, lse, causal=pb.is_causal,
                                softmax_scale=pb.softmax_scale, deterministic=plan.deterministic,
                                **_varlen_args(pb))
    return dq, dk, dv, None
