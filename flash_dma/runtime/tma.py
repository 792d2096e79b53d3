"""Host-side tensor-memory-accelerator (TMA) descriptors, made cheaply on the hot path.

Triton's TensorDescriptor re-validates its block shape and alignment on construction (several
microseconds each, three descriptors per attention launch). Here the block shape is validated
once, by building one descriptor the ordinary way per block shape; later descriptors copy that
one and swap in base, shape and strides. Callers check what changes per call: a 16-byte aligned
base, 16-byte aligned strides with a unit last stride, positive shape entries.
"""
from __future__ import annotations

from typing import Sequence

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

# (dtype, block shape) -> the fields of one validated descriptor, its tensor dropped
_VALIDATED: dict[tuple, dict] = {}


def strides_aligned16(strides: Sequence[int], element_size: int) -> bool:
    """TMA's stride rules: every stride but the last a multiple of 16 bytes, the last 1."""
    return all((s * element_size) % 16 == 0 for s in strides[:-1]) and strides[-1] == 1


def aligned16(t: torch.Tensor, strides: Sequence[int]) -> bool:
    """TMA's alignment rules: base and every stride but the last a multiple of 16 bytes."""
    return t.data_ptr() % 16 == 0 and strides_aligned16(strides, t.element_size())


def descriptor(base: torch.Tensor, shape: list[int], strides: list[int],
               block_shape: list[int]) -> TensorDescriptor:
    """A TensorDescriptor over base's memory; the caller has checked aligned16 and shape > 0."""
    key = (base.dtype, tuple(block_shape))
    fields = _VALIDATED.get(key)
    if fields is None:
        made = TensorDescriptor(base, shape, strides, list(block_shape))
        _VALIDATED[key] = {**made.__dict__, "base": None}  # holds no tensor alive
        return made
    made = object.__new__(TensorDescriptor)
    made.__dict__.update(fields)  # every field Triton defines, then the per-call ones
    made.base, made.shape, made.strides = base, shape, strides
    return made
