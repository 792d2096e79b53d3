"""Values derived from a tensor's contents, remembered per tensor object.

Planning work from a mask or from cu_seqlens costs host time (a dozen small launches) and, where
a size must be read back, a host synchronisation. Training reuses the same mask and cu_seqlens
objects across the forward, the backward and every layer, so the plans are built once per object
(as FLA caches its chunk indices per cu_seqlens tensor).
"""
from __future__ import annotations

import weakref
from typing import Callable, TypeVar

import torch

from .hardware import graph_capturing

T = TypeVar("T")


class TensorKeyedCache:
    """Keyed by the tensor object itself (a weak reference: a freed tensor drops its entries) and
    its version counter (an in-place change rebuilds), then by a key of the caller's."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self.entries: dict[int, tuple] = {}

    def get(self, tensor: torch.Tensor, key: tuple, build: Callable[[], T],
            reuse_in_capture: bool = False) -> T:
        """In CUDA graph capture the value is built without being remembered (unless
        reuse_in_capture: a host value that the captured shapes depend on anyway): the building
        kernels are then captured, so every replay derives it from the tensor's contents at that
        time, where a value remembered before the capture would be replayed unchanged; and a value
        computed only at replay is never handed to a later eager call."""
        if not reuse_in_capture and graph_capturing(tensor.device):
            return build()
        try:
            version = tensor._version
        except (RuntimeError, AttributeError):  # inference tensors carry no version counter
            return build()
        slot = self.entries.get(id(tensor))
        if slot is not None and slot[0]() is tensor and slot[1] == version and key in slot[2]:
            return slot[2][key]
        if slot is None or slot[0]() is not tensor or slot[1] != version:
            if len(self.entries) >= self.capacity:
                self.entries.pop(next(iter(self.entries)))
            tensor_id = id(tensor)
            ref = weakref.ref(tensor, lambda dead, tensor_id=tensor_id: self._drop(tensor_id, dead))
            slot = (ref, version, {})
            self.entries[tensor_id] = slot
        value = build()
        slot[2][key] = value
        return value

    def peek(self, tensor: torch.Tensor, key: tuple):
        """The value remembered for this tensor object at its current version, else None (and
        None in CUDA graph capture: a remembered value would be replayed unchanged while the
        tensor's contents change between replays)."""
        if graph_capturing(tensor.device):
            return None
        slot = self.entries.get(id(tensor))
        try:
            version = tensor._version
        except (RuntimeError, AttributeError):
            return None
        if slot is None or slot[0]() is not tensor or slot[1] != version:
            return None
        return slot[2].get(key)

    def _drop(self, tensor_id: int, dead_ref) -> None:
        slot = self.entries.get(tensor_id)
        if slot is not None and slot[0] is dead_ref:  # not a newer tensor that reuses the id
            del self.entries[tensor_id]
