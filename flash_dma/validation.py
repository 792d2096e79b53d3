"""Argument checks shared by the ops: every error names the argument and what was expected."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .hardware import interpreter_active


def check_tensor(name: str, t, *, dims: int | None = None,
                 dtypes: Iterable[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str) -> None:
    """expected: one entry per dim, None where any size is fine."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name}: expected shape {want} ({what}), got {tuple(t.shape)}")


def check_same_device(named: dict[str, torch.Tensor | None]) -> torch.device:
    """All given tensors on one device, and a device the kernels can run on."""
    items = [(n, t) for n, t in named.items() if t is not None]
    first_name, first = items[0]
    for n, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{n}: expected to be on {first.device} like {first_name}, got {t.device}")
    device = first.device
    if device.type == "cuda":
        return device
    if device.type == "cpu" and interpreter_active():
        return device
    if device.type == "cpu":
        raise RuntimeError(
            f"{first_name} is on the CPU: flash-dma's kernels run on a CUDA GPU. Move the tensors "
            "to the GPU (tensor.cuda()), or, for testing on the CPU, run the kernels in Triton's "
            "interpreter by setting TRITON_INTERPRET=1 in the environment before Python starts.")
    raise RuntimeError(f"{first_name}: device {device} is not supported; flash-dma runs on CUDA GPUs")


def check_head_dim(name: str, head_dim: int, limit: int = 256) -> None:
    if head_dim > limit or head_dim % 8 != 0 or head_dim < 8:
        raise ValueError(f"{name}: head dim must be a multiple of 8 between 8 and {limit}, got {head_dim}")


def check_cu_seqlens(name: str, cu: torch.Tensor, count: int | None = None) -> int:
    """cu_seqlens: 1-D int32 cumulative lengths starting at 0; returns the number of sequences."""
    check_tensor(name, cu, dims=1, dtypes=(torch.int32,))
    if cu.numel() < 1:
        raise ValueError(f"{name}: expected N + 1 >= 1 offsets, got an empty tensor")
    if count is not None and cu.numel() != count + 1:
        raise ValueError(f"{name}: expected {count + 1} offsets (N + 1), got {cu.numel()}")
    if not cu.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
    return cu.numel() - 1


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels read rows as contiguous vectors; copy only when the last dim is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()
