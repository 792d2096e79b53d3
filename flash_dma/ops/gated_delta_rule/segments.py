"""Sequence parallelism of the delta rule's state passes: a sequence cut into segments.

The state recursion is affine in the state, chunk by chunk: S_{c+1} = A_c S_c + B_c with A_c a
[K, K] matrix (the decay and the delta rule's projection) and B_c a [K, V] matrix; every column of
S evolves under the same A_c. A segment of chunks [s, e) therefore maps its starting state to its
end state by S_e = M S_s + N, with M = A_{e-1} ... A_s (the state pass run from the identity with
the constant terms left out) and N its local end state (the state pass run from zero). So:

1. every segment of every sequence runs at once: N (V columns, from zero) and M (K columns, from
   the identity, constant terms zero), keeping only the end states;
2. a short sequential join walks each sequence's segments, S_{j+1} = M_j S_j + N_j, from the
   sequence's initial state, giving every segment its true starting state and the final state;
3. every segment runs once more from its true starting state, writing the per-chunk states.

Exact: nothing is truncated, only regrouped (save what fp32 cannot hold; see Decayed segments
below). The backward's state-gradient pass is the same
recursion run right to left on transposed matrices, so it uses the same join with `reverse`.
Context parallelism across GPUs (ranks instead of segments) joins with the same function.

Decayed segments. With a scalar gate each token's map is S -> a_t (I - beta_t k_t k_t^T) S (plus
its constant term), whose norm is at most a_t max(1, |1 - beta_t |k_t|^2|). Summing the logs of
these bounds over chunks [c, e) bounds log |M_[c,e)|: where the bound of a whole segment is below
NEGLIGIBLE_LOG_GAIN, its transition multiplies earlier state by less than fp32's smallest normal
number, and its end state is the local pass from the latest chunk c whose bound to the end is
below it too: S_e = M_[c,e) S_c + N_[c,e), the first term dropped. prepare writes each chunk's
bound (key norms from its key products); reach_of_segment finds each segment's c, or -1
where the segment's bound is not below it (its transition and full local pass then run as above).
The backward's right-to-left pass mirrors it: the state gradient at a segment's start is its
local pass over the leading chunks [s, c') alone, c' the first chunk end whose bound from the
start is below NEGLIGIBLE_LOG_GAIN (the forward keeps these with its cut).
Nothing is dropped that fp32 could hold next to a state of comparable size (the unsplit pass
loses it to rounding too); the dropped transition (zero) stays valid for the backward's reverse
join, |M^T| = |M|.

Segments start at chunk boundaries of their sequence, so chunk-local quantities (gate cumsums,
the WY inverse) are the same whether a sequence is split or not. A sequence always has at least
one segment (an empty one carries its initial state to its final state).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...runtime.config import ceil_div
from ...runtime.hardware import graph_capturing, interpreter_active
from ...runtime.launch import launch
from ...runtime.tensor_cache import TensorKeyedCache

CHUNK = 64
# e^-88 < 1.18e-38, fp32's smallest normal number: a segment whose transition bound is below
# this carries nothing from earlier state that fp32 could add to a state of comparable size.
NEGLIGIBLE_LOG_GAIN = -88.0
_CHUNK = tl.constexpr(CHUNK)
_LOG_GAIN = tl.constexpr(NEGLIGIBLE_LOG_GAIN)


@dataclass(frozen=True)
class SegmentLayout:
    """Segments of the packed sequences, as a varlen layout the state passes read.

    Slots are numbered sequence by sequence, segment by segment; the used ones come first, the
    rest (up to the host-known bound num_slots) have length 0 and start at the last used end."""
    num_slots: int  # host-known upper bound on the segments (grid size)
    chunks_per_segment: int
    cu_seqlens: torch.Tensor  # [num_slots + 1] int32 token bounds of each slot
    chunk_offsets: torch.Tensor  # [num_slots] int32 global chunk index of each slot's first chunk
    first_slot: torch.Tensor  # [N] int32 first slot of each sequence
    slot_count: torch.Tensor  # [N] int32 segments of each sequence (>= 1)


def segment_bound(batch: int, seq_len: int, varlen_seqs: int | None, chunks_per_segment: int) -> int:
    """Host-known upper bound on the segments (slots) of a call: B * ceil(T / segment) for equal
    lengths; with varlen_seqs packed sequences, every sequence adds at most one partial segment,
    and has at least one."""
    seg_tokens = chunks_per_segment * CHUNK
    if varlen_seqs is None:
        return batch * max(ceil_div(seq_len, seg_tokens), 1)
    return ceil_div(seq_len, seg_tokens) + varlen_seqs


def segment_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None,
                   chunks_per_segment: int, device: torch.device) -> SegmentLayout:
    """Cut every sequence into segments of chunks_per_segment chunks (the last one shorter), on
    the device, without a host synchronisation. Equal lengths (cu_seqlens None): B sequences of T
    tokens, addressed as one packed sequence of B * T tokens with per-sequence chunk numbering
    b * NT + c, as the unsplit passes number them."""
    seg_tokens = chunks_per_segment * CHUNK
    if cu_seqlens is None:
        nt = ceil_div(seq_len, CHUNK)
        starts = torch.arange(batch, device=device, dtype=torch.int64) * seq_len
        lengths = torch.full((batch,), seq_len, device=device, dtype=torch.int64)
        chunk0 = torch.arange(batch, device=device, dtype=torch.int64) * nt
        bound = segment_bound(batch, seq_len, None, chunks_per_segment)
        end_all = torch.full((1,), batch * seq_len, device=device, dtype=torch.int64)
    else:
        cu = cu_seqlens.to(torch.int64)
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        chunk_counts = (lengths + CHUNK - 1) // CHUNK
        chunk0 = torch.cumsum(chunk_counts, 0) - chunk_counts
        bound = segment_bound(1, seq_len, cu.numel() - 1, chunks_per_segment)
        end_all = cu[-1:]
    n = lengths.numel()
    counts = torch.clamp((lengths + seg_tokens - 1) // seg_tokens, min=1)
    ends = torch.cumsum(counts, 0)
    first = ends - counts
    slot = torch.arange(bound, device=device, dtype=torch.int64)
    seq = torch.searchsorted(ends, slot, right=True)
    used = seq < n
    seq_c = seq.clamp(max=max(n - 1, 0))
    local = slot - first[seq_c] if n > 0 else slot
    tok_start = torch.where(used, starts[seq_c] + local * seg_tokens, end_all) if n > 0 else end_all.expand(bound)
    seg_cu = torch.cat([tok_start, end_all]).to(torch.int32)
    offsets = torch.where(used, chunk0[seq_c] + local * chunks_per_segment, 0) if n > 0 else slot * 0
    return SegmentLayout(bound, chunks_per_segment, seg_cu.contiguous(), offsets.to(torch.int32).contiguous(),
                         first.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous())


# Segment layouts, built once and shared by the forward's state pass, the backward's recompute
# and bwd_dhu, and by every layer of a step (each build is a dozen small launches of host time):
# per (B, T, split, device) for equal lengths, per cu_seqlens object for packed sequences.
_FIXED_LAYOUTS: dict = {}
_VARLEN_LAYOUTS = TensorKeyedCache()


def segments_of(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None, chunks_per_segment: int,
                device: torch.device) -> SegmentLayout:
    """segment_layout, remembered (not while a CUDA graph is being captured: its tensors would
    live in the graph's memory pool)."""
    def build():
        return segment_layout(batch, seq_len, cu_seqlens, chunks_per_segment, device)

    if cu_seqlens is not None:
        return _VARLEN_LAYOUTS.get(cu_seqlens, ("segments", seq_len, chunks_per_segment), build)
    if graph_capturing(device):
        return build()
    key = (batch, seq_len, chunks_per_segment, device)
    found = _FIXED_LAYOUTS.get(key)
    if found is None:
        if len(_FIXED_LAYOUTS) >= 64:  # varying shapes: bounded
            _FIXED_LAYOUTS.clear()
        found = _FIXED_LAYOUTS[key] = build()
    return found


@triton.jit
def reach_of_segment(decay_bound, chunk0, n, hv, HV: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """A segment's reach from its n chunks' bounds (from global chunk chunk0; BLOCK >= n): -1 where
    its whole transition bound is not below NEGLIGIBLE_LOG_GAIN (see "Decayed segments"), else
    the latest chunk of the segment (local index) from which its end state is the local pass
    alone; with REVERSE, for the backward's right-to-left pass, the fewest leading chunks whose
    local pass alone gives the state gradient at its start."""
    j = tl.arange(0, BLOCK)
    chunk = chunk0.to(tl.int64) + j
    bound = tl.load(decay_bound + chunk * HV + hv, mask=j < n, other=0.0)
    if REVERSE:
        from_start = tl.cumsum(bound, 0)  # bound of chunks [0, j]
        found = tl.min(tl.where((j < n) & (from_start < _LOG_GAIN), j + 1, BLOCK + 1), 0)
    else:
        to_end = tl.cumsum(bound, 0, reverse=True)  # bound of chunks [j, n)
        found = tl.max(tl.where((j < n) & (to_end < _LOG_GAIN), j, -1), 0)
    whole = tl.sum(bound, 0)
    return tl.where((n > 0) & (whole < _LOG_GAIN), found, -1)


@triton.jit
def segment_reach_kernel(decay_bound, seg_cu, seg_chunk_offsets, reach, HV: tl.constexpr,
                         BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """One program per (segment slot, value head): reach_of_segment into reach (the state pass
    finds its own inline; this serves tests and callers that want the array)."""
    slot = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.cdiv(tl.load(seg_cu + slot + 1) - tl.load(seg_cu + slot), _CHUNK)
    found = reach_of_segment(decay_bound, tl.load(seg_chunk_offsets + slot), n, hv, HV, BLOCK, REVERSE)
    tl.store(reach + slot * HV + hv, found)


def reach_block(seg: SegmentLayout) -> int:
    """reach_of_segment's BLOCK for this cut: its chunks per segment, to a power of two."""
    return triton.next_power_of_2(seg.chunks_per_segment)


def segment_reach(decay_bound: torch.Tensor, seg: SegmentLayout, reverse: bool = False) -> torch.Tensor:
    """decay_bound [chunks, HV] fp32 (prepare's per-chunk bounds) -> [num_slots, HV] int32, -1
    where a segment's transition is kept, else the first chunk of its local pass (with reverse:
    the number of leading chunks the backward's local pass runs, from the last of them)."""
    HV = decay_bound.shape[1]
    reach = torch.empty(seg.num_slots, HV, device=decay_bound.device, dtype=torch.int32)
    launch(segment_reach_kernel, (seg.num_slots, HV), decay_bound, seg.cu_seqlens, seg.chunk_offsets, reach,
           HV=HV, BLOCK=reach_block(seg), REVERSE=reverse)
    return reach


@triton.jit
def _matrix_offsets(rows, cols, K: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Offsets of the [rows, cols] elements of a row-major [K, K] matrix, or of its transpose."""
    if TRANSPOSED:
        return cols[None, :] * K + rows[:, None]
    return rows[:, None] * K + cols[None, :]


@triton.jit
def segment_join_kernel(transition, local, initial, starts, final, first_slot, slot_count,
                        HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, BKR: tl.constexpr, HAS_INITIAL: tl.constexpr,
                        REVERSE: tl.constexpr, PRECISION: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """One program per (V tile, sequence x head): walks the sequence's segments (right to left
    with REVERSE), storing each segment's starting state and ending with the sequence's final
    state, S <- transition[slot] S + local[slot].
    The products run on tensor cores (PRECISION tf32x3 on the GPU: fp32 accuracy; in fp32 FMAs
    each thread held whole K rows of both operands, which spilled to local memory). With
    BKR == BK the state stays in registers and the next step's loads depend only on the loop
    index, so they are prefetched. With BKR < BK (K = 256: an fp32 [K, K] tile does not fit) the
    product is formed in row blocks of BKR, which cannot be gathered back into one register
    tile: the running state then goes through `final` between steps.
    TRANSPOSED: each transition is read as its transpose (the backward's join over the
    forward's transitions, without a transposed copy)."""
    v_tile = tl.program_id(0)
    seq_hv = tl.program_id(1)
    seq = seq_hv // HV
    hv = seq_hv % HV
    krows = tl.arange(0, BK)
    vcols = v_tile * BV + tl.arange(0, BV)
    tile_mask = (krows < K)[:, None] & (vcols < V)[None, :]
    tile_offs = krows[:, None] * V + vcols[None, :]
    own = final + (seq * HV + hv).to(tl.int64) * K * V
    if HAS_INITIAL:
        state = tl.load(initial + (seq * HV + hv).to(tl.int64) * K * V + tile_offs, mask=tile_mask,
                        other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    first = tl.load(first_slot + seq)
    count = tl.load(slot_count + seq)
    for j in range(0, count):
        if REVERSE:
            slot = first + count - 1 - j
        else:
            slot = first + j
        base = (slot * HV + hv).to(tl.int64)
        tl.store(starts + base * K * V + tile_offs, state, mask=tile_mask)
        if BKR == BK:
            acc = tl.load(local + base * K * V + tile_offs, mask=tile_mask, other=0.0)
            m = tl.load(transition + base * K * K + _matrix_offsets(krows, krows, K, TRANSPOSED),
                        mask=(krows < K)[:, None] & (krows < K)[None, :], other=0.0)
            state = tl.dot(m, state, acc=acc, input_precision=PRECISION)
        else:
            for r0 in tl.static_range(0, BK, BKR):
                rows = r0 + tl.arange(0, BKR)
                row_mask = (rows < K)[:, None] & (vcols < V)[None, :]
                acc = tl.load(local + base * K * V + rows[:, None] * V + vcols[None, :], mask=row_mask,
                              other=0.0)
                m = tl.load(transition + base * K * K + _matrix_offsets(rows, krows, K, TRANSPOSED),
                            mask=(rows < K)[:, None] & (krows < K)[None, :], other=0.0)
                acc = tl.dot(m, state, acc=acc, input_precision=PRECISION)
                tl.store(own + rows[:, None] * V + vcols[None, :], acc, mask=row_mask)
            tl.debug_barrier()  # every row block stored before the whole state is read back
            state = tl.load(own + tile_offs, mask=tile_mask, other=0.0)
            tl.debug_barrier()  # read by every thread before the next step overwrites it
    tl.store(own + tile_offs, state, mask=tile_mask)


@dataclass(frozen=True)
class JoinTiles:
    """The join kernel's launch: V tile, rows of the transition per product (block_rows < K:
    row blocks, the state through memory between steps), warps, stages, product precision."""
    block_v: int
    block_rows: int
    num_warps: int
    num_stages: int
    precision: str


def join_tiles(K: int, V: int, on_gpu: bool) -> JoinTiles:
    """On the GPU the whole [K, K] transition in one product up to K = 128 (8 warps hold it and
    its tf32x3 halves without spilling) in V tiles of 16 with three stages (the fastest of 18 at
    K = V = 128, bench/sweep_gdn_join.py: twice the programs of 32-wide tiles, each transition
    still read from L2 by a pair's programs); row blocks of 64 beyond, V tiles of 32. In the
    interpreter: small fp32 blocks."""
    bk = max(16, triton.next_power_of_2(K))
    if not on_gpu:
        return JoinTiles(16, min(16, bk), 1, 1, "ieee")
    if bk <= 128:
        return JoinTiles(16, bk, 8, 3, "tf32x3")
    return JoinTiles(min(32, max(16, triton.next_power_of_2(V))), 64, 4, 1, "tf32x3")


def join_segments(transition: torch.Tensor, local: torch.Tensor, layout: SegmentLayout,
                  initial: torch.Tensor | None, reverse: bool = False, transposed: bool = False,
                  tiles: JoinTiles | None = None):
    """transition [num_slots, HV, K, K] fp32 (each segment's M, or M^T for the backward; with
    transposed, the other one: applied as its transpose), local [num_slots, HV, K, V] fp32 (each
    segment's end state from zero), initial [N, HV, K, V] or None (zeros). Returns (starts
    [num_slots, HV, K, V] fp32: each segment's true starting state, final [N, HV, K, V] fp32:
    each sequence's end state). Slots past the used ones keep no start (their
    passes run no chunk and store nothing). tiles: the launch (default join_tiles)."""
    slots, HV, K, V = local.shape
    n = layout.first_slot.numel()
    starts = torch.empty(slots, HV, K, V, device=local.device, dtype=torch.float32)
    final = torch.empty(n, HV, K, V, device=local.device, dtype=torch.float32)
    if n == 0:
        return starts, final
    if tiles is None:
        tiles = join_tiles(K, V, local.device.type == "cuda" and not interpreter_active())
    bk = max(16, triton.next_power_of_2(K))
    launch(segment_join_kernel, (ceil_div(V, tiles.block_v), n * HV),
           transition, local, initial if initial is not None else local, starts, final,
           layout.first_slot, layout.slot_count,
           HV=HV, K=K, V=V, BK=bk, BV=tiles.block_v, BKR=tiles.block_rows, HAS_INITIAL=initial is not None,
           REVERSE=reverse, PRECISION=tiles.precision, TRANSPOSED=transposed, num_warps=tiles.num_warps,
           num_stages=tiles.num_stages)
    return starts, final


def join_segments_reference(transition, local, layout: SegmentLayout, initial, reverse: bool = False,
                            transposed: bool = False):
    """The join in fp64 with a Python loop (tests)."""
    slots, HV, K, V = local.shape
    first, count = layout.first_slot.tolist(), layout.slot_count.tolist()
    starts = torch.zeros(slots, HV, K, V, dtype=torch.float64)
    final = torch.empty(len(first), HV, K, V, dtype=torch.float64)
    for s, (f, c) in enumerate(zip(first, count)):
        state = initial[s].double() if initial is not None else torch.zeros(HV, K, V, dtype=torch.float64)
        order = range(f + c - 1, f - 1, -1) if reverse else range(f, f + c)
        for slot in order:
            starts[slot] = state
            m = transition[slot].double()
            state = (m.mT if transposed else m) @ state + local[slot].double()
        final[s] = state
    return starts, final
