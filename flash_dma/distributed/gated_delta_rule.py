"""Context parallelism of the chunked gated delta rule over packed sequences.

Each rank holds a shard of the packed tokens (CPContext: contiguous, or zigzag); a sequence may
lie in one rank or run through several. Per chunk the state recursion is affine in the state,
S' = A S + B, the same A [K, K] for every one of the V columns (segments.py). So a piece of a
sequence maps the state entering it to the state leaving it by S_end = M S_start + N: N is the
piece run from a zero state, M the piece run from the identity with zero values. Per layer:

1. before the exchange, each rank runs the pieces whose end state a later piece needs
   ("carrying" pieces): one that starts its sequence here runs from its true initial state (its
   end state is then N, and M is not needed); one that continues a sequence from an earlier rank
   runs with values [v | 0] (width V + K) from [0 | I], whose end state is [N | M] at once;
2. one all-gather of every rank's [N | M] (differentiable: backward sums the state gradients
   back into their owners), and on every rank the sequential join of segments.py
   (join_segments: S_{j+1} = M_j S_j + N_j along each sequence's pieces) gives each continuing
   piece its true starting state;
3. each rank runs its continuing pieces from those states (and the pieces that need no state
   from elsewhere, where no call of step 1 took them), giving outputs and final states.

Autograd runs backward through all of it: the op's own backward with the state gradients
(dh0, dht) flowing through the join's backward (the same join run right to left on transposed
M, segments.py) and the all-gather's reduce-scatter. Initial and final states are supported.

Cost against one process: a piece that starts its sequence runs once; a piece continuing a
sequence from an earlier rank runs once more (step 1) where it also carries into the next rank,
with V + K value columns (two calls, of width V and K, where V + K exceeds the op's head-dim
limit). At most two op calls per rank and layer, one all-gather of W x [HV, K, V + K] fp32 per
carried piece (of W x [HV, K, V] where no rank holds a sequence's middle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.gated_delta_rule import chunk_gated_delta_rule
from ..ops.gated_delta_rule.segments import SegmentLayout, join_segments
from ..runtime.validation import check_tensor
from .context import CPContext, Piece, gather_shards

# The op's head-dim limit: a continuing piece's [v | 0] (V + K columns) runs as one call up to it.
_MAX_STATE_COLUMNS = 256


# ------------------------------------------------------------------------------------------------
# The sequential join, differentiable
# ------------------------------------------------------------------------------------------------
class _JoinPieces(torch.autograd.Function):
    """starts[j] (state entering slot j) and final[s] (state leaving sequence s's last slot) of
    S_{j+1} = M_j S_j + N_j from a zero state. Backward: the adjoint recursion
    lambda_j = M_j^T lambda_{j+1} + dstarts_j, right to left from dfinal, is the same join
    (reverse, on M^T); it stores lambda_{j+1} = dN_j at slot j, and dM_j = lambda_{j+1} S_j^T."""

    @staticmethod
    def forward(ctx, transition, local, layout: SegmentLayout):
        starts, final = join_segments(transition, local, layout, None)
        ctx.save_for_backward(transition, starts)
        ctx.layout = layout
        return starts, final

    @staticmethod
    def backward(ctx, d_starts, d_final):
        transition, starts = ctx.saved_tensors
        d_local, _ = join_segments(transition.transpose(-1, -2).contiguous(), d_starts.float().contiguous(),
                                   ctx.layout, d_final.float().contiguous(), reverse=True)
        d_transition = d_local @ starts.transpose(-1, -2)
        return d_transition, d_local, None


def join_pieces(transition: torch.Tensor, local: torch.Tensor, layout: SegmentLayout):
    """transition [S, HV, K, K], local [S, HV, K, V] fp32 of S pieces grouped by sequence
    (layout.first_slot / slot_count); returns (starts [S, HV, K, V], final [n, HV, K, V])."""
    return _JoinPieces.apply(transition.float().contiguous(), local.float().contiguous(), layout)


def join_layout(first_slot: list[int], slot_count: list[int], device) -> SegmentLayout:
    """A SegmentLayout for join_segments, which reads only first_slot and slot_count."""
    unused = torch.zeros(0, dtype=torch.int32, device=device)
    return SegmentLayout(sum(slot_count), 0, unused, unused,
                         torch.tensor(first_slot, dtype=torch.int32, device=device),
                         torch.tensor(slot_count, dtype=torch.int32, device=device))


class _Tie(torch.autograd.Function):
    """x unchanged, made to depend on `anchor` with a zero gradient: every rank then runs the
    exchange's backward (a collective) even where its outputs do not use the exchanged states."""

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, torch.zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype, device=dx.device)


# ------------------------------------------------------------------------------------------------
# The plan: which pieces run in which call, and where the exchanged states go
# ------------------------------------------------------------------------------------------------
@dataclass
class _Call:
    """One op call over some of this rank's pieces (in local order)."""
    pieces: tuple[Piece, ...]
    runs: tuple[tuple[int, int], ...]  # the pieces' local token ranges, adjacent ones merged
    cu_seqlens: torch.Tensor  # int32 offsets of the pieces in the call's tokens
    offsets: tuple[int, ...]  # each piece's first token in the call
    seq_ids: torch.Tensor  # long [n]: each piece's sequence
    identity_rows: torch.Tensor | None  # bool [n]: pieces run from [0 | I] (pre call)
    joined_rows: torch.Tensor | None  # bool [n]: pieces run from an exchanged state (post call)
    start_index: torch.Tensor | None  # long [n]: row of cat(starts, final) for joined rows, else 0
    final_rows: torch.Tensor | None  # long: pieces whose end state is their sequence's final state
    final_seqs: torch.Tensor | None  # long: ... and those sequences
    has_identity: bool  # host copies of identity_rows.any(), joined_rows.any()
    has_joined: bool


@dataclass
class _DeltaRulePlan:
    pre: _Call | None  # before the exchange: the carrying pieces
    post: _Call | None  # after it
    exchange: bool  # some piece continues a sequence from another piece
    slots_per_rank: int  # carried states each rank sends (padded to the largest count)
    any_transition: bool  # some rank carries a piece that did not start its sequence (M needed)
    send_rows: torch.Tensor | None  # long: rows of the pre call's end states this rank sends
    join_index: torch.Tensor | None  # long [S]: gathered slot of every join slot
    layout: SegmentLayout | None
    output_parts: tuple[tuple[int, int, int], ...]  # (call 0 pre / 1 post, offset in call, length)
    empty_seqs: torch.Tensor | None  # long: empty sequences whose final state this rank returns


def _merge_runs(ranges) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for s, e in ranges:
        if runs and runs[-1][1] == s:
            runs[-1][1] = e
        else:
            runs.append([s, e])
    return tuple((s, e) for s, e in runs)


def _make_call(pieces, device, identity=None, joined=None, start_index=None) -> _Call | None:
    if not pieces:
        return None
    pieces = tuple(sorted(pieces, key=lambda p: p.local_start))
    offsets, total = [], 0
    for p in pieces:
        offsets.append(total)
        total += p.length
    long = dict(dtype=torch.long, device=device)
    final_rows = [i for i, p in enumerate(pieces) if p.ends_sequence]
    return _Call(
        pieces, _merge_runs((p.local_start, p.local_start + p.length) for p in pieces),
        torch.tensor(offsets + [total], dtype=torch.int32, device=device), tuple(offsets),
        torch.tensor([p.seq for p in pieces], **long),
        None if identity is None else torch.tensor([p in identity for p in pieces], dtype=torch.bool, device=device),
        None if joined is None else torch.tensor([p in joined for p in pieces], dtype=torch.bool, device=device),
        None if start_index is None else torch.tensor([start_index.get(p, 0) for p in pieces], **long),
        torch.tensor(final_rows, **long), torch.tensor([pieces[i].seq for i in final_rows], **long),
        bool(identity) and any(p in identity for p in pieces), bool(joined) and any(p in joined for p in pieces))


def _plan(ctx: CPContext) -> _DeltaRulePlan:
    plan = ctx.plans.get("gated_delta_rule")
    if plan is not None:
        return plan
    device, world = ctx.device, ctx.world_size
    carrying = [[p for p in ctx.pieces[r] if not p.ends_sequence] for r in range(world)]
    slots_per_rank = max(len(c) for c in carrying)
    any_transition = any(not p.starts_sequence for c in carrying for p in c)

    # join slots: the carrying pieces of each sequence that continues past a piece, in global order
    by_seq: dict[int, list[Piece]] = {}
    for rank_pieces in ctx.pieces:
        for p in rank_pieces:
            by_seq.setdefault(p.seq, []).append(p)
    first_slot, slot_count, join_index, start_index = [], [], [], {}
    joined_seqs = [s for s in sorted(by_seq) if len(by_seq[s]) > 1]
    total_slots = sum(len(by_seq[s]) - 1 for s in joined_seqs)
    for j, s in enumerate(joined_seqs):
        seq_pieces = sorted(by_seq[s], key=lambda p: p.global_start)
        first = len(join_index)
        first_slot.append(first)
        slot_count.append(len(seq_pieces) - 1)
        for p in seq_pieces[:-1]:
            join_index.append(p.rank * slots_per_rank + carrying[p.rank].index(p))
        for i, p in enumerate(seq_pieces[1:], start=1):
            # the state entering piece i: the join's start of slot i, or the sequence's end of it
            start_index[p] = first + i if i < len(seq_pieces) - 1 else total_slots + j
    exchange = bool(joined_seqs)

    local = ctx.local_pieces
    carried = [p for p in local if not p.ends_sequence]
    continuing = [p for p in local if not p.starts_sequence]
    own = [p for p in local if p.starts_sequence and p.ends_sequence]
    pre_pieces, post_pieces = list(carried), list(continuing)
    if post_pieces or not pre_pieces:
        post_pieces += own
    else:
        pre_pieces += own
    identity = {p for p in carried if not p.starts_sequence}
    pre = _make_call(pre_pieces, device, identity=identity)
    post = _make_call(post_pieces, device, joined=set(continuing), start_index=start_index)

    # the rank's output: the pre call's pieces that started here, the post call's pieces
    parts = []
    if pre is not None:
        parts += [(p.local_start, 0, off, p.length) for p, off in zip(pre.pieces, pre.offsets)
                  if p.starts_sequence]
    if post is not None:
        parts += [(p.local_start, 1, off, p.length) for p, off in zip(post.pieces, post.offsets)]
    merged: list[list[int]] = []
    for _, call, off, n in sorted(parts):
        if merged and merged[-1][0] == call and merged[-1][1] + merged[-1][2] == off:
            merged[-1][2] += n
        else:
            merged.append([call, off, n])
    empty = [s for s in range(ctx.num_seqs)
             if ctx.cu_seqlens[s] == ctx.cu_seqlens[s + 1] and ctx.final_state_owner(s) == ctx.rank]
    long = dict(dtype=torch.long, device=device)
    send_rows = None
    if exchange:
        send_rows = torch.tensor([i for i, p in enumerate(pre.pieces) if not p.ends_sequence] if pre else [], **long)
    plan = _DeltaRulePlan(
        pre, post, exchange, slots_per_rank, any_transition, send_rows,
        torch.tensor(join_index, **long) if exchange else None,
        join_layout(first_slot, slot_count, device) if exchange else None,
        tuple((c, o, n) for c, o, n in merged), torch.tensor(empty, **long) if empty else None)
    ctx.plans["gated_delta_rule"] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------
def _take(x: torch.Tensor | None, call: _Call) -> torch.Tensor | None:
    """The call's tokens of a [1, T_local, ...] tensor (a view where they are one run)."""
    if x is None:
        return None
    parts = [x.narrow(1, s, e - s) for s, e in call.runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _check(q, k, v, g, beta, gk, initial_state, ctx: CPContext):
    if not isinstance(ctx, CPContext):
        raise TypeError(f"cp_context: expected a CPContext from build_cp_context, got {type(ctx).__name__}")
    check_tensor("q", q, dims=4)
    check_tensor("v", v, dims=4)
    if q.shape[0] != 1:
        raise ValueError(f"q: context parallelism runs on packed sequences: expected batch 1, got {tuple(q.shape)}")
    if q.shape[1] != ctx.local_tokens:
        raise ValueError(f"q: expected this rank's {ctx.local_tokens} tokens along dim 1 "
                         f"(cp_context's shard of {ctx.total_tokens}), got {tuple(q.shape)}")
    if q.device != ctx.device:
        raise ValueError(f"q: expected to be on {ctx.device} like cp_context's cu_seqlens, got {q.device}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dims=4, dtypes=(torch.float32,))
        if initial_state.shape[0] != ctx.num_seqs:
            raise ValueError(f"initial_state: expected {ctx.num_seqs} rows (every sequence of cp_context, "
                             f"the same on every rank), got {tuple(initial_state.shape)}")


def cp_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                              beta: torch.Tensor, scale: float | None = None,
                              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, gk: torch.Tensor | None = None, *,
                              cp_context: CPContext):
    """chunk_gated_delta_rule over packed sequences sharded across the ranks of cp_context.

    q, k [1, T_local, H, K], v [1, T_local, HV, V], g / beta [1, T_local, HV], gk
    [1, T_local, HV, K]: this rank's tokens (cp_context.shard of the global tensors).
    initial_state [N, HV, K, V] fp32: every sequence's, the same on every rank; its gradient on a
    rank covers the sequences that start there (sum it over the group, as for any tensor
    replicated across it). Returns (o [1, T_local, HV, V], final_state [N, HV, K, V] or None):
    final_state holds the sequences that end on this rank (cp_context.final_state_owner) and
    zeros elsewhere, so its sum over the group is the one-process final state.
    """
    _check(q, k, v, g, beta, gk, initial_state, cp_context)
    plan = _plan(cp_context)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    dev = q.device
    wide = plan.any_transition and V + K <= _MAX_STATE_COLUMNS
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, gk, beta, initial_state))

    def run(call: _Call, values, initial, final: bool):
        return chunk_gated_delta_rule(_take(q, call), _take(k, call), values, _take(g, call), _take(beta, call),
                                      scale=scale, initial_state=initial, output_final_state=final,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      cu_seqlens=call.cu_seqlens, gk=_take(gk, call))

    def user_initial(call: _Call):
        if initial_state is None:
            return None
        return initial_state.index_select(0, call.seq_ids)

    outputs, ends = [None, None], [None, None]
    gathered = None
    if plan.pre is not None:
        call = plan.pre
        v_pre, init = _take(v, call), user_initial(call)
        has_identity = call.has_identity
        if has_identity and wide:
            # [v | 0] from [h0 | 0] or [0 | I]: end states [N | M] in one call
            v_pre = torch.cat([v_pre, v_pre.new_zeros(v_pre.shape[:3] + (K,))], -1)
            n = len(call.pieces)
            base = torch.zeros(n, HV, K, V, device=dev) if init is None else init
            base = torch.cat([base, torch.zeros(n, HV, K, K, device=dev)], -1)
            eye = torch.cat([torch.zeros(K, V, device=dev), torch.eye(K, device=dev)], -1)
            init = torch.where(call.identity_rows[:, None, None, None], eye.expand(n, HV, K, V + K), base)
        elif has_identity and init is not None:  # N of a continuing piece: from a zero state
            init = torch.where(call.identity_rows[:, None, None, None], torch.zeros_like(init), init)
        o_pre, end_pre = run(call, v_pre, init, True)
        outputs[0], ends[0] = o_pre[..., :V], end_pre[..., :V]
        send = end_pre
        if has_identity and not wide:
            # M from a call of its own: values of width K zero, from the identity (the pieces
            # that started here need no M: theirs is dropped)
            eye = torch.eye(K, device=dev).expand(len(call.pieces), HV, K, K).contiguous()
            _, m = run(call, v_pre.new_zeros(v_pre.shape[:3] + (K,)), eye, True)
            m = torch.where(call.identity_rows[:, None, None, None], m, torch.zeros_like(m))
            send = torch.cat([end_pre, m], -1)
    width = V + K if plan.any_transition else V
    if plan.exchange:
        rows = send.index_select(0, plan.send_rows) if plan.pre is not None else \
            torch.zeros(0, HV, K, width, device=dev)
        if rows.shape[-1] != width:
            rows = torch.cat([rows, torch.zeros(rows.shape[:3] + (width - rows.shape[-1],), device=dev)], -1)
        pad = plan.slots_per_rank - rows.shape[0]
        if pad:
            rows = torch.cat([rows, torch.zeros(pad, HV, K, width, device=dev)], 0)
        if needs_grad and not rows.requires_grad:
            # every rank must take part in the gather's backward (a collective), also one that
            # sends nothing that depends on its inputs
            rows = rows.detach().requires_grad_(True)
        (gathered,) = gather_shards((rows,), (0,), cp_context.group, "contiguous")
        slots = gathered.index_select(0, plan.join_index)
        local = slots[..., :V]
        transition = slots[..., V:] if plan.any_transition else torch.zeros(slots.shape[:3] + (K,), device=dev)
        starts, finals = join_pieces(transition, local, plan.layout)
        entering = torch.cat([starts, finals], 0)
    if plan.post is not None:
        call = plan.post
        init = user_initial(call)
        if call.has_joined:
            joined = entering.index_select(0, call.start_index)
            base = torch.zeros_like(joined) if init is None else init
            init = torch.where(call.joined_rows[:, None, None, None], joined, base)
        outputs[1], ends[1] = run(call, _take(v, call), init, output_final_state)

    parts = [outputs[c].narrow(1, off, n) for c, off, n in plan.output_parts]
    o = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if o.shape[-1] != V or not o.is_contiguous():
        o = o.contiguous()
    final = None
    if output_final_state:
        final = torch.zeros(cp_context.num_seqs, HV, K, V, device=dev)
        for call, end in ((plan.pre, ends[0]), (plan.post, ends[1])):
            if call is not None and call.final_rows.numel():
                final = final.index_copy(0, call.final_seqs, end.index_select(0, call.final_rows))
        if plan.empty_seqs is not None and initial_state is not None:
            final = final.index_copy(0, plan.empty_seqs, initial_state.index_select(0, plan.empty_seqs))
    if gathered is not None and needs_grad:
        o = _Tie.apply(o, gathered)
        if final is not None:
            final = _Tie.apply(final, gathered)
    return o, final
