"""Which backend runs an attention call: CuTe (SM90 with the hopper extra) or Triton.

FLASH_DMA_BACKEND in the environment:
- unset or "auto": CuTe where it can run this problem, else Triton (the reason is returned, for
  the plan to log);
- "triton": always Triton;
- "cute": CuTe; where the device or the installed software cannot run it, CuteBackendUnavailable
  says why and how to install. A problem the CuTe backend does not serve (varlen with a mask or
  bias, another head dim) still runs on Triton, with the reason returned: never a wrong answer.
"""
from __future__ import annotations

import os

import torch

from ....runtime.config import choice
from . import availability
from .availability import CuteBackendUnavailable
from .masked import feature_gap as masked_feature_gap
from .plain import plain_feature_gap

BACKEND_ENV = "FLASH_DMA_BACKEND"
# Head dims where auto sends a bias per key ([., ., 1, Sk]) to CuTe: measured there, forward
# 1.15x the Triton backend at B2 H16 S4096 D128 (bench/results/cute-bias-forward-NVIDIA-H200-20261126.txt)
CUTE_PER_KEY_BIAS_HEAD_DIMS = (128,)
BACKEND_CHOICES = ("auto", "triton", "cute")

__all__ = ["BACKEND_ENV", "BACKEND_CHOICES", "CuteBackendUnavailable", "requested_backend",
           "choose_backend", "feature_gap"]


def requested_backend(environ=None) -> str:
    """The backend asked for in FLASH_DMA_BACKEND ("auto" when unset or empty)."""
    value = (os.environ if environ is None else environ).get(BACKEND_ENV, "").strip().lower()
    if value == "":
        return "auto"
    if value not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}: expected one of {', '.join(BACKEND_CHOICES)}, got {value!r}")
    return value


def choose_backend(device, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype,
                   varlen: bool, requested: str | None = None,
                   key_wise_mask: bool = False, bias_per_key: bool = False) -> tuple[str, str]:
    """-> ("cute" | "triton", reason). requested: "auto", "triton" or "cute"; None reads
    FLASH_DMA_BACKEND. The CuTe backend serves plain attention (fixed length and varlen) and
    fixed-length attention with a mask and/or bias (cute/masked.py says which). bias_per_key:
    the bias is 16-bit and broadcast along queries ([B|1, H|Hk|1, 1, Sk], Doge's dynamic-mask
    bias), the shape and types the CuTe direct-bias forward was measured ahead with."""
    if requested is None:
        requested = requested_backend()
    elif requested not in BACKEND_CHOICES:
        raise ValueError(f"requested: expected one of {', '.join(BACKEND_CHOICES)}, got {requested!r}")
    if requested == "triton":
        return "triton", f"{BACKEND_ENV}=triton"
    layout = "varlen" if varlen else "fixed-length"
    # what the CuTe path lacks is known without importing the CuTe stack: asked first
    gap = feature_gap(has_mask=has_mask, has_bias=has_bias, head_dim=head_dim, dtype=dtype,
                      varlen=varlen, key_wise_mask=key_wise_mask)
    if requested == "cute":
        availability.require_cute(device)
        if gap is not None:
            return "triton", f"{BACKEND_ENV}=cute, but {gap}: this {layout} call runs on Triton"
        return "cute", f"{BACKEND_ENV}=cute"
    if gap is not None:
        return "triton", f"auto: {gap}"
    if has_mask:  # bench/results/cute-masked-NVIDIA-H200-20261126.txt: 1/8 tiles, fwd+bwd
        return "triton", ("auto: masks run on Triton (the CuTe mask path measured slower: forward "
                          "0.36x, forward + backward 0.78x); FLASH_DMA_BACKEND=cute forces it")
    if has_bias and not (bias_per_key and head_dim in CUTE_PER_KEY_BIAS_HEAD_DIMS
                         and choice("attention_cute_direct_bias").value):
        # bench/results/cute-bias-forward-NVIDIA-H200-20261126.txt: a [B,H,S,S] bias forward
        # on CuTe (cute/forward_bias.py) 0.92x Triton at D128, 0.70x at D64
        return "triton", ("auto: this bias runs on Triton (the CuTe forward leads only with a 16-bit "
                          "bias per key at head dim "
                          f"{', '.join(map(str, CUTE_PER_KEY_BIAS_HEAD_DIMS))}, read directly); "
                          "FLASH_DMA_BACKEND=cute forces it")
    status = availability.cute_backend_status(device)
    if status is not None:
        return "triton", f"auto: {status}"
    kind = ("plain" if not (has_mask or has_bias) else
            "masked" if not has_bias else "biased" if not has_mask else "masked and biased")
    return "cute", f"auto: SM90 with the CuTe DSL stack, {kind} {layout} attention"


def feature_gap(*, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype,
                varlen: bool, key_wise_mask: bool = False) -> str | None:
    """None when the CuTe backend computes the forward of such a call (device and software not
    looked at); else why not. The backward may still fall back (cute/masked.backward_gap)."""
    if not (has_mask or has_bias):
        return plain_feature_gap(has_mask=False, has_bias=False, head_dim=head_dim, dtype=dtype)
    return masked_feature_gap(has_mask=has_mask, has_bias=has_bias, head_dim=head_dim,
                              dtype=dtype, varlen=varlen, key_wise_mask=key_wise_mask)
