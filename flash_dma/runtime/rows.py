"""Rows of a packed (varlen) tensor past its last sequence offset: no kernel writes them, and they
must read 0. Only those rows are written, by a kernel that reads the offset on the device (no
host synchronisation); a masked fill over the whole tensor cost a read and a write of all of it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import ceil_div
from .launch import launch

# Elements per program: most programs find nothing to write (the rows past the end are few), so
# fewer, wider programs cost less.
_BLOCK = 16384


@triton.jit
def zero_past_kernel(x, end, row_elems, numel, BLOCK: tl.constexpr):
    """Zeros the elements of flat x from row end[0] on (row_elems elements a row)."""
    first = tl.load(end).to(tl.int64) * row_elems
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.zeros([BLOCK], dtype=x.dtype.element_ty), mask=(offs >= first) & (offs < numel))


def zero_rows_past(cu_seqlens: torch.Tensor, row_dim: int, *tensors: torch.Tensor | None) -> None:
    """In place: rows (along row_dim, the packed token dim; every dim before it of size 1) at or
    past cu_seqlens[-1] become 0."""
    end = cu_seqlens[-1:]
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        if not t.is_contiguous() or any(s != 1 for s in t.shape[:row_dim]):
            outside = torch.arange(t.shape[row_dim], device=t.device) >= end
            t.masked_fill_(outside.view((1,) * row_dim + (-1,) + (1,) * (t.dim() - row_dim - 1)), 0)
            continue
        row_elems = t.numel() // t.shape[row_dim]
        launch(zero_past_kernel, (ceil_div(t.numel(), _BLOCK),), t, end, row_elems, t.numel(), BLOCK=_BLOCK,
               num_warps=8)
