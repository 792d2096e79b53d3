"""The gated delta rule's autograd Function: the order of the passes, forward and backward.

Forward: prepare (gates, WY representation) -> states -> output; where T is kept and the GPU is
full, the state pass forms the WY products from T itself. On SM90, where enough programs run,
the states and the output are one fused kernel (gluon/) that writes neither the per-chunk
states nor v_new. The backward keeps about what FLA keeps (the inputs, the scalar gate's
cumsums and the per-chunk inverse T; with the per-key gate T, the gated query-key products and
the gate cumsums in place of gk; no per-chunk states unless disable_recompute asks for them):
it recomputes w, u and the states (with gk the gated q and k too), then
runs the state-gradient pass (bwd_dhu) and the chunk-parallel gradient passes. Which way each
step goes is the call's plan (plan.py); the kernels are the plan's backend's (one module per
pass).
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch

from ...runtime.autograd import first_order_only
from ...runtime.hardware import device_guard, graph_capturing
from ...runtime.launch import compile_ahead, compile_ahead_enabled
from ...runtime.profile import log_fallback
from .checks import check_bwd_dhu_inputs
from .layout import CHUNK, ChunkLayout, as_rows, chunk_layout, total_chunks
from .plan import DeltaRulePlan, plan_bwd_dhu, plan_call
from .triton import bwd_dhu, bwd_dqkw, bwd_wy, gate_pairs, key_gates, output, state_pass, wy_prepare

# The passes of each backend, by plan.backend. A second backend (ops/gated_delta_rule/cute/)
# offers the same functions under the same names.
BACKENDS = {"triton": SimpleNamespace(key_gates=key_gates, gate_pairs=gate_pairs, wy_prepare=wy_prepare,
                                      state_pass=state_pass, output=output, bwd_dhu=bwd_dhu,
                                      bwd_dqkw=bwd_dqkw, bwd_wy=bwd_wy)}


def _prepare(plan: DeltaRulePlan, layout: ChunkLayout, q, k, v, beta, g, gk, scale, store_wu: bool = True,
             store_q_gated: bool = False, decay_bound: torch.Tensor | None = None):
    """Gate cumsums, T = (I + A)^-1 per chunk, w and u (unless store_wu is False: returned as
    None) and, with gk, the gated query-key matrix and k e^(C_last - C) (and, with store_q_gated,
    q e^C) per value head for the state passes; None without gk. decay_bound: a buffer for each
    chunk's transition bound (segments.py), or None."""
    ops = BACKENDS[plan.backend]
    ai = ops.wy_prepare.inverse_buffer(k, v.shape[2])
    g_cum = gk_cum = aqk = k_gated = q_gated = a_raw = None
    if gk is not None:
        # the gate cumsums and the gated pair products (a kernel of their own) come first; the
        # prepare program then only inverts and forms w, u (all in one program it spilled)
        a_raw = ops.wy_prepare.raw_products_buffer(k, v.shape[2], ai)
        g_cum, gk_cum, k_gated, q_gated, aqk = ops.gate_pairs.gated_pairs(plan, layout, q, k, g, gk, a_raw, scale,
                                                                          store_q_gated)
    g_cum, w, u = ops.wy_prepare.prepare(plan, layout, k, v, beta, g, g_cum, gk_cum, ai, store_wu, decay_bound,
                                         a_raw)
    return g_cum, gk_cum, w, u, ai, aqk, k_gated, q_gated


def _group_sum(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, HV, K] per value head -> [B, T, H, K] per q/k head (sum over the group)."""
    B, T, HV, K = x.shape
    if HV == heads:
        return x
    return x.view(B, T, heads, HV // heads, K).sum(3)


def forward(plan: DeltaRulePlan, layout: ChunkLayout, q, k, v, g, gk, beta, scale, initial_state,
            output_final_state: bool, keep_states: bool = False):
    """-> (o, final state or None, g_cum, gk_cum, T and the gated query-key products where the
    backward reuses them, else None, segments: (starts, transitions, backward reach or None) of
    a sequence split of the state pass, else None, states: (h, v_new, w, k_gated, q_gated) where
    keep_states asks for them and the forward writes them (the Triton state pass; the fused SM90
    forward writes none), else None; w where the forward formed it (not from T), k_gated and
    q_gated with gk, else None; all three None where T is not kept)."""
    ops = BACKENDS[plan.backend]
    split = plan.split_prepare.value
    fused = plan.fused_forward_form()
    decay_bound = None
    if plan.segment_chunks() is not None and plan.decay_reach_on():
        decay_bound = torch.empty(layout.num_chunk_states, v.shape[2], device=k.device,
                                  dtype=torch.float32)
    keep, keep_w, keep_gated = kept_states_form(plan, gk is not None, keep_states)
    # with gk the warp-role kernel takes the gated q (the Triton output pass gates q itself); it
    # writes no per-chunk states, so kept states take the Triton passes
    fused_gk = gk is not None and not keep and plan.fused_forward_gk_on()
    g_cum, gk_cum, w, u, ai, aqk, k_gated, q_gated = _prepare(plan, layout, q, k, v, beta, g, gk, scale,
                                                              store_wu=not split and fused is None,
                                                              store_q_gated=keep_gated or fused_gk,
                                                              decay_bound=decay_bound)
    states = None
    if fused_gk:
        from .gluon.forward_ws_gk import forward_ws_gk
        o, final = forward_ws_gk(layout, q_gated, k_gated, w, u, aqk, gk_cum, initial_state, output_final_state,
                                 scale, order=plan.sequence_order(layout))
        segments = None
        del w, u, k_gated, q_gated
    elif fused is not None:
        if keep_states:
            log_states_not_kept("the fused SM90 forward writes no per-chunk states")
        o, final, segments = _fused_forward(plan, layout, q, k, v, beta, ai, g_cum, initial_state,
                                            output_final_state, scale, fused, decay_bound)
    else:
        if split and not plan.states_from_inverse.value:
            w, u, _, _ = ops.wy_prepare.recompute_wu(plan, layout, k, v, beta, g_cum, ai)
        h, v_new, final, segments = ops.state_pass.states(plan, layout, k if k_gated is None else k_gated, v,
                                                          beta, ai, w, u, g_cum, gk_cum, initial_state,
                                                          output_final_state, decay_bound=decay_bound)
        o = ops.output.output(plan, layout, q, k, g_cum, gk_cum, aqk, h, v_new, scale)
        if keep:
            states = (h, v_new, w if keep_w else None, *((k_gated, q_gated) if keep_gated else (None, None)))
        del h, v_new, w, u, k_gated, q_gated
    # Kept for the backward, as FLA keeps them (not per chunk states), where the backward can
    # reuse them: T and the scalar gate's cumsums; with gk T, the gated pair products and the
    # gate cumsums (kept in place of gk itself: the backward needs only them).
    if not plan.keeps_t:
        g_cum = ai = None
    if not plan.keep_gated_pairs:
        gk_cum = aqk = None
    return o, final, g_cum, gk_cum, ai, aqk, segments, states


def kept_states_form(plan: DeltaRulePlan, has_gk: bool, keep_states: bool) -> tuple[bool, bool, bool]:
    """What disable_recompute (keep_states) keeps under this plan: (the per-chunk states and
    v_new, w, the gated k and q). The fused SM90 forward writes no states. The states come with
    what the backward's recompute of w would give (as FLA's chunk_kda keeps them): w and, with gk,
    the gated k and q, where the backward reuses T (else it prepares again, which forms them); w
    only where the forward forms it (its state pass may read T instead). Shapes only: the custom
    op's fake function asks too."""
    states = keep_states and not plan.fused_forward.value
    with_t = states and plan.keeps_t
    w = with_t and not (plan.split_prepare.value and plan.states_from_inverse.value)
    return states, w, with_t and has_gk


def log_states_not_kept(reason: str) -> None:
    """disable_recompute asked for states this call cannot keep: said once per reason."""
    log_fallback("chunk_gated_delta_rule", "disable_recompute (the forward's states kept)",
                 "the backward's recompute", reason)


def _fused_forward(plan: DeltaRulePlan, layout: ChunkLayout, q, k, v, beta, ai, g_cum, initial_state,
                   store_final: bool, scale, form, decay_bound=None):
    """The state pass and output in one SM90 kernel (gluon/; form "ws": warp roles, else the
    one-role kernel's V tile): -> (o, final or None, segments or None). Where the plan cuts the
    sequences, the Triton state pass finds each segment's start (segments.py) and the fused
    kernel runs over the segments from those."""
    from .gluon.forward_fused import forward_fused
    from .gluon.forward_ws import forward_ws

    def run(h0, final_wanted, **over):
        if form == "ws":
            return forward_ws(layout, q, k, v, beta, ai, g_cum, h0, final_wanted, scale, **over)
        return forward_fused(layout, q, k, v, beta, ai, g_cum, h0, final_wanted, scale, form, **over)

    per_segment = plan.segment_chunks()
    if per_segment is None:
        o, final = run(initial_state, store_final, order=plan.sequence_order(layout))
        return o, final, None
    seg, starts, transition, final, reach_back = BACKENDS[plan.backend].state_pass.segment_starts(
        plan, layout, k, v, beta, ai, g_cum, initial_state, per_segment, decay_bound)
    o, _ = run(starts, False, cu_seqlens=seg.cu_seqlens, num_seqs=seg.num_slots)
    return o, final if store_final else None, (starts, transition, reach_back)


def backward(plan: DeltaRulePlan, layout: ChunkLayout, q, k, v, g, gk, beta, scale, initial_state, do, dht,
             g_cum, ai, aqk=None, segments=None, gk_cum=None, states=None):
    """g_cum, ai, aqk and gk_cum: the forward's gate cumsums, T and (gk) gated query-key products
    and per-key gate cumsums, or None where it keeps them not (gk itself is needed only then);
    segments: the forward's (starts, transitions, backward reach or None) of its sequence split,
    or None (recomputed); states: the forward's (h, v_new, w or None, k_gated or None, q_gated or
    None) (disable_recompute), or None (recomputed: the state pass runs again)."""
    ops = BACKENDS[plan.backend]
    H = q.shape[2]
    # after the state pass, one kernel: bwd_dhu, the intra-chunk dv and the chunk gradients
    warp_roles = ai is not None and plan.backward_warp_roles_on()
    dhu_warp_roles = not warp_roles and ai is not None and plan.dhu_warp_roles_on()  # forms dv_local and w itself
    fused_chunk = not warp_roles and plan.fused_backward_on()
    # the Gluon kernels take do as a 16-bit MMA operand (a copy only where it is not one)
    do_mma = do.to(q.dtype) if warp_roles or dhu_warp_roles or fused_chunk else None
    kept_w, kept_k_gated, kept_q_gated = (None, None, None) if states is None else states[2:]
    if ai is None:
        g_cum, gk_cum, w, u, ai, aqk, k_gated, q_gated = _prepare(plan, layout, q, k, v, beta, g, gk, scale,
                                                                  store_q_gated=True)
    elif gk_cum is not None and kept_w is not None and kept_q_gated is not None:  # all kept: no recompute
        w, u, k_gated, q_gated = kept_w, None, kept_k_gated, kept_q_gated
    elif gk_cum is not None:  # T, the gated pair products and the gate cumsums kept: w, u and the gated q, k
        w, u, k_gated, q_gated = ops.wy_prepare.recompute_wu(plan, layout, k, v, beta, g_cum, ai,
                                                             with_u=states is None, gk_cum=gk_cum, q=q)
    elif ((warp_roles or dhu_warp_roles) and (states is not None or plan.backward_states_from_inverse.value)) \
            or plan.dhu_w_from_t_on():
        # the state pass forms v_new from T (or is not run: states kept) and bwd_dhu takes T: no w
        gk_cum = aqk = k_gated = q_gated = w = u = None
    elif kept_w is not None:
        gk_cum = aqk = k_gated = q_gated = u = None
        w = kept_w
    else:
        gk_cum = aqk = k_gated = q_gated = None
        w, u, _, _ = ops.wy_prepare.recompute_wu(plan, layout, k, v, beta, g_cum, ai,
                                                 with_u=states is None and not plan.backward_states_from_inverse.value)
    k_states = k if k_gated is None else k_gated  # with gk the state passes take gated q and k
    if states is not None:  # kept by the forward (disable_recompute)
        h, v_new = states[:2]
    else:  # u None: the state pass forms v_new from T (w is still bwd_dhu's)
        h, v_new, _, segments = ops.state_pass.states(plan, layout, k_states, v, beta, ai,
                                                      None if u is None else w, u, g_cum, gk_cum, initial_state,
                                                      store_final=False, known=segments)
    del states, kept_w, kept_k_gated, kept_q_gated
    if warp_roles:
        from .gluon.backward_ws import bwd_sequential
        del w, u
        if plan.segment_chunks("bwd_dhu") is None:
            dq, dk, dv, dbeta, dg, dh0 = bwd_sequential(layout, q, k, v, v_new, h, do_mma, ai, g_cum, beta, dht,
                                                        initial_state is not None, scale)
        else:
            # cut: each segment runs from the state gradient at its end, found by bwd_dhu's local
            # pass and the join right to left
            seg, ends, dh0 = ops.bwd_dhu.segment_end_gradients(
                plan, layout, q, k, do_mma, g_cum, (ai, beta), dht, scale,
                forward_transition=None if segments is None else segments[1],
                reverse_reach=None if segments is None else segments[2])
            dq, dk, dv, dbeta, dg, _ = bwd_sequential(layout, q, k, v, v_new, h, do_mma, ai, g_cum, beta, ends, False,
                                                      scale, seg.cu_seqlens, seg.chunk_offsets, seg.num_slots)
            dh0 = dh0 if initial_state is not None else None
        del segments
        return _group_sum(dq, H).to(q.dtype), _group_sum(dk, H).to(k.dtype), dv, dg, None, dbeta, dh0
    if dhu_warp_roles:
        from .gluon.bwd_dhu_ws import bwd_dhu_ws
        dv_local = None
        dh, dh0, dv2 = bwd_dhu_ws(layout, q, k, ai, beta, do_mma, g_cum, dht, initial_state is not None, scale,
                                  v.dtype)
    else:
        fold_dv = plan.dhu_local_dv_on()
        dv_local = None if fold_dv else ops.output.local_dv(plan, layout, q, k, g_cum, gk_cum, aqk, do, scale,
                                                            v.dtype)
        dh, dh0, dv2 = ops.bwd_dhu.bwd_dhu(plan, layout, q if q_gated is None else q_gated, k_states, w, do,
                                           dv_local, g_cum, gk_cum, dht, initial_state is not None, scale,
                                           forward_transition=None if segments is None else segments[1],
                                           reverse_reach=None if segments is None else segments[2],
                                           local_dv_dtype=v.dtype if fold_dv else None,
                                           inverse=(ai, beta) if w is None else None)
    # what the passes below do not read is freed before they allocate (peak memory)
    del segments, w, u
    del k_gated, q_gated, dv_local
    if fused_chunk:
        from .gluon.backward_chunk import bwd_chunk
        dq, dk, dv, dbeta, dg = bwd_chunk(layout, q, k, v, v_new, h, dh, do_mma, dv2, ai, g_cum, beta, scale)
        return _group_sum(dq, H).to(q.dtype), _group_sum(dk, H).to(k.dtype), dv, dg, None, dbeta, dh0
    grads = ops.bwd_dqkw.bwd_dqkw(plan, layout, q, k, v_new, h, dh, do, dv2, g_cum, gk_cum, scale)
    del h, dh, v_new
    dv, dbeta, dg, d_a = ops.bwd_wy.bwd_wy(plan, layout, k, v, beta, g_cum, gk_cum, ai, dv2, grads)
    dgk = finished = None
    if gk_cum is not None:
        # without grouped value heads the kernel writes the finished dq and dk itself
        finished, dgk, dbeta_parts, dg_parts = ops.gate_pairs.pair_gradients(
            plan, layout, q, k, beta, g_cum, gk_cum, grads.d_p, d_a, grads.dq, grads.dk, grads.dk_out,
            grads.d_last, scale, final_dtype=grads.dq.shape[2] == H)
        dbeta = ops.key_gates.gate_gradients(plan, layout, dg, dbeta, dbeta_parts, dg_parts, beta.dtype)
    if finished is not None:
        dq, dk = finished
    elif grads.direct:
        dq, dk = grads.dq, grads.dk_out
    else:
        dq = _group_sum(grads.dq, H).to(q.dtype)
        dk = _group_sum(grads.dk, H).to(k.dtype)
    return dq, dk, dv, dg, dgk, dbeta, dh0


def run_forward(q, k, v, g, gk, beta, scale, initial_state, output_final_state: bool, cu_seqlens,
                keep_states: bool = False):
    """The forward of one call, planned: -> (o, final state or None, g_cum, gk_cum, ai, aqk,
    segments, states, layout, plan), g_cum, gk_cum, ai, aqk and states as forward() keeps them
    for the backward. Shared with the custom ops (custom_op.py)."""
    B, T = q.shape[:2]
    layout = chunk_layout(B, T, cu_seqlens)
    plan = plan_call(q, v, g is not None, gk is not None, layout)
    o, final, g_cum, gk_cum, ai, aqk, segments, states = forward(plan, layout, q, k, v, g, gk, beta, scale,
                                                                 initial_state, output_final_state, keep_states)
    layout.zero_rows_outside(o)
    return o, final, g_cum, gk_cum, ai, aqk, segments, states, layout, plan


def run_backward(plan: DeltaRulePlan, layout: ChunkLayout, q, k, v, g, gk, beta, scale, initial_state,
                 g_cum, ai, aqk, do, dht, segments=None, gk_cum=None, states=None):
    """-> (dq, dk, dv, dg, dgk, dbeta in beta's dtype, dh0); dg, dgk, dh0 None where absent."""
    do = as_rows(do)
    dht = None if dht is None else dht.float().contiguous()
    with device_guard(q.device):
        dq, dk, dv, dg, dgk, dbeta, dh0 = backward(plan, layout, q, k, v, g, gk, beta, scale, initial_state,
                                                   do, dht, g_cum, ai, aqk, segments, gk_cum, states)
        layout.zero_rows_outside(dq, dk, dv, dg, dgk, dbeta)
    return dq, dk, dv, dg, dgk, dbeta.to(beta.dtype), dh0


def run_bwd_dhu(q, k, w, do, dv, g, gk, h0, dht, scale, cu_seqlens):
    """The public state-gradient pass (interface.chunk_gated_delta_rule_bwd_dhu), checks included:
    -> (dh, dh0 or None, dv2). Shared with its custom op (custom_op.py)."""
    device, cu_seqlens = check_bwd_dhu_inputs(q, k, w, do, dv, g, gk, h0, dht, cu_seqlens, CHUNK)
    if scale is None:
        scale = q.shape[3] ** -0.5
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    with device_guard(device):
        layout = chunk_layout(B, T, cu_seqlens)
        plan = plan_bwd_dhu(device, B, T, H, HV, K, V, layout, g is not None, gk is not None)
        dh, dh0, dv2 = BACKENDS[plan.backend].bwd_dhu.bwd_dhu(
            plan, layout, as_rows(q), as_rows(k), as_rows(w), as_rows(do), as_rows(dv),
            None if g is None else as_rows(g), None if gk is None else as_rows(gk),
            None if dht is None else as_rows(dht), h0 is not None, float(scale))
        if layout.is_varlen:
            dh = dh[:total_chunks(cu_seqlens)].unsqueeze(0)
        else:
            dh = dh.view(B, -1, HV, K, V)
    return dh, dh0, dv2


def kept_gate(gk, gk_cum, *others):
    """What the backward keeps of gk: nothing where the forward kept its cumsums gk_cum (the
    backward needs only them), unless gk is the only input that requires grad (first_order_only
    then anchors the gradients on it under create_graph). -> gk or None."""
    if gk_cum is None:
        return gk
    needs = gk.requires_grad and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in others)
    return gk if needs else None


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens,
                disable_recompute=False):
        o, final, g_cum, gk_cum, ai, aqk, segments, states, layout, plan = run_forward(
            q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens, disable_recompute)
        seg_starts, seg_transitions, seg_reach = segments if segments is not None else (None, None, None)
        if states is not None:  # the starts serve only the backward's state pass, which then does not run
            seg_starts = None
        ctx.save_for_backward(q, k, v, g, kept_gate(gk, gk_cum, q, k, v, g, beta, initial_state), beta,
                              initial_state, g_cum, gk_cum, ai, aqk, seg_starts, seg_transitions, seg_reach,
                              *(states if states is not None else (None,) * 5))
        ctx.layout, ctx.plan, ctx.scale = layout, plan, scale
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        (q, k, v, g, gk, beta, initial_state, g_cum, gk_cum, ai, aqk, seg_starts, seg_transitions,
         seg_reach, *states) = ctx.saved_tensors
        segments = None if seg_transitions is None else (seg_starts, seg_transitions, seg_reach)
        dq, dk, dv, dg, dgk, dbeta, dh0 = run_backward(ctx.plan, ctx.layout, q, k, v, g, gk, beta, ctx.scale,
                                                       initial_state, g_cum, ai, aqk, do, dht, segments, gk_cum,
                                                       None if states[0] is None else tuple(states))
        return first_order_only("chunk_gated_delta_rule",
                                (dq, dk, dv, dg, dgk, dbeta, None, dh0, None, None, None),
                                (q, k, v, g, gk, beta, initial_state))


# ------------------------------------------------------------------------------------------------
# Compiling ahead
# ------------------------------------------------------------------------------------------------
# compile-time signatures whose kernels were compiled ahead (see compile_ahead_of_first_call),
# and the exact call shapes already checked against them (a cheap first lookup: the full
# signature costs more host time per call to form, and the shapes of a training step repeat)
_COMPILED_AHEAD: set = set()
_CHECKED_CALLS: set = set()


def compile_ahead_of_first_call(args: tuple, backward: bool, keep_states: bool = False) -> None:
    """On the first call with a new set of compile-time constants (dtypes, heads, head dims,
    gates, states, layout), compile the kernels that this call's forward (and backward) will
    launch, in parallel, before running it: a dry run of both in which every launch only hands
    its compilation to a thread pool (launch.compile_ahead). The dry run allocates the buffers of
    one forward and backward once. The real launches then find their kernels compiled; one the
    dry run missed would compile as usual."""
    q, k, v, g, gk, beta, scale, initial_state, output_final_state, cu_seqlens = args
    call = (q.shape, v.shape, q.device, q.dtype, k.dtype, v.dtype, beta.dtype, g is None, gk is None,
            initial_state is None, output_final_state,
            None if cu_seqlens is None else cu_seqlens.numel(), backward, keep_states)
    if call in _CHECKED_CALLS:
        return
    if not compile_ahead_enabled() or graph_capturing(q.device):
        return
    if len(_CHECKED_CALLS) > 4096:  # varying lengths: bounded
        _CHECKED_CALLS.clear()
    _CHECKED_CALLS.add(call)
    layout = chunk_layout(q.shape[0], q.shape[1], cu_seqlens)
    plan = plan_call(q, v, g is not None, gk is not None, layout)
    # The plan's choices set the kernels' constants; T only Triton's divisibility specialisation.
    choices = (tuple((name, chosen.value) for name, chosen in sorted(plan.launches.items())),
               plan.split_prepare.value, plan.states_from_inverse.value, plan.backward_states_from_inverse.value,
               plan.chunks_per_segment.value, plan.dhu_chunks_per_segment.value, plan.fused_forward.value,
               plan.fused_forward_gk.value, plan.longest_first.value, plan.fused_backward.value,
               plan.dhu_warp_roles.value, plan.backward_warp_roles.value)
    key = (q.device, q.dtype, k.dtype, v.dtype, beta.dtype, tuple(q.shape[2:]), tuple(v.shape[2:]),
           g is not None, gk is not None, initial_state is not None, output_final_state,
           layout.is_varlen, q.shape[1] % 16 == 0, choices, backward, keep_states)
    if key in _COMPILED_AHEAD:
        return
    _COMPILED_AHEAD.add(key)
    ctx = SimpleNamespace()
    ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
    try:
        with torch.no_grad(), compile_ahead():
            o, final = ChunkGatedDeltaRuleFunction.forward(ctx, *args, keep_states)
            if backward:
                ChunkGatedDeltaRuleFunction.backward(ctx, torch.empty_like(o),
                                                     None if final is None else torch.empty_like(final))
    except Exception as exc:  # noqa: BLE001 - a speed-up only: the real call runs (and raises) as usual
        warnings.warn(f"flash_dma: compiling ahead failed ({type(exc).__name__}: {exc}); kernels "
                      "compile at their first launch instead", RuntimeWarning, stacklevel=3)
