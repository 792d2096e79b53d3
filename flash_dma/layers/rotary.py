"""Rotary position embedding (RoPE, the half-split convention of Llama / Hugging Face models)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions: `forward(positions)` with positions of any shape
    returns (cos, sin) of shape [*positions.shape, rotary_dim], in fp32.

    rotary_dim: how many leading channels of each head rotate (even, at most the head dim; the
    rest pass through). base: the frequency base (theta)."""

    def __init__(self, rotary_dim: int, base: float = 10000.0):
        super().__init__()
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 \
                or rotary_dim % 2:
            raise ValueError(f"rotary_dim: expected an even int >= 2, got {rotary_dim!r}")
        if not base > 0:
            raise ValueError(f"base: expected a positive frequency base, got {base!r}")
        self.rotary_dim = rotary_dim
        self.base = float(base)
        # Not a buffer: module.to(torch.bfloat16) casts floating buffers, and inverse frequencies
        # rounded to bf16 turn the angle at position p by up to p * 2^-9 radians (4 at 2048)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotary_dim / 2 inverse frequencies in fp32, made once per device."""
        table = self._inv_freq.get(device)
        if table is None:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            table = self._inv_freq[device] = 1.0 / (self.base ** exponents)
        return table

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., S, H, D] by cos/sin [..., S, R] (R <= D even; channels past R unchanged).
    Computed in fp32, returned in x's dtype."""
    rotary_dim = cos.shape[-1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos: rotary dim {rotary_dim} exceeds the head dim {x.shape[-1]} of x")
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated, passed = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated.to(x.dtype), passed), dim=-1)
