"""Context parallelism of the chunked gated delta rule over packed sequences.

Each rank holds a shard of the packed tokens (CPContext: contiguous, or zigzag); a sequence may
lie in one rank or run through several, one piece per rank range. Every rank runs ONE op call
over all its pieces, at the same time as the others, and the ranks meet only inside the op's
sequence split (ops/gated_delta_rule/segments.py): the op cuts every piece into segments and
runs them side by side from zero states, then joins them. Here the join also crosses ranks.

Per chunk the state recursion is affine, S' = A S + B, the same A [K, K] for every value column,
so a piece maps the state entering it to the state leaving it by S_end = M S_start + N. The
segments give each piece's N and M cheaply: a join of its segments' (transition, local end
state) from [initial | I] with [local | 0] gives [N | M] (V + K columns, a few small products).

Forward (the state pass's join, `_StateExchange.forward_join`):
1. compose [N | M] of every piece that carries its sequence on to a later rank (N includes the
   sequence's initial state where the piece starts the sequence);
2. one all-gather of those; every rank joins each sequence's pieces left to right
   (S_{j+1} = M_j S_j + N_j, segments.join_segments) and takes the states entering its pieces;
3. the op's own join from those states, and its second state pass: per-chunk states, outputs.
Backward (bwd_dhu's join, `backward_join`): the same right to left. bwd_dhu's transitions are the
forward's, applied transposed; the composed [Nb | Mb] of every piece that continues a sequence from an
earlier rank travels, and each carrying piece gets the state gradient at its end.

Cost against one process: the op as a sequence split would run it (what launch_table's rule
does anyway for long sequences with few heads), plus per layer two joins of V + K columns over a
piece's segments and two all-gathers of [HV, K, V + K] fp32 per carried piece. The backward
recomputes the states from the forward's kept segment starts, with no exchange. The ranks meet
only in one all-gather per direction, each sending what its own first state pass gives (no rank
runs its op after another's, as a pipeline along the sequence would).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..ops.gated_delta_rule.autograd import ChunkGatedDeltaRuleFunction, kept_gate, run_backward
from ..ops.gated_delta_rule.autograd import forward as op_forward
from ..ops.gated_delta_rule.checks import check_op_inputs
from ..ops.gated_delta_rule.interface import op_arguments
from ..ops.gated_delta_rule.layout import as_rows, chunk_layout
from ..ops.gated_delta_rule.plan import plan_context_parallel
from ..ops.gated_delta_rule.segments import SegmentLayout, join_segments
from ..runtime.autograd import first_order_only
from ..runtime.hardware import device_guard
from ..runtime.validation import check_tensor
from .context import CPContext, Piece, _all_gather_single


def join_layout(first_slot: list[int], slot_count: list[int], device) -> SegmentLayout:
    """A SegmentLayout for join_segments, which reads only first_slot and slot_count."""
    unused = torch.zeros(0, dtype=torch.int32, device=device)
    return SegmentLayout(sum(slot_count), 0, unused, unused,
                         torch.tensor(first_slot, dtype=torch.int32, device=device),
                         torch.tensor(slot_count, dtype=torch.int32, device=device))


# ------------------------------------------------------------------------------------------------
# The plan: this rank's pieces, and what travels in each direction
# ------------------------------------------------------------------------------------------------
@dataclass
class _Direction:
    """One direction of the exchange (forward: states; backward: state gradients)."""
    send_rows: torch.Tensor  # long: local pieces whose composed [N | M] this rank sends, in order
    slots_per_rank: int  # rows each rank sends (padded to the largest count)
    join_index: torch.Tensor  # long [S]: gathered row of every join slot
    layout: SegmentLayout  # the join's slots, grouped by sequence
    receive_index: torch.Tensor  # long [n]: row of cat(join starts, finals) each local piece takes
    receives: torch.Tensor  # bool [n]: the pieces that take one
    reverse: bool


@dataclass
class _DeltaRulePlan:
    pieces: tuple[Piece, ...]  # this rank's, in local order (they tile its tokens)
    cu_seqlens: torch.Tensor  # int32 [n + 1]: the pieces as the op's packed sequences
    seq_ids: torch.Tensor  # long [n]: each piece's sequence
    starts_sequence: torch.Tensor  # bool [n]
    final_rows: torch.Tensor  # long: pieces that end their sequence ...
    final_seqs: torch.Tensor  # long: ... and those sequences
    empty_seqs: torch.Tensor | None  # long: empty sequences whose final state this rank returns
    forward: _Direction | None  # None: no sequence crosses a rank boundary
    backward: _Direction | None


def _direction(ctx: CPContext, sends, slots_of, reverse: bool) -> _Direction:
    """sends(piece): whether a piece's composed map travels; slots_of(pieces of a sequence in
    global order): the join's slots (pieces) and, per receiving piece, its row in
    cat(starts, finals) as a function of (first slot, sequence's join index, total slots)."""
    device = ctx.device
    senders = [[p for p in ctx.pieces[r] if sends(p)] for r in range(ctx.world_size)]
    per_rank = max(len(s) for s in senders)
    by_seq: dict[int, list[Piece]] = {}
    for rank_pieces in ctx.pieces:
        for p in rank_pieces:
            by_seq.setdefault(p.seq, []).append(p)
    joined = [s for s in sorted(by_seq) if len(by_seq[s]) > 1]
    seq_pieces = {s: sorted(by_seq[s], key=lambda p: p.global_start) for s in joined}
    total = sum(len(seq_pieces[s]) - 1 for s in joined)
    first_slot, slot_count, join_index, receive = [], [], [], {}
    for j, s in enumerate(joined):
        slots, rows = slots_of(seq_pieces[s])
        first = len(join_index)
        first_slot.append(first)
        slot_count.append(len(slots))
        join_index += [p.rank * per_rank + senders[p.rank].index(p) for p in slots]
        for p, (kind, offset) in rows.items():
            receive[p] = first + offset if kind == "start" else total + j
    long = dict(dtype=torch.long, device=device)
    local = ctx.local_pieces
    return _Direction(
        torch.tensor([i for i, p in enumerate(local) if sends(p)], **long), per_rank,
        torch.tensor(join_index, **long), join_layout(first_slot, slot_count, device),
        torch.tensor([receive.get(p, 0) for p in local], **long),
        torch.tensor([p in receive for p in local], dtype=torch.bool, device=device), reverse)


def _forward_slots(pieces):
    """Forward: slots p_0 .. p_{m-1} (each carries); p_i enters with the join's start of slot i,
    the last with the sequence's final state."""
    m = len(pieces) - 1
    rows = {p: ("start", i) for i, p in enumerate(pieces[1:m], start=1)}
    rows[pieces[m]] = ("final", 0)
    return pieces[:m], rows


def _backward_slots(pieces):
    """Backward (right to left): slots p_1 .. p_m (each sends its start gradient back); p_i
    (0 < i < m) leaves with the join's start of slot p_i (what enters it from the right), p_0
    with the sequence's final gradient."""
    m = len(pieces) - 1
    rows = {p: ("start", i - 1) for i, p in enumerate(pieces[1:m], start=1)}
    rows[pieces[0]] = ("final", 0)
    return pieces[1:], rows


def _plan(ctx: CPContext) -> _DeltaRulePlan:
    plan = ctx.plans.get("gated_delta_rule")
    if plan is not None:
        return plan
    device = ctx.device
    local = ctx.local_pieces
    offsets = [0]
    for p in local:
        if p.local_start != offsets[-1]:
            raise AssertionError(f"rank {ctx.rank}'s pieces do not tile its tokens: {local}")
        offsets.append(offsets[-1] + p.length)
    long = dict(dtype=torch.long, device=device)
    crosses = any(not p.starts_sequence or not p.ends_sequence for r in ctx.pieces for p in r)
    empty = [s for s in range(ctx.num_seqs)
             if ctx.cu_seqlens[s] == ctx.cu_seqlens[s + 1] and ctx.final_state_owner(s) == ctx.rank]
    final_rows = [i for i, p in enumerate(local) if p.ends_sequence]
    plan = _DeltaRulePlan(
        local, torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor([p.seq for p in local], **long),
        torch.tensor([p.starts_sequence for p in local], dtype=torch.bool, device=device),
        torch.tensor(final_rows, **long), torch.tensor([local[i].seq for i in final_rows], **long),
        torch.tensor(empty, **long) if empty else None,
        _direction(ctx, lambda p: not p.ends_sequence, _forward_slots, False) if crosses else None,
        _direction(ctx, lambda p: not p.starts_sequence, _backward_slots, True) if crosses else None)
    ctx.plans["gated_delta_rule"] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# The exchange, inside the op's joins
# ------------------------------------------------------------------------------------------------
class _StateExchange:
    """The joins of one call's state passes (plan.forward_join / backward_join of the op), which
    add what enters each piece from other ranks. Keeps the states entering the pieces (the
    backward recomputes from them)."""

    def __init__(self, plan: _DeltaRulePlan, group, world_size: int):
        self.plan, self.group, self.world_size = plan, group, world_size
        self.piece_starts = None

    def _compose(self, transition, local, seg, start, reverse: bool, transposed: bool) -> torch.Tensor:
        """[N | M] of every piece: its segments joined from [start | I] with [local | 0]."""
        n, HV, K, _ = start.shape
        eye = torch.eye(K, device=local.device, dtype=torch.float32).expand(n, HV, K, K)
        local_ext = torch.cat([local, local.new_zeros(local.shape[:3] + (K,))], -1)
        _, composed = join_segments(transition, local_ext, seg, torch.cat([start, eye], -1), reverse=reverse,
                                    transposed=transposed)
        return composed

    def _exchange(self, direction: _Direction, composed: torch.Tensor, V: int) -> torch.Tensor:
        """What enters each local piece from the other ranks (zeros where nothing does)."""
        rows = composed.index_select(0, direction.send_rows)
        pad = direction.slots_per_rank - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros((pad,) + rows.shape[1:])], 0)
        gathered = rows.new_empty((self.world_size * rows.shape[0],) + rows.shape[1:])
        _all_gather_single(gathered, rows.contiguous(), group=self.group)
        slots = gathered.index_select(0, direction.join_index)
        starts, finals = join_segments(slots[..., V:].contiguous(), slots[..., :V].contiguous(),
                                       direction.layout, None, reverse=direction.reverse)
        entering = torch.cat([starts, finals], 0).index_select(0, direction.receive_index)
        return torch.where(direction.receives[:, None, None, None], entering, torch.zeros_like(entering))

    def _join(self, direction, transition, local, seg, start, reverse: bool, transposed: bool):
        n = self.plan.cu_seqlens.numel() - 1
        HV, K, V = local.shape[1:]
        if start is None:
            start = torch.zeros(n, HV, K, V, device=local.device, dtype=torch.float32)
        start = start.float()
        if direction is not None:
            start = start + self._exchange(direction, self._compose(transition, local, seg, start, reverse, transposed),
                                           V)
        if not reverse:
            self.piece_starts = start
        return join_segments(transition, local, seg, start, reverse=reverse, transposed=transposed)

    def forward_join(self, transition, local, seg, initial, transposed: bool = False):
        return self._join(self.plan.forward, transition, local, seg, initial, False, transposed)

    def backward_join(self, transition, local, seg, dht, transposed: bool = False):
        return self._join(self.plan.backward, transition, local, seg, dht, True, transposed)


class _ContextParallelDeltaRule(torch.autograd.Function):
    """The op over this rank's pieces with the exchange in its joins (a collective in the
    forward and one in the backward: every rank of the group calls both)."""

    @staticmethod
    def forward(ctx, q, k, v, g, gk, beta, scale, piece_initial, cu_seqlens, exchange: _StateExchange):
        layout = chunk_layout(1, q.shape[1], cu_seqlens)
        plan = plan_context_parallel(q, v, g is not None, gk is not None, layout, exchange.forward_join, None)
        with device_guard(q.device):
            o, finals, g_cum, gk_cum, ai, aqk, (seg_starts, seg_transitions, seg_reach), _ = op_forward(
                plan, layout, q, k, v, g, gk, beta, scale, piece_initial, True)
            layout.zero_rows_outside(o)
        # the backward recomputes the states from the segments' starts (no exchange)
        ctx.save_for_backward(q, k, v, g, kept_gate(gk, gk_cum, q, k, v, g, beta, piece_initial), beta,
                              exchange.piece_starts, g_cum, gk_cum, ai, aqk, seg_starts, seg_transitions, seg_reach)
        ctx.layout, ctx.scale = layout, scale
        ctx.plan = replace(plan, forward_join=None, backward_join=exchange.backward_join)
        return o, finals

    @staticmethod
    def backward(ctx, do, dfinals):
        (q, k, v, g, gk, beta, piece_starts, g_cum, gk_cum, ai, aqk, seg_starts, seg_transitions,
         seg_reach) = ctx.saved_tensors
        dq, dk, dv, dg, dgk, dbeta, dh0 = run_backward(ctx.plan, ctx.layout, q, k, v, g, gk, beta, ctx.scale,
                                                       piece_starts, g_cum, ai, aqk, do, dfinals,
                                                       (seg_starts, seg_transitions, seg_reach), gk_cum)
        return first_order_only("cp_chunk_gated_delta_rule",
                                (dq, dk, dv, dg, dgk, dbeta, None, dh0, None, None),
                                (q, k, v, g, gk, beta))


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------
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
    Every rank of the group must call it (and run its backward) for every layer.
    """
    _check(q, k, v, g, beta, gk, initial_state, cp_context)
    plan = _plan(cp_context)
    check_op_inputs(q, k, v, g, beta, None, plan.cu_seqlens, gk, 64)
    HV, K = v.shape[2], q.shape[3]
    q, k, v, g32, gk32, scale, initial_state, pad_v = op_arguments(q, k, v, g, gk, scale, initial_state,
                                                                   use_qk_l2norm_in_kernel)
    V = v.shape[3]
    n = len(plan.pieces)
    if initial_state is not None:
        # a piece that continues a sequence starts from what the exchange brings (added to zero)
        rows = initial_state.index_select(0, plan.seq_ids)
        piece_initial = torch.where(plan.starts_sequence[:, None, None, None], rows, torch.zeros_like(rows))
    elif plan.forward is not None:
        piece_initial = torch.zeros(n, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        piece_initial = None
    beta = as_rows(beta)
    if plan.forward is None:  # no sequence crosses a rank boundary: the op as it is
        with device_guard(q.device):
            o, finals = ChunkGatedDeltaRuleFunction.apply(q, k, v, g32, gk32, beta, scale, piece_initial,
                                                          True, plan.cu_seqlens)
    else:
        exchange = _StateExchange(plan, cp_context.group, cp_context.world_size)
        o, finals = _ContextParallelDeltaRule.apply(q, k, v, g32, gk32, beta, scale, piece_initial,
                                                    plan.cu_seqlens, exchange)
    if pad_v:
        o = o[..., :V - pad_v]
        finals = finals[..., :V - pad_v]
        V -= pad_v
    final = None
    if output_final_state:
        final = torch.zeros(cp_context.num_seqs, HV, K, V, device=q.device, dtype=torch.float32)
        if plan.final_rows.numel():
            final = final.index_copy(0, plan.final_seqs, finals.index_select(0, plan.final_rows))
        if plan.empty_seqs is not None and initial_state is not None:
            given = initial_state[..., :V] if pad_v else initial_state
            final = final.index_copy(0, plan.empty_seqs, given.index_select(0, plan.empty_seqs))
    return o, final
