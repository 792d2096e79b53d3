"""Which tokens each rank holds under context parallelism, and the differentiable gather of them.

A sequence dimension of S tokens (one sequence of a batch, or the packed tokens of a varlen
batch) is cut into equal shards, one per rank of a process group, in one of two layouts:

- "contiguous": rank r holds tokens [r L, (r + 1) L), L = S / W;
- "zigzag": S is cut into 2W chunks of C = S / (2W) tokens and rank r holds chunks r and
  2W - 1 - r, in that order. Under a causal mask every rank then has the same work (an early
  chunk sees few keys, its partner many), where the contiguous layout leaves the last rank W
  times the work of the first.

A rank's local tokens are its ranges concatenated in global order. `shard` cuts a global tensor
into the local part; `gather_shards` is the inverse across the group, differentiable: its
backward sums each rank's gradient of the whole into the owner's part (a reduce-scatter).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..runtime.validation import check_cu_seqlens

LAYOUTS = ("contiguous", "zigzag")

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def shard_ranges(total: int, world_size: int, rank: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Global [start, end) token ranges of `rank`, in local order (ascending), adjacent ones merged."""
    _check_layout(layout)
    parts = 2 * world_size if layout == "zigzag" else world_size
    if total % parts:
        raise ValueError(f"the sequence dimension ({total} tokens) must split into {parts} equal parts "
                         f"for the {layout!r} layout over {world_size} ranks")
    size = total // parts
    chunks = (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)
    ranges: list[list[int]] = []
    for c in chunks:
        start, end = c * size, (c + 1) * size
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
    return tuple((s, e) for s, e in ranges)


def group_info(group) -> tuple[int, int]:
    """(world size, rank) of a process group (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) before it is used")
    return dist.get_world_size(group), dist.get_rank(group)


def shard(x: torch.Tensor, dim: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """The local part (rank's ranges, concatenated) of a global tensor along `dim`."""
    ranges = shard_ranges(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, s, e - s) for s, e in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _global_order(local_len: int, world_size: int, layout: str):
    """[(rank, offset in the rank's shard, global start, length)] sorted by global start."""
    pieces = []
    for r in range(world_size):
        offset = 0
        for s, e in shard_ranges(local_len * world_size, world_size, r, layout):
            pieces.append((r, offset, s, e - s))
            offset += e - s
    return sorted(pieces, key=lambda p: p[2])


class _GatherShards(torch.autograd.Function):
    """All-gather of each tensor's shard along dim 0, reordered into global order. Backward: the
    gradient of the whole, summed over ranks into each owner's shard (reduce-scatter). Several
    tensors travel in one Function so that every rank issues their collectives in one order,
    forward and backward, whatever order autograd runs the rest of the graph in."""

    @staticmethod
    def forward(ctx, group, world_size: int, layout: str, *shards):
        ctx.group, ctx.world_size, ctx.layout = group, world_size, layout
        ctx.shapes = [t.shape for t in shards]
        gathered, works = [], []
        for t in shards:
            t = t.contiguous()
            buf = torch.empty((world_size * t.shape[0],) + tuple(t.shape[1:]), device=t.device, dtype=t.dtype)
            works.append(_all_gather_single(buf, t, group=group, async_op=True))
            gathered.append(buf)
        for w in works:
            w.wait()
        out = tuple(_to_global(b, world_size, layout) for b in gathered)
        for t, o in zip(shards, out):
            if not t.is_floating_point():
                ctx.mark_non_differentiable(o)
        return out

    @staticmethod
    def backward(ctx, *grads):
        results, works = [], []
        for shape, g, needed in zip(ctx.shapes, grads, ctx.needs_input_grad[3:]):
            if not needed:
                results.append(None)
                continue
            rank_major = _to_rank_major(g.contiguous(), ctx.world_size, ctx.layout)
            out = torch.empty(shape, device=g.device, dtype=g.dtype)
            works.append(_reduce_scatter_single(out, rank_major, group=ctx.group, async_op=True))
            results.append(out)
        for w in works:
            w.wait()
        return (None, None, None) + tuple(results)


def _to_global(rank_major: torch.Tensor, world_size: int, layout: str) -> torch.Tensor:
    local_len = rank_major.shape[0] // world_size
    if layout == "contiguous":
        return rank_major
    parts = [rank_major.narrow(0, r * local_len + off, n)
             for r, off, _, n in _global_order(local_len, world_size, layout)]
    return torch.cat(parts, 0)


def _to_rank_major(global_order: torch.Tensor, world_size: int, layout: str) -> torch.Tensor:
    local_len = global_order.shape[0] // world_size
    if layout == "contiguous":
        return global_order
    pieces = _global_order(local_len, world_size, layout)
    by_rank = sorted(pieces, key=lambda p: (p[0], p[1]))
    return torch.cat([global_order.narrow(0, s, n) for _, _, s, n in by_rank], 0)


def gather_shards(tensors, dims, group=None, layout: str = "contiguous") -> tuple[torch.Tensor, ...]:
    """Each tensor's shards from every rank of `group`, joined along its dim (one of `dims`) in
    global order; differentiable (gradients are summed back into the owners' shards)."""
    _check_layout(layout)
    world_size, _ = group_info(group)
    moved = [t.movedim(d, 0) for t, d in zip(tensors, dims)]
    out = _GatherShards.apply(group, world_size, layout, *moved)
    return tuple(o.movedim(0, d) for o, d in zip(out, dims))


# ------------------------------------------------------------------------------------------------
# Packed sequences (varlen): the pieces of each sequence held by each rank
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """The part of one sequence that lies in one of a rank's ranges."""
    seq: int  # index of the sequence in cu_seqlens
    rank: int
    global_start: int
    global_end: int
    local_start: int  # offset in the rank's local tokens
    seq_start: int  # global bounds of the whole sequence
    seq_end: int

    @property
    def length(self) -> int:
        return self.global_end - self.global_start

    @property
    def starts_sequence(self) -> bool:
        return self.global_start == self.seq_start

    @property
    def ends_sequence(self) -> bool:
        return self.global_end == self.seq_end


def plan_pieces(cu_seqlens: list[int], world_size: int, layout: str) -> tuple[tuple[Piece, ...], ...]:
    """Every rank's pieces in local order (host arithmetic only)."""
    total = cu_seqlens[-1]
    out = []
    for r in range(world_size):
        pieces, offset = [], 0
        for s, e in shard_ranges(total, world_size, r, layout):
            for n in range(len(cu_seqlens) - 1):
                a, b = max(s, cu_seqlens[n]), min(e, cu_seqlens[n + 1])
                if a < b:
                    pieces.append(Piece(n, r, a, b, offset + a - s, cu_seqlens[n], cu_seqlens[n + 1]))
            offset += e - s
        out.append(tuple(pieces))
    return tuple(out)


@dataclass
class CPContext:
    """Context parallelism over packed sequences, built once per batch by build_cp_context and
    passed to every layer: which pieces of which sequences each rank holds. Plans of the ops
    (index tensors, offsets on the device) are made on first use and kept in `plans`."""
    group: object
    world_size: int
    rank: int
    layout: str
    cu_seqlens: tuple[int, ...]  # global offsets, on the host
    pieces: tuple[tuple[Piece, ...], ...]  # per rank, in local order
    device: torch.device
    plans: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def local_tokens(self) -> int:
        return self.total_tokens // self.world_size

    @property
    def local_pieces(self) -> tuple[Piece, ...]:
        return self.pieces[self.rank]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """This rank's global token ranges, in local order."""
        return shard_ranges(self.total_tokens, self.world_size, self.rank, self.layout)

    def final_state_owner(self, seq: int) -> int:
        """The rank that returns sequence `seq`'s final state: the one holding its last token
        (for an empty sequence, the one holding the position where it sits; the last rank at
        the very end)."""
        cu = self.cu_seqlens
        position = cu[seq + 1] - 1 if cu[seq + 1] > cu[seq] else min(cu[seq], self.total_tokens - 1)
        for r in range(self.world_size):
            if any(s <= position < e for s, e in shard_ranges(self.total_tokens, self.world_size, r, self.layout)):
                return r
        raise AssertionError("every position has an owner")

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's local part of a tensor over all packed tokens (dim: the token dim)."""
        if x.shape[dim] != self.total_tokens:
            raise ValueError(f"shard: expected {self.total_tokens} tokens along dim {dim}, got {tuple(x.shape)}")
        return shard(x, dim, self.world_size, self.rank, self.layout)

    def gather(self, *tensors: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, ...]:
        """The local parts of every rank joined in global token order (differentiable)."""
        for t in tensors:
            if t.shape[dim] != self.local_tokens:
                raise ValueError(f"gather: expected {self.local_tokens} local tokens along dim {dim}, "
                                 f"got {tuple(t.shape)}")
        return gather_shards(tensors, [dim] * len(tensors), self.group, self.layout)


def build_cp_context(cu_seqlens: torch.Tensor, group=None, layout: str = "contiguous") -> CPContext:
    """Context parallelism over packed sequences: cu_seqlens [N + 1] (int32/int64) are the global
    offsets of all sequences, the same on every rank of `group` (None: the default group); the
    packed tokens (cu_seqlens[-1] of them, a multiple of the world size, of twice it for
    "zigzag") are split into equal shards by `layout` (see the module docstring). Reads cu_seqlens
    on the host once; build it once per batch and pass it to every layer."""
    check_cu_seqlens("cu_seqlens", cu_seqlens, min_count=1)
    world_size, rank = group_info(group)
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0, got {cu}")
    if cu[-1] == 0:
        raise ValueError("cu_seqlens: the batch holds no tokens")
    _check_layout(layout)
    shard_ranges(cu[-1], world_size, rank, layout)  # checks that the tokens split evenly
    return CPContext(group, world_size, rank, layout, tuple(cu), plan_pieces(cu, world_size, layout),
                     cu_seqlens.device)
