"""What TMA can address as it lies in memory: the checks and views the TMA bias paths share
(forward_bias_tma.py, backward_bias_tma.py). Torch only: the plan reads them without importing
the CuTe stack."""
from __future__ import annotations

import torch

# TMA's rules for the global tensor: 16-byte-aligned start and strides (besides the unit one)
TMA_ALIGN_BYTES = 16


def tma_ready(bias: torch.Tensor, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether TMA can load this bias ([B|1, H|Hk|1, Sq, Sk], 16-bit) as it is in memory."""
    if bias.dtype not in (torch.float16, torch.bfloat16) or bias.dim() != 4:
        return False
    if bias.shape[2] != seqlen_q or bias.shape[3] != seqlen_k or bias.stride(3) != 1:
        return False
    step = TMA_ALIGN_BYTES // bias.element_size()
    # the query stride always (tma_view gives size-1 dims its multiple), the others where stepped
    strides_ok = all(bias.stride(d) % step == 0 and bias.stride(d) > 0
                     for d in range(3) if bias.shape[d] > 1 or d == 2)
    return strides_ok and bias.data_ptr() % TMA_ALIGN_BYTES == 0


def tma_view(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the TMA descriptor reads it: its own [Bb, Hb, Sq, Sk] (no stride 0), a size-1
    dim given the query dim's extent as stride (any multiple of 16 bytes serves: never stepped)."""
    outer = bias.stride(2) * bias.shape[2]
    strides = [outer if bias.shape[d] == 1 else bias.stride(d) for d in range(3)] + [1]
    view = bias.detach().as_strided(bias.shape, strides, bias.storage_offset())
    view.__leading_dim__ = 3
    view.__assumed_align__ = TMA_ALIGN_BYTES
    return view


__all__ = ["TMA_ALIGN_BYTES", "tma_ready", "tma_view"]
