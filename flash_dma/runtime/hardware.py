"""What the kernels need to know about the device they run on.

Everything here is read once per device and cached: launch-configuration code calls it on the
hot path, so it must not query the driver each time.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def graph_capturing(device: torch.device) -> bool:
    """True while the current CUDA stream of a CUDA device is being captured into a CUDA graph.
    Work done then only runs at replay: nothing derived from a tensor's contents may be
    remembered for later calls, and host work captured in a graph never runs again."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_guard(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device for the call (what
    FlashAttention's C++ device guard and FLA's input guard do), so that tensors on another GPU
    than the current one work."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: int  # compute capability as major * 10 + minor (90 for Hopper); 0 for the interpreter
    sm_count: int
    shared_memory_per_block: int  # bytes, with the opt-in limit where the driver reports it
    l2_bytes: int

    @property
    def is_hopper(self) -> bool:
        return self.arch == 90


_INTERPRETER_INFO = DeviceInfo(name="triton-interpreter", arch=0, sm_count=1,
                               shared_memory_per_block=1 << 30, l2_bytes=0)


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(
        props, "shared_memory_per_block", 48 * 1024)
    return DeviceInfo(
        name=props.name,
        arch=props.major * 10 + props.minor,
        sm_count=props.multi_processor_count,
        shared_memory_per_block=int(smem),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
    )


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        return _cuda_device_info(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_INFO
