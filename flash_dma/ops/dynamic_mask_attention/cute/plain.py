"""Plain attention (no mask, no bias) on SM90 through FlashAttention-4's CuTe DSL kernels.

What this serves: fp16/bf16, head dims 64, 96, 128, 192, 256, GQA/MQA, bottom-right causal (FA4
hides key j from query i when j > i + Sk - Sq, as flash-dma does), fixed length or packed varlen
with sequences of length 0 and 1, deterministic backward. Everything else returns a reason from
`supports` and runs on Triton.

Conventions bridged here:
- lse layout is the same ([B, H, Sq] fp32, varlen [H, total_q]). For a row that sees no key FA4
  writes -inf; flash-dma's contract is +inf (so that exp(S - lse) is 0). `forward` rewrites those
  rows where they can occur. FA4's backward takes either: its preprocess maps an lse of -inf to
  0 and reads +inf as is, and with every score of such a row at -inf, P is 0 both ways.
- Inputs: FA4 builds TMA descriptors, which need a unit last stride and 16-byte aligned other
  strides and base; `_tma_ready` copies a tensor that lacks them.

Compilation: FA4 marks every shape and stride dynamic and keys its in-process JIT cache on the
feature set (dtype, head dim, causal, varlen, GQA ratio, deterministic, which dims are broadcast
with stride 0), not on lengths. Two length classes pick other variants, each compiled once per
feature set: the causal or varlen forward where a sequence's query rows fit one tile (Sq, or
max_seqlen_q, times the GQA ratio, heads being packed, within 128 or 192 rows by head dim), and
the backward where Sq fits one query tile or Sk one key tile (64-128 and 48-128 rows by head
dim): at most 2 forward and 4 backward kernels per feature set.
Any other new length compiles nothing (bench/cute_cpu_compile_check.py checks it on CPU).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ....runtime.hardware import device_guard
from . import availability

# Head dims FA4's SM90 kernels are validated for here (tests/ops/dynamic_mask_attention/cute):
# FA4 accepts any multiple of 8 up to 256, but the others have not been checked in this project.
PLAIN_HEAD_DIMS = (64, 96, 128, 192, 256)
PLAIN_DTYPES = (torch.float16, torch.bfloat16)


def plain_feature_gap(*, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype) -> str | None:
    """None when the CuTe plain path computes this problem; else why it does not (the device
    and the installed software are not looked at)."""
    if has_mask and has_bias:
        return "the CuTe backend has no mask or bias path yet (plain attention only)"
    if has_mask:
        return "the CuTe backend has no mask path yet (plain attention only)"
    if has_bias:
        return "the CuTe backend has no bias path yet (plain attention only)"
    if dtype not in PLAIN_DTYPES:
        return f"the CuTe backend takes fp16 or bf16, not {dtype}"
    if head_dim not in PLAIN_HEAD_DIMS:
        return (f"head dim {head_dim} is not among those the CuTe backend is validated for "
                f"({', '.join(map(str, PLAIN_HEAD_DIMS))})")
    return None


@dataclass(frozen=True)
class PlainProblem:
    """What `supports` needs to know of one attention call."""
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    has_mask: bool = False
    has_bias: bool = False
    is_varlen: bool = False
    is_causal: bool = False
    deterministic: bool = False


def supports(problem: PlainProblem) -> str | None:
    """None when `forward`/`backward` serve this problem on its device; else the reason, for the
    plan to log before it runs Triton instead."""
    gap = plain_feature_gap(has_mask=problem.has_mask, has_bias=problem.has_bias,
                            head_dim=problem.head_dim, dtype=problem.dtype)
    if gap is not None:
        return gap
    if problem.num_kv_heads < 1 or problem.num_heads % problem.num_kv_heads:
        return f"{problem.num_kv_heads} kv heads do not divide {problem.num_heads} query heads"
    return availability.cute_backend_status(problem.device)


@functools.lru_cache(maxsize=1)
def _fa4():
    """FA4's interface module, imported on first use (it pulls in the whole CuTe DSL stack)."""
    from flash_attn.cute import interface
    return interface


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can describe it (unit last stride, other strides and the start 16-byte
    aligned), else a contiguous copy. The start is judged by its offset in the storage: torch's
    allocators align storages far beyond 16 bytes."""
    elems = 16 // t.element_size()
    if (t.stride(-1) == 1 and all(s % elems == 0 for s in t.stride()[:-1])
            and t.storage_offset() % elems == 0):
        return t
    return t.contiguous()


def _offsets(cu: torch.Tensor | None) -> torch.Tensor | None:
    if cu is None:
        return None
    return cu.to(torch.int32).contiguous()


def _may_have_empty_rows(q: torch.Tensor, k: torch.Tensor, causal: bool, varlen: bool) -> bool:
    """Whether some query row can see no key: any packed sequence may have no keys, or fewer keys
    than queries under causal (checking would need their lengths on the host); with fixed
    lengths, only Sk == 0, or causal with Sq > Sk."""
    if varlen:
        return True
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    return seqlen_k == 0 or (causal and seqlen_q > seqlen_k)


def _empty_rows_to_plus_inf(lse: torch.Tensor) -> None:
    """FA4's -inf for rows with no visible key -> flash-dma's +inf; one elementwise kernel that
    leaves NaN a NaN."""
    torch.nan_to_num_(lse, nan=math.nan, posinf=math.inf, neginf=math.inf)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] (or packed [total, heads, D] with cu_seqlens_q/k and
    max_seqlen_q/k) -> (out like q, lse fp32 [B, H, Sq] or [H, total_q], +inf for rows that see
    no key). Inputs are assumed checked (shapes, dtypes, devices) and `supports` to have passed."""
    varlen = cu_seqlens_q is not None
    q, k, v = (_tma_ready(t) for t in (q, k, v))
    with device_guard(q.device):
        out, lse = _fa4()._flash_attn_fwd(
            q, k, v, cu_seqlens_q=_offsets(cu_seqlens_q), cu_seqlens_k=_offsets(cu_seqlens_k),
            max_seqlen_q=max_seqlen_q if varlen else None,
            max_seqlen_k=max_seqlen_k if varlen else None,
            softmax_scale=softmax_scale, causal=causal, return_lse=True)[:2]
    if _may_have_empty_rows(q, k, causal, varlen):
        _empty_rows_to_plus_inf(lse)
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, *, causal: bool, softmax_scale: float,
             deterministic: bool = False, cu_seqlens_q: torch.Tensor | None = None,
             cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
             max_seqlen_k: int | None = None):
    """Gradients of `forward` -> (dq, dk, dv) in q's dtype; dk/dv summed over the query heads of
    a GQA group. lse is `forward`'s. deterministic=True fixes the order of every accumulation
    (FA4's semaphore-ordered dq, and dk/dv under GQA)."""
    varlen = cu_seqlens_q is not None
    q, k, v, out, dout = (_tma_ready(t) for t in (q, k, v, out, dout))
    with device_guard(q.device):
        dq, dk, dv = _fa4()._flash_attn_bwd(
            q, k, v, out, dout, lse.contiguous(), softmax_scale=softmax_scale, causal=causal,
            cu_seqlens_q=_offsets(cu_seqlens_q), cu_seqlens_k=_offsets(cu_seqlens_k),
            max_seqlen_q=max_seqlen_q if varlen else None,
            max_seqlen_k=max_seqlen_k if varlen else None,
            deterministic=deterministic)[:3]
    return dq, dk, dv
