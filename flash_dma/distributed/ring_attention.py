"""Context parallelism of dynamic mask attention: the ring form.

Each rank keeps its queries and passes its key/value shard (with a key-wise mask or bias,
[B|1, H|Hk|1, 1, S_local], which travels with its keys) around the ring of ranks r -> r + 1.
At step s rank r holds the block of rank b = r - s (mod W) and computes its own query rows
against it with the op's kernels, while the block for step s + 1 is already on its way:

    forward   step s: post the P2P of the next block, attend to this block, wait for the P2P.
              Partial outputs merge by their log-sum-exp: o = sum_i exp(lse_i - lse) o_i with
              lse = logaddexp_i lse_i (a block where a row sees no key returns lse = +inf: it
              counts as -inf here, and a row that sees no key at all gets +inf back, as the op
              gives).
    backward  the blocks travel the same ring again, each with an fp32 accumulator of its dk, dv
              (and the key-wise dbias): at step s the rank computes its contribution to the
              block in hand (the op's backward given the final output and lse, so P is the
              global softmax: dS = P * (dP - rowsum(dO * O))), then adds the accumulator that
              arrived from the previous holder and sends the sum on; the last holder sends it
              home to the owner. dq and the dbias of a mask/bias sharded by query rows stay
              local.

Which (query rows, keys) pairs of a block are computed is planned on the host per layout
(RingSchedule): a block wholly in the causal future of a rank's queries is skipped, a block in
its past is computed without the causal rule, only the diagonal pairs apply it. With the zigzag
layout every step then costs the same half block on every rank. A block that no later rank of
the ring needs is not sent further (contiguous causal: the last rank is its end), and its
gradient accumulator then goes straight back to its owner. Within a block, tiles a keep-mask
leaves empty are skipped by the kernels' block lists; a block is sent even when its mask is
empty (knowing that would take a host synchronisation).

Streams: on CUDA, ProcessGroupNCCL runs the P2P of torch.distributed.batch_isend_irecv on its
own stream, which waits (by event) for the work issued before on the compute stream; wait()
makes the compute stream wait for the transfer, without a host synchronisation. The transfer
of block s + 1 thus runs beside the kernels of block s.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops.dynamic_mask_attention.autograd import run_backward, run_forward
from ..ops.dynamic_mask_attention.checks import deterministic_requested, lower_call
from ..runtime.autograd import first_order_only
from ..runtime.hardware import device_guard
from .context import shard_ranges


# ------------------------------------------------------------------------------------------------
# The schedule: host arithmetic only, the same on every rank
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingPiece:
    """One kernel call of a step: local query rows against keys of the block in hand."""
    row_start: int  # this rank's local query rows
    rows: int
    key_start: int  # offset in the block's keys
    keys: int
    column: int  # global position of the first key (columns of a mask/bias sharded by query rows)
    causal: bool  # bottom-right aligned: the piece's last query row and last key are one position


@dataclass(frozen=True)
class RingStep:
    """Step s of one rank: the block it holds and what it sends and receives (group ranks)."""
    block: int  # the rank whose keys are in hand
    pieces: tuple[RingPiece, ...]
    send_block_to: int | None  # forward the block for the next step
    recv_block_from: int | None  # the next step's block
    send_grad_to: int | None  # after this step's compute: the block's gradient accumulator
    recv_grad_from: int | None  # the accumulator of the next step's block
    recv_own_grad_from: int | None  # this rank's own keys' finished gradients


def _piece_list(q_ranges, k_ranges, causal: bool, same_block: bool, split_columns: bool):
    """The pieces of queries in q_ranges against keys in k_ranges (global [start, end) ranges in
    local order). split_columns: a piece's keys must be contiguous globally too (a mask or bias
    sharded by query rows is cut by global columns)."""
    local = sum(e - s for s, e in q_ranges)
    if causal and same_block and (len(k_ranges) == 1 or not split_columns):
        # the same tokens on both sides in one ascending order: the local causal rule is the global one
        return (RingPiece(0, local, 0, local, k_ranges[0][0], True),)
    pieces, row = [], 0
    for qs, qe in q_ranges:
        key = 0
        for ks, ke in k_ranges:
            if not causal:
                pieces.append(RingPiece(row, qe - qs, key, ke - ks, ks, False))
            else:
                end = min(ke, qe)  # keys past the last query are in everyone's future
                first = max(qs, ks)  # queries before the first key see none of them
                if end > ks:
                    if first < end:  # the diagonal: rows [first, end) against keys [ks, end)
                        pieces.append(RingPiece(row + first - qs, end - first, key, end - ks, ks, True))
                    if max(first, end) < qe:  # rows after the keys see all of them
                        start = max(first, end)
                        pieces.append(RingPiece(row + start - qs, qe - start, key, end - ks, ks, False))
            key += ke - ks
        row += qe - qs
    return _merged(pieces, split_columns)


def _merged(pieces: list[RingPiece], split_columns: bool) -> tuple[RingPiece, ...]:
    """Fewer, larger calls: full pieces of the same rows with adjacent keys, or of the same keys
    with adjacent rows, become one."""
    pieces = list(pieces)
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(pieces):
            for j, b in enumerate(pieces):
                if i == j or a.causal or b.causal:
                    continue
                if (a.row_start, a.rows) == (b.row_start, b.rows) and a.key_start + a.keys == b.key_start \
                        and (not split_columns or a.column + a.keys == b.column):
                    joined = RingPiece(a.row_start, a.rows, a.key_start, a.keys + b.keys, a.column, False)
                elif (a.key_start, a.keys, a.column) == (b.key_start, b.keys, b.column) \
                        and a.row_start + a.rows == b.row_start:
                    joined = RingPiece(a.row_start, a.rows + b.rows, a.key_start, a.keys, a.column, False)
                else:
                    continue
                pieces = [p for k, p in enumerate(pieces) if k not in (i, j)] + [joined]
                changed = True
                break
            if changed:
                break
    return tuple(sorted(pieces, key=lambda p: (p.row_start, p.key_start)))


@functools.lru_cache(maxsize=64)
def ring_schedules(total: int, world_size: int, layout: str, is_causal: bool,
                   split_columns: bool) -> tuple[tuple[RingStep, ...], ...]:
    """Every rank's steps (indexed by rank), so that each send has its receive on the peer at
    the same step. Block b visits ranks b, b + 1, ... up to the last rank that computes with it
    (step last[b]); its gradient accumulator follows it and then returns to b."""
    ranges = [shard_ranges(total, world_size, r, layout) for r in range(world_size)]
    pieces = {(r, b): _piece_list(ranges[r], ranges[b], is_causal, r == b, split_columns)
              for r in range(world_size) for b in range(world_size)}
    last = [max((s for s in range(world_size) if pieces[(b + s) % world_size, b]), default=0)
            for b in range(world_size)]
    schedules = []
    for r in range(world_size):
        steps = []
        for s in range(world_size):
            b, nb = (r - s) % world_size, (r - s - 1) % world_size
            holds, next_comes = s <= last[b], s + 1 < world_size and s + 1 <= last[nb]
            send_grad = None
            if holds and s < last[b]:
                send_grad = (r + 1) % world_size
            elif holds and s > 0:  # the block's last holder returns its gradients to the owner
                send_grad = b
            steps.append(RingStep(
                block=b, pieces=pieces[(r, b)] if holds else (),
                send_block_to=(r + 1) % world_size if holds and s + 1 <= last[b] else None,
                recv_block_from=(r - 1) % world_size if next_comes else None,
                send_grad_to=send_grad,
                recv_grad_from=(r - 1) % world_size if next_comes else None,
                recv_own_grad_from=(r + s) % world_size if s == last[r] and s > 0 else None))
        schedules.append(tuple(steps))
    return tuple(schedules)


@dataclass(frozen=True, eq=False)
class RingPlan:
    """One ring call's choices: this rank's schedule, the group, the op's flags, and how the
    mask and bias are sharded ("key": travels with the keys; "local": by query rows or
    broadcast; None: absent). exchange=False replaces every transfer by this rank's own block
    (same shapes, same calls, wrong values): the compute-only time of the schedule, for
    benchmarks."""
    group: object
    rank: int
    world_size: int
    global_ranks: tuple[int, ...]  # P2P takes global ranks
    steps: tuple[RingStep, ...]
    is_causal: bool
    softmax_scale: float | None
    deterministic: bool
    mask_kind: str | None
    bias_kind: str | None
    exchange: bool = True

    def traveling(self, k, v, mask, bias) -> list[torch.Tensor]:
        """The tensors that make up a block: k, v and the key-wise mask and bias."""
        out = [k, v]
        if self.mask_kind == "key":
            out.append(mask)
        if self.bias_kind == "key":
            out.append(bias)
        return [t.contiguous() for t in out]


def make_ring_plan(group, world_size: int, rank: int, total: int, layout: str, is_causal: bool,
                   softmax_scale, deterministic: bool, mask, mask_kind, bias, bias_kind,
                   exchange: bool = True) -> RingPlan:
    split_columns = any(kind == "local" and t.shape[3] > 1 for t, kind in ((mask, mask_kind), (bias, bias_kind)))
    steps = ring_schedules(total, world_size, layout, bool(is_causal), split_columns)[rank]
    global_ranks = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(world_size))
    return RingPlan(group, rank, world_size, global_ranks, steps, bool(is_causal), softmax_scale,
                    deterministic_requested(deterministic), mask_kind, bias_kind, exchange)


# ------------------------------------------------------------------------------------------------
# Transfers
# ------------------------------------------------------------------------------------------------
def _post(plan: RingPlan, sends: list[tuple[list[torch.Tensor], int]],
          recvs: list[tuple[list[torch.Tensor], int]]):
    """Asynchronous P2P: each (tensors, peer) of sends goes to peer; for each (templates, peer)
    of recvs, tensors shaped like the templates come from peer. -> (received lists, works)."""
    if not plan.exchange:
        return [list(templates) for templates, _ in recvs], []
    ops, received = [], []
    for tensors, peer in sends:
        ops += [dist.P2POp(dist.isend, t, plan.global_ranks[peer], plan.group) for t in tensors]
    for templates, peer in recvs:
        bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in templates]
        ops += [dist.P2POp(dist.irecv, t, plan.global_ranks[peer], plan.group) for t in bufs]
        received.append(bufs)
    return received, dist.batch_isend_irecv(ops) if ops else []


def _wait(works) -> None:
    for w in works:
        w.wait()


# ------------------------------------------------------------------------------------------------
# One piece: the op's forward and backward passes on slices
# ------------------------------------------------------------------------------------------------
def _pair_slice(t: torch.Tensor | None, kind: str | None, block_t: torch.Tensor | None, piece: RingPiece):
    """The mask or bias of a piece: a key-wise one from the block in hand, one sharded by query
    rows cut to the piece's rows and global key columns (broadcast dims kept)."""
    if kind is None:
        return None
    if kind == "key":
        return block_t.narrow(3, piece.key_start, piece.keys)
    if t.shape[2] > 1:
        t = t.narrow(2, piece.row_start, piece.rows)
    if t.shape[3] > 1:
        t = t.narrow(3, piece.column, piece.keys)
    return t


def _block_parts(plan: RingPlan, block: list[torch.Tensor]):
    """(k, v, key-wise mask or None, key-wise bias or None) of a block."""
    k, v, rest = block[0], block[1], list(block[2:])
    mask = rest.pop(0) if plan.mask_kind == "key" else None
    bias = rest.pop(0) if plan.bias_kind == "key" else None
    return k, v, mask, bias


def _lower_piece(plan: RingPlan, piece: RingPiece, q, block, mask, bias):
    bk, bv, bmask, bbias = _block_parts(plan, block)
    return lower_call(q.narrow(1, piece.row_start, piece.rows), bk.narrow(1, piece.key_start, piece.keys),
                      bv.narrow(1, piece.key_start, piece.keys),
                      _pair_slice(mask, plan.mask_kind, bmask, piece),
                      _pair_slice(bias, plan.bias_kind, bbias, piece), piece.causal, plan.softmax_scale,
                      varlen=False)


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc (fp32 views of some rows: out [B, R, H, D], lse [B, H, R], -inf where nothing is
    merged yet) <- acc merged with one partial result (lse +inf where a row saw no key)."""
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))
    merged = torch.logaddexp(acc_lse, lse)
    base = merged.masked_fill(merged == float("-inf"), 0.0)  # rows still empty: weights exp(-inf) = 0
    w_acc = torch.exp(acc_lse - base).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - base).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.float() * w_new)
    acc_lse.copy_(merged)


# ------------------------------------------------------------------------------------------------
# The autograd Function
# ------------------------------------------------------------------------------------------------
class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, plan: RingPlan):
        B, L, H, D = q.shape
        acc_out = torch.zeros((B, L, H, D), device=q.device, dtype=torch.float32)
        acc_lse = torch.full((B, H, L), float("-inf"), device=q.device, dtype=torch.float32)
        block = plan.traveling(k, v, mask, bias)
        forward_plans = []
        for step in plan.steps:
            recv = [(block, step.recv_block_from)] if step.recv_block_from is not None else []
            send = [(block, step.send_block_to)] if step.send_block_to is not None else []
            received, works = _post(plan, send, recv)
            for piece in step.pieces:
                problem, *args, device = _lower_piece(plan, piece, q, block, mask, bias)
                with device_guard(device):
                    out, lse, fwd_plan = run_forward(problem, *args)
                forward_plans.append(fwd_plan)
                _merge(acc_out.narrow(1, piece.row_start, piece.rows),
                       acc_lse.narrow(2, piece.row_start, piece.rows), out, lse)
            _wait(works)
            block = received[0] if received else None
        out = acc_out.to(q.dtype)
        lse = acc_lse.masked_fill_(acc_lse == float("-inf"), float("inf"))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.plan, ctx.forward_plans = plan, forward_plans
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached out: every gradient is zero
            return None, None, None, None, None, None
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        plan = ctx.plan
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        key_dbias = want_dbias and plan.bias_kind == "key"
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dbias_local = (torch.zeros(bias.shape, device=bias.device, dtype=torch.float32)
                       if want_dbias and not key_dbias else None)
        block = plan.traveling(k, v, mask, bias)
        forward_plans = iter(ctx.forward_plans)
        incoming, grad_works, own = None, [], None
        # what a gradient accumulator looks like (every block has this rank's shapes)
        template = [torch.empty(t.shape, device=t.device, dtype=torch.float32)
                    for t in (k, v) + ((bias,) if key_dbias else ())]
        for s, step in enumerate(plan.steps):
            recv = [(block, step.recv_block_from)] if step.recv_block_from is not None else []
            send = [(block, step.send_block_to)] if step.send_block_to is not None else []
            received, block_works = _post(plan, send, recv)

            contribution = [torch.zeros_like(t) for t in template] if step.pieces else None
            for piece in step.pieces:
                problem, pq, pk, pv, pmask, pbias, _ = _lower_piece(plan, piece, q, block, mask, bias)
                rows = (1, piece.row_start, piece.rows)
                # (the backward reads its delta buffer with lse's strides: a packed slice)
                piece_lse = lse.narrow(2, piece.row_start, piece.rows).contiguous()
                gq, gk, gv, gbias = run_backward(
                    next(forward_plans), pq, pk, pv, out.narrow(*rows), piece_lse, dout.narrow(*rows),
                    pmask, pbias, want_dbias, plan.deterministic)
                dq.narrow(*rows).add_(gq)
                contribution[0].narrow(1, piece.key_start, piece.keys).add_(gk)
                contribution[1].narrow(1, piece.key_start, piece.keys).add_(gv)
                if key_dbias:
                    contribution[2].narrow(3, piece.key_start, piece.keys).add_(gbias)
                elif want_dbias:
                    _pair_slice(dbias_local, "local", None, piece).add_(gbias)

            # the accumulator of this block so far (posted at the previous step) plus ours
            _wait(grad_works)
            acc = incoming
            if contribution is not None:
                acc = contribution if acc is None else [a.add_(c) for a, c in zip(acc, contribution)]
            if acc is None and step.send_grad_to is not None:  # held only to pass it on
                acc = [torch.zeros_like(t) for t in template]
            if s == 0 and step.send_grad_to is None:  # no other rank computes with this rank's keys
                own = acc
            grad_send = [(acc, step.send_grad_to)] if step.send_grad_to is not None else []
            grad_recv = [(template, step.recv_grad_from)] if step.recv_grad_from is not None else []
            if step.recv_own_grad_from is not None:
                grad_recv.append((template, step.recv_own_grad_from))
            grad_received, grad_works = _post(plan, grad_send, grad_recv)
            incoming = grad_received[0] if step.recv_grad_from is not None else None
            if step.recv_own_grad_from is not None:
                own = grad_received[-1]
            _wait(block_works)
            block = received[0] if received else None
        _wait(grad_works)

        dk, dv = own[0].to(k.dtype), own[1].to(v.dtype)
        dbias = None
        if key_dbias:
            dbias = own[2].to(bias.dtype)
        elif want_dbias:
            dbias = dbias_local.to(bias.dtype)
        grads = first_order_only("ring attention", (dq.to(q.dtype), dk, dv, None, dbias), (q, k, v, bias))
        return grads + (None,)


def ring_flash_dma_func(q, k, v, mask, bias, plan: RingPlan):
    """-> (out, lse) of this rank's rows; inputs checked by cp_flash_dma_func."""
    return RingAttentionFunction.apply(q, k, v, mask, bias, plan)


def ring_transfers_only(plan: RingPlan, k, v, mask=None, bias=None, backward: bool = True) -> None:
    """The transfers of one ring call (forward, and with backward the second round with the
    gradient accumulators) with no compute between them: the communication time of the
    schedule alone, for benchmarks."""
    block = plan.traveling(k, v, mask, bias)
    grads = [torch.zeros(t.shape, device=t.device, dtype=torch.float32)
             for t in (k, v) + ((bias,) if plan.bias_kind == "key" else ())]
    for round_ in range(2 if backward else 1):
        for step in plan.steps:
            recv = [(block, step.recv_block_from)] if step.recv_block_from is not None else []
            send = [(block, step.send_block_to)] if step.send_block_to is not None else []
            received, works = _post(plan, send, recv)
            if round_ == 1:
                grad_recv = [(grads, p) for p in (step.recv_grad_from, step.recv_own_grad_from) if p is not None]
                grad_send = [(grads, step.send_grad_to)] if step.send_grad_to is not None else []
                _, grad_works = _post(plan, grad_send, grad_recv)
                works = works + grad_works
            _wait(works)
            if received:
                block = received[0]
