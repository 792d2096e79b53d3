"""The public functions of the chunked gated delta rule: chunk_gated_delta_rule (forward and
backward, autograd.py) and its state-gradient pass chunk_gated_delta_rule_bwd_dhu.

Layout of this package: checks.py (argument checks), layout.py (chunks of equal or packed
sequences), plan.py (one plan per call: strategies and launch choices), launch_table.py (the
launch configurations), autograd.py (the order of the passes), custom_op.py (the same as
torch.library custom ops, called while torch.compile traces these functions), triton/ (one file
per kernel pass with its launcher), reference.py (fp64 references), segments.py (sequence
segments).
"""
from __future__ import annotations

import torch

from ...runtime.custom_ops import present, use_custom_ops
from ...runtime.hardware import device_guard
from .autograd import ChunkGatedDeltaRuleFunction, compile_ahead_of_first_call, run_bwd_dhu
from .checks import check_chunk_size, check_op_inputs
from .custom_op import gated_delta_rule_bwd_dhu, gated_delta_rule_fwd
from .layout import as_rows

# On the H200 (Triton 3.6) value dims under 32 gave wrong outputs: the op zero-pads V there.
_MIN_GPU_V = 32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the head dim, in fp32 (autograd handles its backward)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def op_arguments(q, k, v, g, gk, scale, initial_state, use_qk_l2norm_in_kernel: bool):
    """The public arguments as the op's Function takes them (checked before):
    -> (q, k, v, g32, gk32, scale, initial_state, pad_v). pad_v value columns of zeros were
    appended (slice them off o and the final state)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    # Gates in fp32 (the casts are autograd ops, so their gradients come back in the given dtype).
    g32 = None if g is None else as_rows(g.float())
    gk32 = None if gk is None else as_rows(gk.float())
    # Zero value columns stay zero in every state and output: pad V, slice the results, and
    # autograd does the rest.
    V = v.shape[-1]
    pad_v = _MIN_GPU_V - V if (q.is_cuda and V < _MIN_GPU_V) else 0
    if pad_v:
        v = torch.nn.functional.pad(v, (0, pad_v))
        if initial_state is not None:
            initial_state = torch.nn.functional.pad(initial_state, (0, pad_v))
    return as_rows(q), as_rows(k), as_rows(v), g32, gk32, float(scale), initial_state, pad_v


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                           gk: torch.Tensor | None = None, chunk_size: int = 64, disable_recompute: bool = False):
    """Gated delta rule (Gated DeltaNet; Kimi Delta Attention with the per-key gate gk), chunked.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV a multiple of H); g [B, T, HV] log decay (or None with
    gk); gk [B, T, HV, K] per-key log decay; beta [B, T, HV]; initial_state [N, HV, K, V] fp32.
    With cu_seqlens (int32/int64, [N + 1]) the sequences are packed along T and B must be 1.
    disable_recompute (as FLA's chunk_kda names it): keep the forward's per-chunk states and v_new,
    and w (with gk the gated q and k too) where the forward formed it, for the backward instead of
    recomputing them there (a faster backward, for about T / 64 * K * V + T * V (+ T * K, with gk
    3 T * K) more elements of k's and v's dtypes per value head held until the backward has run), under
    torch.compile too (there what is kept depends on the sizes, which are then specialised: a new
    size compiles again, and a dimension marked dynamic is refused). Only where the forward writes
    them: the fused SM90 forward keeps none, and recomputes as usual (logged once).
    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None).
    """
    compiling = use_custom_ops()
    if compiling:  # the checks run inside the op (those of cu_seqlens read it back to the host)
        check_chunk_size(chunk_size)
    else:
        B, T, H, HV, K, V, cu_seqlens = check_op_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gk,
                                                        chunk_size)
    q, k, v, g32, gk32, scale, initial_state, pad_v = op_arguments(q, k, v, g, gk, scale, initial_state,
                                                                   use_qk_l2norm_in_kernel)
    args = (q, k, v, g32, gk32, as_rows(beta), scale, initial_state, bool(output_final_state), cu_seqlens)
    backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g32, gk32, beta, initial_state))
    if compiling:  # traced by torch.compile: one custom op node (custom_op.py)
        o, final, *_ = gated_delta_rule_fwd(*args, backward, bool(disable_recompute) and backward)
        final = present(final, bool(output_final_state))
    else:
        with device_guard(q.device):
            keep_states = bool(disable_recompute) and backward
            compile_ahead_of_first_call(args, backward=backward, keep_states=keep_states)
            o, final = ChunkGatedDeltaRuleFunction.apply(*args, keep_states)
    if pad_v:
        V = v.shape[-1] - pad_v
        o = o[..., :V]
        final = None if final is None else final[..., :V]
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule_bwd_dhu(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                                   dv: torch.Tensor, g: torch.Tensor | None = None,
                                   gk: torch.Tensor | None = None, h0: torch.Tensor | None = None,
                                   dht: torch.Tensor | None = None, scale: float | None = None,
                                   cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64):
    """The state-gradient pass of the chunked gated delta rule (see the spec): returns
    (dh [B, NT, HV, K, V] in q's dtype, dh0 [N, HV, K, V] fp32 or None, dv2 like dv).
    g, gk are chunk-local cumulative sums; with gk, q and k come already gated. With cu_seqlens,
    NT is the total chunk count of the packed sequences (read from cu_seqlens: one host sync
    the first time a cu_seqlens tensor is seen, none after)."""
    check_chunk_size(chunk_size)
    if use_custom_ops():  # traced by torch.compile: one custom op node (custom_op.py)
        dh, dh0, dv2 = gated_delta_rule_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, scale, cu_seqlens)
        return dh, present(dh0, h0 is not None), dv2
    return run_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, scale, cu_seqlens)
