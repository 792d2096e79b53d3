"""Argument checks of the gated delta rule's public functions: a clear error naming the
argument and what was expected."""
from __future__ import annotations

import torch

from ...runtime.validation import (check_cu_seqlens, check_interpreter_dtype, check_same_device, check_shape,
                                   check_tensor, cu_seqlens_values)
from .layout import CHUNK

MAX_HEAD_DIM = 256
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
CPU_FLOATS = (torch.float16, torch.float32)  # in Triton's interpreter (see check_interpreter_dtype)


def check_head_dim(name: str, dim: int) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim must be between 1 and {MAX_HEAD_DIM}, got {dim}")


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size: only {CHUNK} is supported, got {chunk_size}")


def checked_cu_seqlens(cu_seqlens, batch: int, seq_len: int, device):
    """The packed offsets as the kernels read them (int32), their values checked against T."""
    if cu_seqlens is None:
        return None
    check_cu_seqlens("cu_seqlens", cu_seqlens, min_count=1)
    if batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1 (all tokens along T), got B={batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected to be on {device} like q, got {cu_seqlens.device}")
    return cu_seqlens_values("cu_seqlens", cu_seqlens, seq_len)


def check_op_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gk, chunk_size):
    """-> (B, T, H, HV, K, V, cu_seqlens as int32) of chunk_gated_delta_rule's inputs."""
    check_tensor("q", q, dims=4, dtypes=FLOATS)
    check_tensor("k", k, dims=4, dtypes=FLOATS)
    check_tensor("v", v, dims=4, dtypes=FLOATS)
    check_interpreter_dtype("q", q, CPU_FLOATS)
    B, T, H, K = q.shape
    check_shape("k", k, (B, T, H, K), "like q: [B, T, H, K]")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v: expected shape [{B}, {T}, HV, V] (batch and length of q), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: its head count HV={HV} must be a multiple of q's H={H} (grouped value heads)")
    check_head_dim("q", K)
    check_head_dim("v", V)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k, v: expected the dtype of q ({q.dtype}), got k {k.dtype}, v {v.dtype}")
    if g is not None:
        check_tensor("g", g, dtypes=FLOATS)
        check_shape("g", g, (B, T, HV), "[B, T, HV] log decay per value head")
    if gk is not None:
        check_tensor("gk", gk, dtypes=FLOATS)
        check_shape("gk", gk, (B, T, HV, K), "[B, T, HV, K] per-key log decay")
    check_tensor("beta", beta, dtypes=FLOATS)
    check_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    check_chunk_size(chunk_size)
    device = check_same_device({"q": q, "k": k, "v": v, "g": g, "gk": gk, "beta": beta,
                                "initial_state": initial_state})
    cu_seqlens = checked_cu_seqlens(cu_seqlens, B, T, device)
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,))
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        check_shape("initial_state", initial_state, (n, HV, K, V), "[N, HV, K, V], N = number of sequences")
    return B, T, H, HV, K, V, cu_seqlens


def check_bwd_dhu_inputs(q, k, w, do, dv, g, gk, h0, dht, cu_seqlens, chunk_size):
    """-> (device, cu_seqlens as int32) of chunk_gated_delta_rule_bwd_dhu's inputs."""
    for name, t in (("q", q), ("k", k), ("w", w)):
        check_tensor(name, t, dims=4, dtypes=FLOATS)
    check_tensor("do", do, dims=4, dtypes=FLOATS)
    check_tensor("dv", dv, dims=4, dtypes=FLOATS)
    check_interpreter_dtype("q", q, CPU_FLOATS)
    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    check_shape("k", k, (B, T, HQ, K), "like q")
    check_shape("w", w, (B, T, HV, K), "[B, T, HV, K]")
    check_shape("do", do, (B, T, HV, V), "[B, T, HV, V]")
    check_shape("dv", dv, (B, T, HV, V), "like do")
    if HV % HQ != 0:
        raise ValueError(f"q: its head count {HQ} must divide the value heads HV={HV} of do")
    check_head_dim("q", K)
    check_head_dim("do", V)
    check_chunk_size(chunk_size)
    if g is not None:
        check_tensor("g", g, dtypes=(torch.float32,))
        check_shape("g", g, (B, T, HV), "[B, T, HV] chunk-local cumsum, fp32")
    if gk is not None:
        check_tensor("gk", gk, dtypes=(torch.float32,))
        check_shape("gk", gk, (B, T, HV, K), "[B, T, HV, K] chunk-local cumsum, fp32")
    device = check_same_device({"q": q, "k": k, "w": w, "do": do, "dv": dv, "g": g, "gk": gk,
                                "h0": h0, "dht": dht})
    cu_seqlens = checked_cu_seqlens(cu_seqlens, B, T, device)
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    for name, t in (("h0", h0), ("dht", dht)):
        if t is not None:
            check_tensor(name, t, dtypes=(torch.float32,))
            check_shape(name, t, (n, HV, K, V), "[N, HV, K, V] fp32")
    return device, cu_seqlens
