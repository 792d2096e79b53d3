"""How the kernels see the tokens: 64-token chunks of equal-length sequences, or of packed
sequences (cu_seqlens) mapped to chunk slots on the device, without a host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime.config import ceil_div
from ...runtime.rows import zero_rows_past
from ...runtime.tensor_cache import TensorKeyedCache

CHUNK = 64  # tokens per chunk
SUB_ROWS = 16  # rows of the blocks of the WY inverse and of the gated pair products
BLOCKS_PER_CHUNK = CHUNK // SUB_ROWS


@dataclass
class ChunkLayout:
    batch: int  # B (1 with cu_seqlens)
    seq_len: int  # T
    num_seqs: int  # N
    num_slots: int  # programs of the chunk-parallel kernels, per (batch, head)
    num_chunk_states: int  # first dim of the per-chunk state buffers (B * NT, or num_slots)
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None  # [N] first global chunk of each sequence
    chunk_map: torch.Tensor | None  # [num_slots, 2] (sequence or -1, chunk within it)

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    def zero_rows_outside(self, *tensors: torch.Tensor | None) -> None:
        """Varlen: rows past the last offset belong to no sequence and no kernel writes them;
        they are zeroed in place (left as allocated, they would carry garbage into the caller's
        gradients). No host sync."""
        if self.cu_seqlens is not None:
            zero_rows_past(self.cu_seqlens, 1, *tensors)

    def zero_unused_slots(self, states: torch.Tensor) -> None:
        """Varlen: per-chunk buffers have num_chunk_states rows, a bound; the packed sequences'
        chunks take the first rows, and the rest are read by no kernel and hold what was
        allocated. Zeroed in place where such a buffer leaves a custom op, whose outputs must be
        reproducible. No host sync."""
        if self.chunk_map is not None:
            used = (self.chunk_map[:, 0] >= 0).sum().to(torch.int32).view(1)
            zero_rows_past(used, 0, states)


# varlen layouts per cu_seqlens object: every layer and both passes of a step share one
_LAYOUTS = TensorKeyedCache()


def chunk_layout(batch: int, seq_len: int, cu_seqlens: torch.Tensor | None) -> ChunkLayout:
    if cu_seqlens is None:
        nt = ceil_div(seq_len, CHUNK)
        return ChunkLayout(batch, seq_len, batch, nt, chunk_state_count(batch, seq_len, None), None, None, None)
    return _LAYOUTS.get(cu_seqlens, ("layout", seq_len), lambda: varlen_layout(seq_len, cu_seqlens))


def total_chunks(cu_seqlens: torch.Tensor) -> int:
    """Chunks of all packed sequences: read from the device once per cu_seqlens object (the one
    host synchronisation of the public bwd_dhu, which must size dh)."""
    return _LAYOUTS.get(cu_seqlens, ("total_chunks",), lambda: int(_chunk_counts(cu_seqlens).sum()),
                        reuse_in_capture=True)  # (dh's size: fixed in a graph anyway)


def _chunk_counts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK


def chunk_state_count(batch: int, seq_len: int, num_packed: int | None) -> int:
    """The first dimension of the per-chunk state buffers: B * NT, or with num_packed sequences
    (cu_seqlens) a bound known without reading cu_seqlens, as every sequence adds at most one
    partial chunk."""
    if num_packed is None:
        return batch * ceil_div(seq_len, CHUNK)
    return ceil_div(seq_len, CHUNK) + num_packed


def varlen_layout(seq_len: int, cu_seqlens: torch.Tensor) -> ChunkLayout:
    cu = cu_seqlens.to(torch.int32)
    n = cu.numel() - 1
    slots = chunk_state_count(1, seq_len, n)
    counts = _chunk_counts(cu)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    starts = (ends - counts).to(torch.int32)
    slot = torch.arange(slots, device=cu.device, dtype=torch.int32)
    seq = torch.searchsorted(ends, slot, right=True).to(torch.int32)
    used = seq < n
    seq_c = seq.clamp(max=max(n - 1, 0))
    local = slot - starts[seq_c] if n > 0 else slot
    chunk_map = torch.stack([torch.where(used, seq, -1), torch.where(used, local, 0)], 1).contiguous()
    return ChunkLayout(1, seq_len, n, slots, slots, cu, starts.contiguous(), chunk_map)


def longest_first(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The packed sequences' indices, longest first (int32, on the device, no host sync): a
    sequential kernel's programs are dispatched in grid order, so mapping program i to the i-th
    longest sequence starts the longest chains first, and the short ones fill the tail."""
    return _LAYOUTS.get(cu_seqlens, ("longest first",), lambda: torch.argsort(
        cu_seqlens[1:] - cu_seqlens[:-1], descending=True, stable=True).to(torch.int32))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels address [B, T, heads, D] tensors as dense rows."""
    return t if t.is_contiguous() else t.contiguous()
