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
from .tma_operands import tma_ready

BACKEND_ENV = "FLASH_DMA_BACKEND"
# Where auto sends a 16-bit bias without a mask to the CuTe forward (direct-bias forward on), by
# the bias's layout: "per_key" [B|1, H|Hk|1, 1, Sk] (Doge's), "dense" [B|1, H|Hk|1, Sq, Sk].
# Measured at B2 S4096 (bench/results/cute-bias-20261126.txt, section 1):
# per key 1.18-1.24x the Triton forward at D128, 1.31x at D256, 0.84x at D64; dense 1.05-1.13x at
# D128 (1.04x causal), 1.15-1.22x at D256. "dense_tma" is a dense bias TMA can load as it lies
# (tma_operands.tma_ready: keys contiguous, 16-byte aligned rows): the TMA forward
# (cute/forward_bias_tma.py) ties the Triton forward at D64 (1.04x on the H100,
# cute-bias-20261126.txt section 3) and the CuTe backward after it leads
# (below), so D64 takes CuTe too.
# A per-key bias at D64: the Triton forward leads (0.381 against 0.440 ms, H100), but the CuTe
# backward after it leads by more (0.90 against 1.36 ms; forward + backward 1.30x), so D64 takes
# CuTe too.
CUTE_BIAS_FORWARD_HEAD_DIMS = {"per_key": (64, 128, 256), "dense": (128, 256),
                               "dense_tma": (64, 128, 256)}
# ... and where its backward (dq, dk, dv, dbias) runs on CuTe too: with one dbias writer per
# entry, a dense bias at D256 (read per element: 1.60x the Triton backward on the H200) and one
# the backward reads and whose dbias it stores by TMA (cute/backward_bias_tma.py) at D64 and
# D128 (H100, B2 H16 S4096: 1.31x the Triton backward at D64, 1.01x at D128, 1.67x at D128
# causal); and a per-key bias at D64 and D128, whose dbias it sums over queries per key tile in
# registers (cute/backward_bias.py; H100, B2 H16 S4096: 1.51x and 1.57x the Triton backward,
# bench/results/cute-bias-20261126.txt, section 4). Elsewhere the Triton backward
# leads, and reads the CuTe forward's out and lse.
CUTE_BIAS_BACKWARD_HEAD_DIMS = {"dense": (256,), "dense_tma": (64, 128, 256), "per_key": (64, 128)}
# ... also where dbias is shared by batches or heads (fp32 atomics): per key, one atomic per key
# and CTA (a [1,H,1,S] bias at D128: 1.54x the Triton backward, H100,
# cute-bias-20261126.txt, section 4); a dense bias's per-score atomics trail.
CUTE_BIAS_BACKWARD_ATOMIC_KINDS = ("per_key",)
BIAS_LAYOUTS = tuple(CUTE_BIAS_FORWARD_HEAD_DIMS)
BIAS_LAYOUT_WORDS = {"per_key": "per key", "dense": "dense", "dense_tma": "dense TMA-loadable"}
BACKEND_CHOICES = ("auto", "triton", "cute")

__all__ = ["BACKEND_ENV", "BACKEND_CHOICES", "CuteBackendUnavailable", "requested_backend",
           "choose_backend", "bias_layout", "auto_backward_on_triton", "feature_gap"]


def requested_backend(environ=None) -> str:
    """The backend asked for in FLASH_DMA_BACKEND ("auto" when unset or empty)."""
    value = (os.environ if environ is None else environ).get(BACKEND_ENV, "").strip().lower()
    if value == "":
        return "auto"
    if value not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV}: expected one of {', '.join(BACKEND_CHOICES)}, got {value!r}")
    return value


def bias_layout(bias: torch.Tensor | None) -> str | None:
    """"per_key", "dense" or "dense_tma" for a 16-bit bias of those layouts (see
    CUTE_BIAS_FORWARD_HEAD_DIMS), else None (no bias, an fp32 bias, or one broadcast along keys)."""
    if bias is None or bias.dtype not in (torch.float16, torch.bfloat16):
        return None
    if bias.shape[-2] == 1:
        return "per_key"
    if bias.shape[-1] == 1:
        return None
    return "dense_tma" if tma_ready(bias, bias.shape[-2], bias.shape[-1]) else "dense"


def choose_backend(device, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype,
                   varlen: bool, requested: str | None = None,
                   key_wise_mask: bool = False, bias_kind: str | None = None) -> tuple[str, str]:
    """-> ("cute" | "triton", reason). requested: "auto", "triton" or "cute"; None reads
    FLASH_DMA_BACKEND. The CuTe backend serves plain attention (fixed length and varlen) and
    fixed-length attention with a mask and/or bias (cute/masked.py says which). bias_kind:
    `bias_layout(bias)`, what auto reads to send a bias where the CuTe forward measured ahead."""
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
    if has_bias and not (head_dim in CUTE_BIAS_FORWARD_HEAD_DIMS.get(bias_kind, ())
                         and choice("attention_cute_direct_bias").value):
        led = "; ".join(f"a 16-bit {BIAS_LAYOUT_WORDS[kind]} bias at head dim {', '.join(map(str, dims))}"
                        for kind, dims in CUTE_BIAS_FORWARD_HEAD_DIMS.items())
        return "triton", (f"auto: this bias runs on Triton (the CuTe forward, reading the bias "
                          f"directly, leads with {led}); FLASH_DMA_BACKEND=cute forces it")
    status = availability.cute_backend_status(device)
    if status is not None:
        return "triton", f"auto: {status}"
    kind = ("plain" if not (has_mask or has_bias) else
            "masked" if not has_bias else "biased" if not has_mask else "masked and biased")
    return "cute", f"auto: SM90 with the CuTe DSL stack, {kind} {layout} attention"


def auto_backward_on_triton(has_mask: bool, head_dim: int, bias_kind: str | None,
                            dbias_reduce: str | None) -> str | None:
    """For a biased call whose forward auto sent to CuTe: why its backward runs on Triton
    instead (the Triton backward leads there), or None to keep it on CuTe."""
    if has_mask:
        return None
    if bias_kind == "dense_tma" and not (choice("attention_cute_bias_tma_backward").value and (
            dbias_reduce is None or choice("attention_cute_dbias_tma").value)):
        bias_kind = "dense"  # the TMA parts turned off: per element
    if head_dim in CUTE_BIAS_BACKWARD_HEAD_DIMS.get(bias_kind, ()) and (
            dbias_reduce != "atomic" or bias_kind in CUTE_BIAS_BACKWARD_ATOMIC_KINDS):
        return None
    return ("auto: the Triton backward leads the CuTe one with this bias (CuTe's leads with a "
            "16-bit bias: dense with one dbias writer per entry at head dim 256, and at head dims "
            f"{', '.join(map(str, CUTE_BIAS_BACKWARD_HEAD_DIMS['dense_tma']))} where TMA can load "
            "it as it lies in memory; per key at head dims "
            f"{', '.join(map(str, CUTE_BIAS_BACKWARD_HEAD_DIMS['per_key']))}); "
            "FLASH_DMA_BACKEND=cute forces it")


def feature_gap(*, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype,
                varlen: bool, key_wise_mask: bool = False) -> str | None:
    """None when the CuTe backend computes the forward of such a call (device and software not
    looked at); else why not. The backward may still fall back (cute/masked.backward_gap)."""
    if not (has_mask or has_bias):
        return plain_feature_gap(has_mask=False, has_bias=False, head_dim=head_dim, dtype=dtype)
    return masked_feature_gap(has_mask=has_mask, has_bias=has_bias, head_dim=head_dim,
                              dtype=dtype, varlen=varlen, key_wise_mask=key_wise_mask)
