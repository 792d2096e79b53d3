"""Argument checks shared by the ops: every error names the argument and what was expected."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .hardware import graph_capturing, interpreter_active
from .tensor_cache import TensorKeyedCache


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, t, *, dims: int | None = None,
                 dtypes: Iterable[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(_dtype_name(d) for d in dtypes)
            raise TypeError(f"{name}: expected dtype {names}, got {_dtype_name(t.dtype)}")
    return t


def check_interpreter_dtype(name: str, t: torch.Tensor, cpu_dtypes: Iterable[torch.dtype]) -> None:
    """Triton's CPU interpreter computes bf16 matrix products wrongly (Triton 3.6 to 3.8): refuse
    bf16 there rather than return garbage."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and interpreter_active():
        names = " or ".join(_dtype_name(d) for d in cpu_dtypes)
        raise TypeError(
            f"{name}: bfloat16 is not supported in Triton's CPU interpreter (TRITON_INTERPRET=1), "
            f"whose bf16 matrix products are wrong; on the CPU use {names} inputs, or run on a "
            "CUDA GPU for bfloat16")


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


CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens(name: str, cu, count: int | None = None, min_count: int = 0) -> int:
    """cu_seqlens: 1-D int32 or int64 cumulative lengths; returns the number of sequences N. The
    values are checked by cu_seqlens_values."""
    check_tensor(name, cu, dims=1, dtypes=CU_SEQLENS_DTYPES)
    if cu.numel() < min_count + 1:
        raise ValueError(f"{name}: expected N + 1 >= {min_count + 1} offsets, got {cu.numel()}")
    if count is not None and cu.numel() != count + 1:
        raise ValueError(f"{name}: expected {count + 1} offsets (N + 1), got {cu.numel()}")
    return cu.numel() - 1


# checked (and int32) cu_seqlens per tensor object: the forward, the backward and every layer of a
# step pass the same tensor, so its values are read back once, not per call
_CU_SEQLENS = TensorKeyedCache()


def cu_seqlens_values(name: str, cu: torch.Tensor, total: int, max_seqlen: int | None = None,
                      max_name: str = "max_seqlen") -> torch.Tensor:
    """The offsets as a contiguous int32 tensor, after checking their values: 0 first, never
    decreasing, the last at most `total` (the packed tokens), no sequence longer than max_seqlen.
    A kernel given offsets past its tensors would read and write outside them, and one given a
    too-small max_seqlen would leave rows uncomputed, so neither may reach a kernel.

    The values are read back to the host once per tensor object and version (one synchronisation
    when a new cu_seqlens tensor arrives, none after). In CUDA graph capture, where nothing can be
    read back, the same conditions become a device-side assertion, which stops the stream before
    any kernel runs on bad offsets."""
    key = ("values", total, max_seqlen)
    converted = _CU_SEQLENS.get(cu, key, lambda: _checked_cu_seqlens(name, cu, total, max_seqlen, max_name))
    return cu if converted is None else converted


def _checked_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int | None,
                        max_name: str) -> torch.Tensor:
    if total >= 2 ** 31:
        raise ValueError(f"{name}: packed sequences of {total} tokens exceed int32 offsets")
    lengths = cu[1:] - cu[:-1]
    if graph_capturing(cu.device):
        ok = (cu[0] == 0) & (cu[-1] <= total) & (lengths >= 0).all()
        if max_seqlen is not None and lengths.numel():
            ok &= lengths.max() <= max_seqlen
        torch._assert_async(ok, f"{name}: offsets must start at 0, never decrease and end at most "
                                f"at {total}, with no sequence longer than {max_name}")
        return _as_int32(cu)
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: the first offset must be 0, got {values[0]}")
    steps = [b - a for a, b in zip(values, values[1:])]
    bad = next((i for i, step in enumerate(steps) if step < 0), None)
    if bad is not None:
        raise ValueError(f"{name}: offsets must never decrease, got {values[bad]} then {values[bad + 1]} "
                         f"at sequence {bad}")
    if values[-1] > total:
        raise ValueError(f"{name}: the last offset {values[-1]} is past the {total} packed tokens")
    longest = max(steps, default=0)
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"{max_name}: {max_seqlen} is shorter than the longest sequence in {name} "
                         f"({longest} tokens)")
    return _as_int32(cu)


def _as_int32(cu: torch.Tensor) -> torch.Tensor | None:
    """None where cu already is what the kernels read (the cache must not hold its own key)."""
    if cu.dtype == torch.int32 and cu.is_contiguous():
        return None
    return cu.to(torch.int32).contiguous()


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels read rows as contiguous vectors; copy only when the last dim is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()
