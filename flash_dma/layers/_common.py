"""Argument checks and token packing shared by the layers and the transformers integration.

Packing turns a padded batch (a [B, S] padding mask) or packed sequences (cu_seqlens) into one
description, `Packing`, without reading anything back to the host: the real tokens are moved to
the front by a stable sort and the offsets come from a cumulative sum. The ops then read the
offsets back once per offsets tensor, and a Packing is cached per mask tensor, so every layer of a
forward (and its backward) shares that one read.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def check_divides(name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ValueError(f"{name}: {value} is not a multiple of {by_name}={by}")


def check_hidden_states(name: str, x, hidden_size: int, dtypes=None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden_size:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a tensor [batch, seq_len, {hidden_size}], got {shape}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name}: expected one of {[str(d) for d in dtypes]}, got {x.dtype}")


def check_padding_mask(attention_mask, batch: int, seq_len: int, device) -> torch.Tensor:
    """A [B, S] padding mask (bool, or integers 1 = real token, 0 = padding) as bool."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a [batch, seq_len] tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != (batch, seq_len):
        raise ValueError(f"attention_mask: expected a padding mask of shape [{batch}, {seq_len}] "
                         f"(1 = token, 0 = padding), got {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask: expected bool or integer values (1 = token, 0 = padding), "
                        f"got {attention_mask.dtype}")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask: expected to be on {device} like hidden_states, got "
                         f"{attention_mask.device}")
    return attention_mask.bool()


def check_cu_seqlens_arg(cu_seqlens, batch: int, device) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens: expected a 1-D int32/int64 tensor of N + 1 offsets")
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences lie along dim 1 of hidden_states, whose "
                         f"batch must be 1, got {batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected to be on {device} like hidden_states, got {cu_seqlens.device}")
    return cu_seqlens


@dataclass
class Packing:
    """Tokens packed along one axis of length T: sequence n holds rows
    cu_seqlens[n] .. cu_seqlens[n + 1] - 1; rows past cu_seqlens[-1] belong to no sequence."""
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    max_seqlen: int  # a host bound on every length (no read-back)
    positions: torch.Tensor  # int64 [T]: position of each row in its sequence (0 outside)
    in_sequence: torch.Tensor  # bool [T]
    slots: torch.Tensor  # int64 [T]: row of the [N * max_seqlen + 1] sequence layout (last: none)
    # from a padding mask: packed row r holds flat padded token order[r]
    order: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    real: torch.Tensor | None = None  # bool [B, S]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def key_padding_mask(self) -> torch.Tensor:
        """[N, max_seqlen]: True where a sequence has a token."""
        cols = torch.arange(self.max_seqlen, device=self.cu_seqlens.device)
        return cols.view(1, -1) < self.lengths.view(-1, 1)

    def sequence_layout(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] packed rows -> [N, max_seqlen, ...], indexed by position in the sequence
        (zeros where a sequence is shorter)."""
        rows = self.num_seqs * self.max_seqlen
        out = x.new_zeros((rows + 1,) + tuple(x.shape[1:])).index_copy(0, self.slots, x)
        return out[:rows].unflatten(0, (self.num_seqs, self.max_seqlen))

    def guard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """x unchanged, with its gradient set to 0 on rows outside every sequence (along dim): the
        kernels leave those rows of their input gradients unwritten."""
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _ZeroGradOutside.apply(x, self.in_sequence, dim)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] padded -> [B * S, ...] packed (real tokens first)."""
        return x.flatten(0, 1).index_select(0, self.order)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[B * S, ...] packed -> [B, S, ...] padded; padding positions are 0."""
        batch, seq_len = self.real.shape
        out = y.index_select(0, self.inverse).unflatten(0, (batch, seq_len))
        keep = self.real.view(batch, seq_len, *([1] * (y.dim() - 1)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


class _ZeroGradOutside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_sequence, dim):
        ctx.save_for_backward(in_sequence)
        ctx.dim = dim
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (in_sequence,) = ctx.saved_tensors
        shape = [1] * grad.dim()
        shape[ctx.dim] = -1
        keep = in_sequence.view(shape)
        return torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None


def _packing_from_offsets(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> Packing:
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    rows = torch.arange(total, device=device)
    n_seq = cu.numel() - 1
    seq = torch.searchsorted(cu[1:], rows, right=True)  # n_seq for rows past the last offset
    in_sequence = seq < n_seq
    start = cu[seq.clamp(max=n_seq - 1)]
    positions = torch.where(in_sequence, rows - start, 0)
    slots = torch.where(in_sequence, seq * max_seqlen + positions, n_seq * max_seqlen)
    return Packing(cu_seqlens.to(torch.int32), max_seqlen, positions, in_sequence, slots)


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> Packing:
    """Packing of T = total rows already packed by the caller (no read-back)."""
    return _packing_from_offsets(cu_seqlens, total, max_seqlen)


# a mask's Packing, shared by the layers of one forward and its backward
# (keyed by id, holding a weak reference: tensors compare elementwise, so they cannot be dict keys)
_PACKINGS: dict[int, tuple[weakref.ref, int, Packing]] = {}


def packing_from_padding_mask(mask: torch.Tensor) -> Packing:
    """Packing of a padded batch: mask [B, S] (True = token), left, right or any padding."""
    cached = _PACKINGS.get(id(mask))
    if cached is not None and cached[0]() is mask and cached[1] == mask._version:
        return cached[2]
    real = mask.bool()
    batch, seq_len = real.shape
    order = torch.argsort((~real).flatten().to(torch.int8), stable=True)
    inverse = torch.argsort(order)
    lengths = real.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    packing = _packing_from_offsets(cu, batch * seq_len, seq_len)
    packing.order, packing.inverse, packing.real = order, inverse, real
    if not torch.compiler.is_compiling():
        key = id(mask)
        _PACKINGS[key] = (weakref.ref(mask, lambda _, key=key: _PACKINGS.pop(key, None)), mask._version, packing)
    return packing
