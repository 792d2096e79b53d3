"""The CuTe DSL backend of dynamic mask attention (SM90, optional: pip install "flash-dma[hopper]").

It runs FlashAttention-4's SM90 kernels: plain attention as they are (plain.py), and fixed-length
attention with a keep-mask and/or a bias (with dbias) through our hooks (hooks.py: score_mod,
score_mod_bwd, mask_mod) and our tile lists (block_sparse.py), in masked.py; the forward's bias
is read straight into the score fragment by FA4's SM90 forward class with one method replaced
(forward_bias.py; a bias with full query and key dims as whole tiles loaded by TMA into shared
memory, forward_bias_tma.py), and the backward's bias and dbias likewise (backward_bias.py, which
also sums a per-key bias's dbias over queries; with full query and key dims, both by TMA through
FA4's shared dS tile, backward_bias_tma.py). tma_operands.py says what TMA can load as it lies in
memory (torch only). What it lacks runs on Triton, logged. Importing this package imports no part of the CuTe stack: that happens on the
first status check for a Hopper GPU, or the first forward/backward.

Entry points for the attention plan:
- choose_backend(device, has_mask, has_bias, head_dim, dtype, varlen, requested, key_wise_mask,
  bias_kind) -> ("cute"|"triton", reason); auto_backward_on_triton: where auto keeps a biased
  call's backward on Triton after a CuTe forward
- select.bias_layout(bias): "per_key", "dense" or "dense_tma", what auto's routing reads
- masked.bias_path(head_dim, causal, tma_layout, tma_loadable): the declared bias choices
  resolved, carried by the plan
- plain.forward/backward; masked.forward/backward (masked.backward_gap: when the backward moves
  to Triton)
"""
from .availability import INSTALL_HINT, CuteBackendUnavailable, cute_backend_status
from .select import BACKEND_ENV, choose_backend, requested_backend

__all__ = ["INSTALL_HINT", "CuteBackendUnavailable", "cute_backend_status", "BACKEND_ENV",
           "choose_backend", "requested_backend"]
