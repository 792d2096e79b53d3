"""Chunked gated delta rule (Gated DeltaNet, Kimi Delta Attention): Triton kernels, autograd,
and the public state-gradient pass."""
from .interface import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd_dhu"]
