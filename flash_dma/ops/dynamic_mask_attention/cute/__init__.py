"""The CuTe DSL backend of dynamic mask attention (SM90, optional: pip install "flash-dma[hopper]").

Today it serves plain attention (no mask, no bias) through FlashAttention-4's kernels; the rest
runs on Triton. Importing this package imports no part of the CuTe stack: that happens on the
first status check for a Hopper GPU, or the first forward/backward.

Entry points for the attention plan:
- choose_backend(device, has_mask, has_bias, head_dim, dtype, varlen) -> ("cute"|"triton", reason)
- plain.supports(PlainProblem(...)) -> None | reason
- plain.forward(...) -> (out, lse); plain.backward(...) -> (dq, dk, dv)
"""
from .availability import INSTALL_HINT, CuteBackendUnavailable, cute_backend_status
from .select import BACKEND_ENV, choose_backend, requested_backend

__all__ = ["INSTALL_HINT", "CuteBackendUnavailable", "cute_backend_status", "BACKEND_ENV",
           "choose_backend", "requested_backend"]
