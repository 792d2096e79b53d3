"""Input validation of dynamic mask attention: a clear error naming the argument and what was
expected, before anything reaches a kernel."""
from __future__ import annotations

import math

import torch

from ...runtime.validation import check_cu_seqlens, check_head_dim, check_interpreter_dtype, \
    check_same_device, check_tensor, cu_seqlens_values, last_dim_contiguous
from .plan import AttentionProblem

INPUT_DTYPES = (torch.float16, torch.bfloat16)


def check_qkv(q, k, v, varlen: bool) -> None:
    dims = 3 if varlen else 4
    layout = "[total, heads, head_dim]" if varlen else "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dims=dims, dtypes=INPUT_DTYPES)
    check_interpreter_dtype("q", q, (torch.float16,))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected q's dtype {q.dtype}, got k {k.dtype} and v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)} {layout}, got {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} like q, got {k.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head dim {q.shape[-1]} like q, got {k.shape[-1]}")
    check_head_dim("q", q.shape[-1])
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"k: its {kv_heads} heads must divide q's {heads} heads (GQA/MQA)")


def validate_pair(name: str, t, batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int,
                  seqlen_k: int, dtypes, device: torch.device, seq_words: tuple[str, str]):
    """A mask or bias that broadcasts to [batch, num_heads, seqlen_q, seqlen_k] (each dim 1 or
    full, the head dim 1, Hk or H), with a contiguous last dim; None stays None."""
    if t is None:
        return None
    check_tensor(name, t, dims=4, dtypes=dtypes)
    if t.device != device:
        raise ValueError(f"{name}: expected to be on {device} like q, got {t.device}")
    b, h, sq, sk = t.shape
    heads = sorted({1, num_kv_heads, num_heads})
    problems = []
    if b not in (1, batch):
        problems.append(f"dim 0 must be 1 or {batch}")
    if h not in heads:
        problems.append(f"dim 1 must be one of {heads}")
    if sq not in (1, seqlen_q):
        problems.append(f"dim 2 must be 1 or {seqlen_q} ({seq_words[0]})")
    if sk not in (1, seqlen_k):
        problems.append(f"dim 3 must be 1 or {seqlen_k} ({seq_words[1]})")
    if problems:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not broadcast to "
                         f"[{batch}, {num_heads}, {seqlen_q}, {seqlen_k}]: " + "; ".join(problems))
    return last_dim_contiguous(t) if sk > 1 else t


def check_max_seqlens(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name}: expected a non-negative Python int, got {value!r}")


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def deterministic_requested(requested) -> bool:
    """deterministic=True, or torch.use_deterministic_algorithms(True) in effect (as torch's own
    attention backward honours it)."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


def lower_call(q, k, v, attn_mask, attn_bias, is_causal, softmax_scale, varlen: bool,
               cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Checks a call of either attention function and lowers it to its AttentionProblem:
    -> (problem, q, k, v, mask, bias, device), q/k/v/mask/bias as the kernels read them. The eager
    functions and the custom ops (custom_op.py) both call this, so both check alike."""
    check_qkv(q, k, v, varlen=varlen)
    named = {"q": q, "k": k, "v": v}
    if varlen:
        named.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    device = check_same_device({**named, "attn_mask": attn_mask, "attn_bias": attn_bias})
    heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = k.shape[-2]
    if varlen:
        batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch)
        check_max_seqlens(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        cu_seqlens_q = cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        cu_seqlens_k = cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
        seqlen_q, seqlen_k, words = max_seqlen_q, max_seqlen_k, ("max_seqlen_q", "max_seqlen_k")
    else:
        batch, seqlen_q, seqlen_k, words = q.shape[0], q.shape[1], k.shape[1], ("Sq", "Sk")
        cu_seqlens_q = cu_seqlens_k = None
    mask = validate_pair("attn_mask", attn_mask, batch, heads, kv_heads, seqlen_q, seqlen_k,
                         (torch.bool,), device, words)
    bias = validate_pair("attn_bias", attn_bias, batch, heads, kv_heads, seqlen_q, seqlen_k,
                         (q.dtype, torch.float32), device, words)
    problem = AttentionProblem(batch, heads, kv_heads, head_dim, seqlen_q, seqlen_k, varlen, bool(is_causal),
                               softmax_scale_or_default(softmax_scale, head_dim), cu_seqlens_q, cu_seqlens_k)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    return problem, q, k, v, mask, bias, device
