"""The chunked gated delta rule as torch.library custom ops, for torch.compile.

flash_dma::gated_delta_rule_fwd  (q, k, v, g?, gk?, beta, ...) -> (o, final, g_cum, gk_cum, ai, aqk, starts,
                                  transitions, h, v_new, w, k_gated, q_gated)
flash_dma::gated_delta_rule_bwd  (do, dht?, q, k, v, ...) -> (dq, dk, dv, dg, dgk, dbeta, dh0)
flash_dma::gated_delta_rule_bwd_dhu  the public state-gradient pass -> (dh, dh0, dv2)

The forward's g_cum, gk_cum, ai and aqk (the gate cumsums, T and, with gk, the gated query-key
products that the eager Function keeps for its backward, where the plan keeps them; gk itself is
then not kept) and, where the plan
cuts the state pass into segments, each segment's starting state and transition, and with
disable_recompute the per-chunk states, v_new, w and the gated k, q (autograd.kept_states_form)
are outputs of the forward op, marked non-differentiable, so the backward op reuses them as the
eager backward does. The per-chunk states' count with cu_seqlens is the layout's bound (known
from the shapes), not the packed sequences' exact count. Their shapes follow from the plan, which
depends only on shapes, dtypes and the device, so the fake functions derive them the same way.
A plan is a Python object and cannot cross an op's boundary: the backward op re-plans (plan_call
is memoised) and re-reads the layout (cached per cu_seqlens tensor). Absent outputs are empty
placeholders (runtime/custom_ops.py). The public functions call these ops only while
torch.compile traces them (interface.py).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_int

from ...runtime.custom_ops import absent, present
from ...runtime.config import ceil_div
from ...runtime.hardware import device_guard
from .autograd import (compile_ahead_of_first_call, kept_gate, kept_states_form, run_backward, run_bwd_dhu,
                       run_forward)
from .checks import check_op_inputs, checked_cu_seqlens
from .launch_table import keeps_gated_pairs, keeps_inverse
from .layout import CHUNK, as_rows, chunk_layout, chunk_state_count
from .plan import forward_segment_chunks, plan_call, plan_for_sizes
from .segments import segment_bound


@torch.library.custom_op("flash_dma::gated_delta_rule_fwd", mutates_args=())
def gated_delta_rule_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gk: Tensor | None, beta: Tensor,
                         scale: float, initial_state: Tensor | None, output_final_state: bool,
                         cu_seqlens: Tensor | None, compile_backward: bool, keep_states: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                    Tensor, Tensor, Tensor]:
    """q, k, v, g, gk, beta as chunk_gated_delta_rule hands them to its autograd Function (rows,
    gates in fp32). compile_backward: the call will be differentiated (compile its backward's
    kernels ahead too). keep_states: disable_recompute, with a backward to come."""
    *_, cu_seqlens = check_op_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gk, CHUNK)
    args = (as_rows(q), as_rows(k), as_rows(v), g, gk, as_rows(beta), scale, initial_state, output_final_state,
            cu_seqlens)
    with device_guard(q.device):
        compile_ahead_of_first_call(args, backward=compile_backward, keep_states=keep_states)
        o, final, g_cum, gk_cum, ai, aqk, segments, states, layout, _ = run_forward(*args, keep_states)
        if states is not None:
            # the rows no kernel writes (packed tokens past the last offset, chunk slots past the
            # sequences' chunks) are zeroed, so that the op's outputs are reproducible; without
            # kept states the saved tensors' padding rows stay as allocated, as no one reads them
            # (a launch each on every compiled varlen call would cost host time)
            layout.zero_rows_outside(g_cum, gk_cum, ai, aqk, *states[1:])
            layout.zero_unused_slots(states[0])
    # the backward's reach (segments.py) does not cross the op boundary: there bwd_dhu's local
    # pass runs whole segments (the same result, dropped transitions included); with the states
    # kept the starts serve nothing (the backward's state pass does not run)
    starts, transitions = (None, None) if segments is None else segments[:2]
    kept = (g_cum, gk_cum, ai, aqk, None if states is not None else starts, transitions,
            *(states if states is not None else (None,) * 5))
    return (o, final if output_final_state else absent(q), *(absent(q) if t is None else t for t in kept))


def _segment_slots(q, v, cu_seqlens, per_segment: int | None = None) -> int | None:
    """The segments (slots) of the forward's sequence split, cut into segments of per_segment
    chunks (default: as its plan cuts), else None: the first dimension of the starts and
    transitions the forward op returns."""
    B, T = q.shape[:2]
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if per_segment is None:
        per_segment = forward_segment_chunks(B, T, v.shape[2], num_seqs, cu_seqlens is not None, q.device)
    if per_segment is None:
        return None
    return segment_bound(B, T, None if cu_seqlens is None else num_seqs, per_segment)


def _kept_for_backward(k, v, g, gk) -> tuple[bool, bool, bool, bool]:
    """(g_cum kept, gk_cum kept, ai kept, aqk kept): what the plan's forward keeps
    (plan.keep_inverse, plan.keep_gated_pairs)."""
    keep = keeps_inverse(k.shape[3], v.shape[3], gk is not None)
    pairs = keeps_gated_pairs(k.shape[3], v.shape[3], gk is not None)
    return (keep or pairs) and g is not None, pairs, keep or pairs, pairs


@gated_delta_rule_fwd.register_fake
def _gated_delta_rule_fwd_fake(q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens,
                               compile_backward, keep_states=False):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    states_kept, kept_states = _kept_states_fake(q, k, v, g, gk, num_seqs, cu_seqlens is not None, keep_states)
    final = q.new_empty((num_seqs, HV, K, V), dtype=torch.float32) if output_final_state else absent(q)
    keep_g_cum, keep_gk_cum, keep_ai, keep_aqk = _kept_for_backward(k, v, g, gk)
    g_cum = q.new_empty((B, T, HV), dtype=torch.float32) if keep_g_cum else absent(q)
    gk_cum = q.new_empty((B, T, HV, K), dtype=torch.float32) if keep_gk_cum else absent(q)
    ai = k.new_empty((B, T, HV, CHUNK)) if keep_ai else absent(q)  # wy_prepare.inverse_buffer: k's dtype
    aqk = q.new_empty((B, T, HV, CHUNK)) if keep_aqk else absent(q)  # gate_pairs.gated_pairs: q's dtype
    slots = _segment_slots(q, v, cu_seqlens)
    if slots is None:
        return o, final, g_cum, gk_cum, ai, aqk, absent(q), absent(q), *kept_states
    starts = absent(q) if states_kept else q.new_empty((slots, HV, K, V), dtype=torch.float32)
    return (o, final, g_cum, gk_cum, ai, aqk, starts, q.new_empty((slots, HV, K, K), dtype=torch.float32),
            *kept_states)


def _kept_states_fake(q, k, v, g, gk, num_seqs, varlen: bool, keep_states: bool) -> tuple[bool, tuple]:
    """(whether the states are kept, the forward op's (h, v_new, w, k_gated, q_gated)) as
    disable_recompute keeps them (autograd.kept_states_form), absent placeholders where not kept.
    What is kept follows the plan, which reads the sizes: traced with dynamic sizes, those are
    specialised (guarded), so a new size compiles again rather than meet a plan made for another."""
    if not keep_states:
        return False, tuple(absent(q) for _ in range(5))  # distinct: outputs must not alias
    B, T, H, K = (guard_int(size) for size in q.shape)
    HV, V = guard_int(v.shape[2]), guard_int(v.shape[3])
    num_seqs = guard_int(num_seqs)
    plan = plan_for_sizes(q.device, q.dtype, B, T, H, HV, K, V, num_seqs, varlen, g is not None, gk is not None)
    states, w, gated = kept_states_form(plan, gk is not None, keep_states)
    if not states:
        return False, tuple(absent(q) for _ in range(5))
    h = k.new_empty((chunk_state_count(B, T, num_seqs if varlen else None), HV, K, V))
    return True, (h, v.new_empty(v.shape), k.new_empty((B, T, HV, K)) if w else absent(q),
                  k.new_empty((B, T, HV, K)) if gated else absent(q),
                  q.new_empty((B, T, HV, K)) if gated else absent(q))


@torch.library.custom_op("flash_dma::gated_delta_rule_bwd", mutates_args=())
def gated_delta_rule_bwd(do: Tensor, dht: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None,
                         gk: Tensor | None, beta: Tensor, scale: float, initial_state: Tensor | None,
                         cu_seqlens: Tensor | None, g_cum: Tensor, gk_cum: Tensor, ai: Tensor, aqk: Tensor,
                         starts: Tensor, transitions: Tensor, h: Tensor, v_new: Tensor, w: Tensor,
                         k_gated: Tensor, q_gated: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dg, dgk, dbeta, dh0), contiguous; placeholders for absent g, gk, initial_state.
    gk: None where the forward kept gk_cum instead. starts, transitions: the forward's segments,
    or empty placeholders where it did not cut (starts also where it kept the states). h, v_new,
    w, k_gated, q_gated: what disable_recompute kept, or empty placeholders."""
    B, T = q.shape[:2]
    cu_seqlens = checked_cu_seqlens(cu_seqlens, B, T, q.device)  # (int32, checked once per tensor)
    layout = chunk_layout(B, T, cu_seqlens)
    plan = plan_call(q, v, g is not None, gk is not None or gk_cum.numel() > 0, layout)
    g_cum = g_cum if (plan.keep_inverse or plan.keep_gated_pairs) and g is not None else None
    gk_cum = gk_cum if plan.keep_gated_pairs else None
    ai = ai if plan.keeps_t else None
    aqk = aqk if plan.keep_gated_pairs else None
    # the forward's cut, where it made one with this plan (overrides changed between the two
    # calls would give another plan: the segments are then computed again)
    per_segment = plan.chunks_per_segment.value
    states = None
    if h.numel():
        states = (h, v_new, *(t if t.numel() else None for t in (w, k_gated, q_gated)))
    segments = None
    if (transitions.numel() and per_segment is not None
            and transitions.shape[0] == _segment_slots(q, v, cu_seqlens, per_segment)):
        segments = (starts if starts.numel() else None, transitions, None)
    grads = run_backward(plan, layout, q, k, v, g, gk, beta, scale, initial_state, g_cum, ai, aqk, do, dht,
                         segments, gk_cum, states)
    return tuple(absent(q) if t is None else t.contiguous() for t in grads)


@gated_delta_rule_bwd.register_fake
def _gated_delta_rule_bwd_fake(do, dht, q, k, v, g, gk, beta, scale, initial_state, cu_seqlens, g_cum, gk_cum,
                               ai, aqk, starts, transitions, h, v_new, w, k_gated, q_gated):
    like = (q, k, v, g, gk if gk is not None or not gk_cum.numel() else gk_cum, beta, initial_state)
    return tuple(absent(q) if t is None else t.new_empty(t.shape) for t in like)


def _setup_context(ctx, inputs, output):
    q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens, *_ = inputs
    o, final, *kept = output
    gk_cum = kept[1]
    gk_kept = kept_gate(gk, gk_cum if gk_cum.numel() else None, q, k, v, g, beta, initial_state)
    ctx.save_for_backward(q, k, v, g, gk_kept, beta, initial_state, cu_seqlens, *kept)
    ctx.scale, ctx.output_final_state, ctx.has_gk = scale, output_final_state, gk is not None
    ctx.mark_non_differentiable(*kept)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the kept tensors


def _backward(ctx, do, dht, *_kept_grads):
    q, k, v, g, gk, beta, initial_state, cu_seqlens, *kept = ctx.saved_tensors
    if do is None:  # only the final state reached the loss
        do = q.new_zeros(v.shape)
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dgk, dbeta, dh0 = gated_delta_rule_bwd(do, dht, q, k, v, g, gk, beta, ctx.scale,
                                                           initial_state, cu_seqlens, *kept)
    return (dq, dk, dv, present(dg, g is not None), present(dgk, ctx.has_gk), dbeta, None,
            present(dh0, initial_state is not None), None, None, None, None)


gated_delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flash_dma::gated_delta_rule_bwd_dhu", mutates_args=())
def gated_delta_rule_bwd_dhu(q: Tensor, k: Tensor, w: Tensor, do: Tensor, dv: Tensor, g: Tensor | None,
                             gk: Tensor | None, h0: Tensor | None, dht: Tensor | None, scale: float | None,
                             cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    dh, dh0, dv2 = run_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, scale, cu_seqlens)
    return dh, absent(q) if dh0 is None else dh0, dv2


@gated_delta_rule_bwd_dhu.register_fake
def _gated_delta_rule_bwd_dhu_fake(q, k, w, do, dv, g, gk, h0, dht, scale, cu_seqlens):
    B, T, _, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if cu_seqlens is None:
        dh = q.new_empty((B, ceil_div(T, CHUNK), HV, K, V))
    else:  # the packed sequences' chunk count is read from cu_seqlens: data-dependent
        dh = q.new_empty((1, torch.library.get_ctx().new_dynamic_size(), HV, K, V))
    num_seqs = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dh0 = q.new_empty((num_seqs, HV, K, V), dtype=torch.float32) if h0 is not None else absent(q)
    return dh, dh0, torch.empty_like(as_rows(dv))
