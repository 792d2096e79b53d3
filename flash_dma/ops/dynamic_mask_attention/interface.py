"""Public functions and autograd for dynamic mask attention.

flash_dma_func        q [B, Sq, H, D], k/v [B, Sk, Hk, D]
flash_dma_varlen_func q [total_q, H, D], k/v [total_k, Hk, D], int32 cu_seqlens

Both lower to one internal problem description (`_Problem`) that the kernel launchers read, so the
padded and the packed layouts share every line of launch code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...runtime import tma
from ...runtime.autograd import first_order_only
from ...runtime.config import LaunchConfig, ceil_div, head_dim_block, select_config
from ...runtime.hardware import device_guard, device_info
from ...runtime.launch import launch
from ...runtime.validation import (check_cu_seqlens, check_head_dim, check_interpreter_dtype,
                           check_same_device, check_tensor, cu_seqlens_values, last_dim_contiguous)
from . import kernels
from .sparsity import all_tiles_walk, cached_key_walk, choose_mode

_INPUT_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class _Problem:
    """Shapes and flags of one call, in the kernels' terms."""
    batch: int  # B, or the number of packed sequences
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seqlen_q: int  # fixed length, or max_seqlen_q for varlen
    seqlen_k: int
    is_varlen: bool
    is_causal: bool
    softmax_scale: float
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None

    def row_strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, token, head) strides of q/k/v-like tensors; varlen has no batch axis."""
        s = t.stride()
        if self.is_varlen:
            return 0, s[0], s[1]
        return s[0], s[1], s[2]

    def stat_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        """lse/delta: [B, H, Sq] (batch, head strides) or varlen [H, total_q]."""
        if self.is_varlen:
            return 0, lse.stride(0)
        return lse.stride(0), lse.stride(1)

    def stat_shape(self, total_q: int) -> tuple[int, ...]:
        if self.is_varlen:
            return (self.num_heads, total_q)
        return (self.batch, self.num_heads, self.seqlen_q)


def _pair_strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Strides of a broadcastable [B, H, Sq, Sk] mask or bias, 0 along size-1 dims."""
    if t is None:
        return 0, 0, 0, 0
    shape, stride = t.shape, t.stride()
    return tuple(0 if shape[i] == 1 else stride[i] for i in range(4))


def _pair_flags(t: torch.Tensor | None) -> tuple[bool, bool]:
    """(broadcast along queries, broadcast along keys)."""
    if t is None:
        return False, False
    return t.shape[2] == 1, t.shape[3] == 1


def _validate_pair(name: str, t, batch: int, num_heads: int, num_kv_heads: int, seqlen_q: int,
                   seqlen_k: int, dtypes, device: torch.device, seq_words: tuple[str, str]):
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


def _grid_blocks(length: int, block: int) -> int:
    return max(ceil_div(length, block), 1)


def _pair_args(t: torch.Tensor | None, dummy: torch.Tensor):
    return t if t is not None else dummy


def _attention_forward(pb: _Problem, q, k, v, mask, bias):
    if bias is not None:
        variant = "bias" if bias.element_size() == q.element_size() else "bias-fp32"
    else:
        variant = "plain" if mask is not None else "plain-dense"
    cfg = select_config("attn_fwd", q.device, pb.head_dim, q.dtype, variant)
    mode = choose_mode(mask, pb.num_heads, pb.num_kv_heads)
    walk = cached_key_walk(mask, mode, num_heads=pb.num_heads, seqlen_q=pb.seqlen_q,
                         seqlen_k=pb.seqlen_k, is_causal=pb.is_causal, cu_seqlens_q=pb.cu_q,
                         cu_seqlens_k=pb.cu_k, block_m=cfg.block_m, block_n=cfg.block_n,
                         key_major=False, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(pb.stat_shape(q.shape[0]), device=q.device, dtype=torch.float32)
    dummy = lse  # any tensor: pointer arguments the kernel never reads
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    grid = (_grid_blocks(pb.seqlen_q, cfg.block_m), pb.batch * pb.num_heads)
    k_desc, v_desc = _kv_descriptors(pb, k, v, cfg)
    b_desc = _bias_descriptor(bias, cfg, head_dim_block(pb.head_dim))
    launch(kernels.attn_fwd_kernel, grid,
        q, k, v, k_desc, v_desc, out, lse, _pair_args(mask_u8, dummy), _pair_args(bias, dummy), b_desc,
        pb.cu_q if pb.is_varlen else dummy, pb.cu_k if pb.is_varlen else dummy,
        walk.count, walk.index,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(out),
        *pb.stat_strides(lse), *_pair_strides(mask), *_pair_strides(bias), *walk.strides,
        pb.num_heads, pb.num_heads // pb.num_kv_heads, _head_div(pb, mask), _head_div(pb, bias),
        walk.head_div,
        **_constexprs(pb, cfg, mask, bias, mode), KV_DESC=k_desc is not None,
        BIAS_DESC=b_desc is not None, WARP_SPECIALIZE=cfg.warp_specialize, EXP2_POLY=cfg.exp2_poly,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse, mode


# Descriptors pay up to padded head dim 128 (H200: plain forward D128 0.644 -> 0.560 ms); at 256
# the [block_n, 1, 256] boxes lost to pointer loads (1.57 -> 1.72 ms), so they stop there.
_DESCRIPTOR_MAX_HEAD_DIM = 128


def _before_hopper(t: torch.Tensor) -> bool:
    """A GPU without the tensor-memory accelerator (the interpreter emulates its loads)."""
    return t.device.type == "cuda" and device_info(t.device).arch < 90


def _kv_descriptors(pb: _Problem, k: torch.Tensor, v: torch.Tensor, cfg: LaunchConfig):
    """Tensor-memory-accelerator descriptors over [tokens, Hk, D] views of k and v, for the
    kernels' whole interior key tiles; (None, None) where the device has no TMA (before Hopper)
    or the layout cannot be described (a batch stride that is not Sk token strides, strides or
    base not 16-byte aligned)."""
    if _before_hopper(k):
        return None, None
    if head_dim_block(pb.head_dim) > _DESCRIPTOR_MAX_HEAD_DIM:
        return None, None
    tokens = k.shape[0] if pb.is_varlen else pb.batch * pb.seqlen_k
    if tokens == 0:
        return None, None
    descs = []
    block = [cfg.block_n, 1, head_dim_block(pb.head_dim)]
    for t in (k, v):
        token_stride, head_stride = t.stride(-3), t.stride(-2)
        if not pb.is_varlen and t.stride(0) != pb.seqlen_k * token_stride and pb.batch > 1:
            return None, None
        strides = [token_stride, head_stride, 1]
        if not tma.aligned16(t, strides):
            return None, None
        descs.append(tma.descriptor(t, [tokens, pb.num_kv_heads, pb.head_dim], strides, block))
    return descs[0], descs[1]


# dbias tiles written by TMA stores (asynchronous, and no pointer arithmetic in registers) where
# the gradient is the bias's own full [B, H, Sq, Sk] shape, with (64, 128, 8, 2) tiles at D128
# ("-dbtma" variants): B2 H16 S4096 D128 bias backward 2.781 -> 2.552 ms, causal 2.123 -> 1.923,
# B16 S1024 -7.5%, B2 S8192 -9.1%, 1/8 tiles -5.6%, D64 (its own tiles) -10.3%; with the old
# (32, 128, 8, 2) tiles the stores alone gained nothing (H200,
# bench/results/s13-probes-H200-20261122.txt). Module-level for A/B scripts.
DBIAS_BY_DESCRIPTOR = True


def _dbias_by_descriptor(pb: _Problem, bias: torch.Tensor) -> bool:
    """Whether the key-major kernel writes dbias by TMA stores: its buffer (fresh, packed, the
    bias's shape) is then written tile by tile by one program each (no batch or head sharing, no
    atomics or slots) and _bias_descriptor can describe it."""
    if not DBIAS_BY_DESCRIPTOR or pb.is_varlen or _before_hopper(bias) \
            or head_dim_block(pb.head_dim) > _DESCRIPTOR_MAX_HEAD_DIM:
        return False
    batch_shared, head_share = _bias_sharing(pb, bias.shape)
    _, H, Sq, Sk = bias.shape
    strides = _pair_tile_strides(bias.shape, (H * Sq * Sk, Sq * Sk, Sk, 1))  # the packed buffer's
    return (not batch_shared and head_share == 1 and strides is not None
            and tma.strides_aligned16(strides, bias.element_size()))


def _pair_tile_strides(shape, strides) -> list[int] | None:
    """Descriptor strides of a [B|1, H|1, Sq, Sk] tensor served in whole [block_m, block_n] tiles:
    None unless it varies along both queries and keys and no stepped dim has stride 0."""
    if shape[2] == 1 or shape[3] == 1:
        return None
    strides = list(strides)
    for d in (2, 1, 0):
        if shape[d] == 1:  # never stepped along: give it the packed stride so alignment holds
            strides[d] = strides[d + 1] * shape[d + 1]
        if strides[d] == 0:
            return None
    return strides


def _bias_descriptor(bias: torch.Tensor | None, cfg: LaunchConfig, head_dim: int):
    """A descriptor over a bias (or a dbias buffer) that varies along both queries and keys,
    serving whole [block_m, block_n] tiles; None where there is no TMA or the layout cannot be
    described (an expanded dim with stride 0, a row stride not 16-byte aligned, as for odd Sk)."""
    if bias is None or head_dim > _DESCRIPTOR_MAX_HEAD_DIM or _before_hopper(bias):
        return None
    strides = _pair_tile_strides(bias.shape, bias.stride())
    if strides is None or not tma.aligned16(bias, strides):
        return None
    return tma.descriptor(bias, list(bias.shape), strides, [1, 1, cfg.block_m, cfg.block_n])


def _head_div(pb: _Problem, t: torch.Tensor | None) -> int:
    return pb.num_heads // t.shape[1] if t is not None else 1


def _constexprs(pb: _Problem, cfg: LaunchConfig, mask, bias, mode: int) -> dict:
    mask_q, mask_k = _pair_flags(mask)
    bias_q, bias_k = _pair_flags(bias)
    return dict(
        HEAD_DIM=pb.head_dim, BLOCK_D=head_dim_block(pb.head_dim), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_CAUSAL=pb.is_causal, IS_VARLEN=pb.is_varlen,
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, MASK_Q_BCAST=mask_q,
        MASK_K_BCAST=mask_k, BIAS_Q_BCAST=bias_q, BIAS_K_BCAST=bias_k, KV_MODE=mode,
    )


@dataclass
class _BiasGradPlan:
    """Where the kernel writes dbias and how the result is finished."""
    buffer: torch.Tensor
    atomic: bool
    slot_strides: tuple[int, int, int]  # element offsets per (batch, head-in-share, key block)
    slotted: bool

    def finish(self, bias: torch.Tensor) -> torch.Tensor:
        grad = self.buffer.sum(0) if self.slotted else self.buffer
        return grad.to(bias.dtype)


def _bias_sharing(pb: _Problem, shape) -> tuple[bool, int]:
    """(one bias entry serves every batch, query heads per bias head)."""
    return shape[0] == 1 and pb.batch > 1, pb.num_heads // shape[1]


def _plan_bias_grad(pb: _Problem, bias: torch.Tensor, n_key_programs: int, mode: int,
                    deterministic: bool) -> _BiasGradPlan:
    """Decide how dbias is reduced over the dims the bias broadcasts.

    Within one program, reductions along queries (and keys of one tile) happen in registers.
    Contributions from several programs or heads to one entry (bias shared by batch or by the
    query heads of a group, or broadcast along keys) are added with fp32 atomics, or, when
    deterministic, written to per-contributor slots that are summed in a fixed order afterwards.
    """
    shape = bias.shape
    batch_shared, head_share = _bias_sharing(pb, shape)
    key_shared = shape[3] == 1 and n_key_programs > 1
    cross = batch_shared or head_share > 1 or key_shared
    # entries no program writes (skipped tiles, gathered-away keys, padding) must read 0
    complete = mode == kernels.KV_DENSE and not pb.is_causal and not pb.is_varlen
    if not cross:
        alloc = torch.empty if complete else torch.zeros
        return _BiasGradPlan(alloc(shape, device=bias.device, dtype=bias.dtype), False, (0, 0, 0), False)
    if not deterministic:
        return _BiasGradPlan(torch.zeros(shape, device=bias.device, dtype=torch.float32), True,
                             (0, 0, 0), False)
    n_n = n_key_programs if key_shared else 1
    n_h = head_share if head_share > 1 else 1
    n_b = pb.batch if batch_shared else 1
    numel = math.prod(shape)
    slot_n = numel if key_shared else 0
    slot_h = n_n * numel if head_share > 1 else 0
    slot_b = n_h * n_n * numel if batch_shared else 0
    buffer = torch.zeros((n_b * n_h * n_n, *shape), device=bias.device, dtype=torch.float32)
    return _BiasGradPlan(buffer, False, (slot_b, slot_h, slot_n), True)


def _attention_backward(pb: _Problem, q, k, v, out, lse, dout, mask, bias, mode: int,
                        want_dbias: bool, deterministic: bool):
    dout = last_dim_contiguous(dout)
    variant = "bias" if bias is not None else "plain"
    dummy = lse
    mask_u8 = mask.view(torch.uint8) if mask is not None else None
    cu_q = pb.cu_q if pb.is_varlen else dummy
    cu_k = pb.cu_k if pb.is_varlen else dummy
    kv_group = pb.num_heads // pb.num_kv_heads
    block_d = head_dim_block(pb.head_dim)

    dq_path = _dq_path(pb, q, bias, want_dbias, mode, deterministic)
    dq_acc = dummy
    # the fp32 dq accumulator: cleared by the delta pass where its rows are all of q's rows
    # (varlen: q may hold rows outside every sequence, which must read 0)
    zero_in_delta = dq_path == "fused" and not pb.is_varlen
    if dq_path == "fused":
        dq_acc = (torch.empty if zero_in_delta else torch.zeros)(q.shape, device=q.device,
                                                                 dtype=torch.float32)
    delta = torch.empty_like(lse)
    cfg_delta = 128 if q.device.type == "cuda" else 16
    delta_grid = (_grid_blocks(pb.seqlen_q, cfg_delta), pb.batch * pb.num_heads)
    launch(kernels.attn_bwd_delta_kernel, delta_grid,
        out, dout, delta, dq_acc, cu_q, pb.seqlen_q, *pb.row_strides(out), *pb.row_strides(dout),
        *(pb.row_strides(dq_acc) if zero_in_delta else (0, 0, 0)),
        *pb.stat_strides(lse), pb.num_heads,
        HEAD_DIM=pb.head_dim, BLOCK_D=block_d, BLOCK_M=cfg_delta, IS_VARLEN=pb.is_varlen,
        ZERO_DQ_ACC=zero_in_delta,
    )

    # dk, dv (, dbias), and dq where fused: key-major
    key_mode = _key_major_mode(pb, mask, bias, mode, dq_path)
    every_tile = key_mode != mode and not pb.is_causal  # lists of every tile, all full
    # (gathered key tiles are not contiguous in the bias: pointer stores there)
    dbias_tma = want_dbias and mode != kernels.KV_GATHER and _dbias_by_descriptor(pb, bias)
    cfg = select_config("attn_bwd_dkdv", q.device, pb.head_dim, q.dtype,
                        variant + ("-dbtma" if dbias_tma else "")
                        + ("-dq" if dq_path == "fused" else "")
                        + ("-list" if key_mode == kernels.KV_BLOCK_LIST else "")
                        + ("-full" if every_tile else ""))
    walk_args = dict(num_heads=pb.num_heads, seqlen_q=pb.seqlen_q, seqlen_k=pb.seqlen_k,
                     is_causal=pb.is_causal, block_m=cfg.block_m, block_n=cfg.block_n,
                     key_major=True, device=q.device)
    if key_mode != mode:
        walk = all_tiles_walk(**walk_args)
    else:
        walk = cached_key_walk(mask, mode, cu_seqlens_q=pb.cu_q, cu_seqlens_k=pb.cu_k, **walk_args)
    alloc = torch.zeros if mode == kernels.KV_GATHER else torch.empty  # gathered-away keys: 0
    dk = alloc(k.shape, device=k.device, dtype=k.dtype)
    dv = alloc(v.shape, device=v.device, dtype=v.dtype)
    n_key_programs = _grid_blocks(pb.seqlen_k, cfg.block_n)
    db_plan = _plan_bias_grad(pb, bias, n_key_programs, mode, deterministic) if want_dbias else None
    db_buf = db_plan.buffer if db_plan is not None else dummy
    db_strides = _pair_strides(db_plan.buffer[0] if db_plan and db_plan.slotted else db_buf) \
        if db_plan is not None else (0, 0, 0, 0)
    # no bias descriptor here: the key-major tile wants the bias transposed, and measured on an
    # H200 the transposed TMA tile lost to pointer loads (3.20 vs 3.07 ms, B2 H16 S4096 D128)
    b_desc = None
    dq_desc, dq_mode = None, kernels.DQ_NONE
    db_desc = _bias_descriptor(db_plan.buffer, cfg, head_dim_block(pb.head_dim)) if dbias_tma else None
    if dq_path == "fused":
        dq_desc = _dq_reduce_descriptor(pb, dq_acc, cfg)
        dq_mode = kernels.DQ_TMA_REDUCE if dq_desc is not None else kernels.DQ_ATOMIC
    launch(kernels.attn_bwd_dkdv_kernel, (n_key_programs, pb.batch * pb.num_kv_heads),
        q, k, v, dout, dk, dv, db_buf, lse, delta, _pair_args(mask_u8, dummy), _pair_args(bias, dummy),
        b_desc,
        cu_q, cu_k, walk.count, walk.index, dq_acc, dq_desc, db_desc,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(dout),
        *pb.row_strides(dk), *pb.row_strides(dv),
        *(pb.row_strides(dq_acc) if dq_path == "fused" else (0, 0, 0)), *pb.stat_strides(lse),
        *_pair_strides(mask), *_pair_strides(bias), *db_strides,
        *(db_plan.slot_strides if db_plan is not None else (0, 0, 0)),
        *walk.strides,
        pb.num_heads, kv_group, _head_div(pb, mask), _head_div(pb, bias), walk.head_div,
        **_constexprs(pb, cfg, mask, bias, key_mode),
        HAS_DBIAS=want_dbias, DBIAS_ATOMIC=bool(db_plan is not None and db_plan.atomic),
        KEY_ROWS=kernels.dkdv_key_rows(bias is not None or mask is not None),
        BIAS_DESC=b_desc is not None, DQ_MODE=dq_mode, DBIAS_DESC=db_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

    if dq_path == "fused":
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        _scale_cast(dq_acc, pb.softmax_scale, dq)
    elif dq_path == "matmul":
        dq = _dq_by_matmul(pb, k, db_plan.buffer)
    else:
        dq = _dq_kernel(pb, q, k, v, dout, lse, delta, mask, mask_u8, bias, mode, dummy, cu_q, cu_k,
                        variant, kv_group)
    dbias = db_plan.finish(bias) if db_plan is not None else None
    return dq, dk, dv, dbias


# Without a mask the key-major pass walks block lists of every tile rather than its dense walk
# (the same products) where that measured faster (H200, backward ms, dense -> lists;
# bench/results/s12-probes-H200-20261122.txt): no bias, B4 H16 S4096 D128 4.290 -> 4.098, causal
# 2.377 -> 2.198, D64 -16%, B2 H16 Hk2 S8192 causal -13%, small shapes -1%; a full [B, H, Sq, Sk]
# bias (dq by matmul) B2 H16 S4096 D128 3.072 -> 2.792, causal 2.221 -> 2.123, D64 -20%. Not with a
# bias broadcast along queries ([B, H, 1, Sk]: 2.292 -> 2.576) or other broadcast biases (not
# measured); up to padded head dim 128; fixed lengths (varlen plans would be made per call).
ALL_TILES_LIST_WALK = True


def _key_major_mode(pb: _Problem, mask, bias, mode: int, dq_path: str) -> int:
    if (ALL_TILES_LIST_WALK and mode == kernels.KV_DENSE and mask is None
            and (bias is None or dq_path == "matmul") and not pb.is_varlen
            and head_dim_block(pb.head_dim) <= 128):
        return kernels.KV_BLOCK_LIST
    return mode


def _dq_kernel(pb: _Problem, q, k, v, dout, lse, delta, mask, mask_u8, bias, mode, dummy, cu_q, cu_k,
               variant, kv_group):
    """dq: query-major, walks keys like the forward."""
    cfg = select_config("attn_bwd_dq", q.device, pb.head_dim, q.dtype, variant)
    walk = cached_key_walk(mask, mode, num_heads=pb.num_heads, seqlen_q=pb.seqlen_q,
                         seqlen_k=pb.seqlen_k, is_causal=pb.is_causal, cu_seqlens_q=pb.cu_q,
                         cu_seqlens_k=pb.cu_k, block_m=cfg.block_m, block_n=cfg.block_n,
                         key_major=False, device=q.device)
    dq = torch.empty_like(q)
    k_desc, v_desc = _kv_descriptors(pb, k, v, cfg)
    b_desc = _bias_descriptor(bias, cfg, head_dim_block(pb.head_dim))
    grid = (_grid_blocks(pb.seqlen_q, cfg.block_m), pb.batch * pb.num_heads)
    launch(kernels.attn_bwd_dq_kernel, grid,
        q, k, v, k_desc, v_desc, dout, dq, lse, delta, _pair_args(mask_u8, dummy),
        _pair_args(bias, dummy), b_desc,
        cu_q, cu_k, walk.count, walk.index,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(dout),
        *pb.row_strides(dq), *pb.stat_strides(lse),
        *_pair_strides(mask), *_pair_strides(bias), *walk.strides,
        pb.num_heads, kv_group, _head_div(pb, mask), _head_div(pb, bias), walk.head_div,
        **_constexprs(pb, cfg, mask, bias, mode), KV_DESC=k_desc is not None,
        BIAS_DESC=b_desc is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq


# How dq is computed where dS is not stored (see _dq_path): "fused" (the key-major kernel adds
# dS k into an fp32 accumulator, by TMA bulk reductions where the GPU has them, else by element
# atomics), "atomic" (fused, element atomics always) or "kernel" (a separate query-major kernel).
# Module-level so that tests and bench/ A/B scripts can choose.
DQ_STRATEGY = "fused"
# Fused dq pays up to padded head dim 128 (H200, B4 H16 S4096 plain backward: D128 4.60 -> 4.37 ms,
# D64 2.71 -> 2.68); at 256 the key-major kernel spills with the extra product (7.38 -> 9.02 ms).
_FUSED_DQ_MAX_HEAD_DIM = 128


_SCALE_CAST_BLOCK = 4096


def _scale_cast(src: torch.Tensor, scale: float, dst: torch.Tensor) -> None:
    """dst = src * scale in dst's dtype; both contiguous and of one shape."""
    n = src.numel()
    if n == 0:
        return
    on_gpu = src.device.type == "cuda"  # (the interpreter: small blocks, one warp)
    block = _SCALE_CAST_BLOCK if on_gpu else 256
    launch(kernels.scale_cast_kernel, (ceil_div(n, block),), src, dst, n, scale, BLOCK=block,
           num_warps=8 if on_gpu else 1)


def _dq_path(pb: _Problem, q, bias, want_dbias: bool, mode: int, deterministic: bool) -> str:
    """Where dq comes from: "matmul" (dS is stored anyway, as a full-shape dbias in q's dtype, and
    every tile is computed: dq = scale * dS k is one batched matmul), "fused" (the key-major kernel
    adds dS k into an fp32 accumulator: five matrix products in the backward instead of the seven
    that a separate query-major dq kernel needs, which recomputes q k^T and dO v^T), or "kernel"
    (that separate kernel: deterministic mode, since the accumulation order of atomics is not, and
    head dims where fusing measured slower)."""
    if (want_dbias and not pb.is_varlen and mode == kernels.KV_DENSE and bias.dtype == q.dtype
            and tuple(bias.shape) == (pb.batch, pb.num_heads, pb.seqlen_q, pb.seqlen_k)):
        return "matmul"  # (such a bias is never shared across programs: its gradient is dS itself)
    if deterministic or DQ_STRATEGY == "kernel":
        return "kernel"
    if DQ_STRATEGY == "fused" and head_dim_block(pb.head_dim) > _FUSED_DQ_MAX_HEAD_DIM:
        return "kernel"
    return "fused"


def _dq_reduce_descriptor(pb: _Problem, dq_acc: torch.Tensor, cfg: LaunchConfig):
    """A descriptor over the fp32 dq accumulator viewed as [tokens, H, D], for TMA bulk reductions
    of whole [block_m, 1, D] tiles; None before Hopper, in the interpreter (it has no bulk
    reduction), or where the rows are not 16-byte aligned."""
    if DQ_STRATEGY == "atomic" or dq_acc.device.type != "cuda" or _before_hopper(dq_acc):
        return None
    tokens = dq_acc.shape[0] if pb.is_varlen else pb.batch * pb.seqlen_q
    if tokens == 0 or (pb.head_dim * dq_acc.element_size()) % 16:
        return None
    return tma.descriptor(dq_acc, [tokens, pb.num_heads, pb.head_dim],
                          [pb.num_heads * pb.head_dim, pb.head_dim, 1],
                          [cfg.block_m, 1, head_dim_block(pb.head_dim)])


def _dq_by_matmul(pb: _Problem, k, ds):
    group = pb.num_heads // pb.num_kv_heads
    # [B, H, Sq, Sk] -> [B, Hk, group * Sq, Sk]: the query heads of a group share one k
    ds = ds.view(pb.batch, pb.num_kv_heads, group * pb.seqlen_q, pb.seqlen_k)
    dq = torch.matmul(ds, k.transpose(1, 2)).mul_(pb.softmax_scale)
    dq = dq.view(pb.batch, pb.num_heads, pb.seqlen_q, pb.head_dim).transpose(1, 2)
    return dq.contiguous()


class _DynamicMaskAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, pb: _Problem, deterministic: bool):
        out, lse, mode = _attention_forward(pb, q, k, v, mask, bias)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (a launch per backward)
        ctx.save_for_backward(q, k, v, out, lse, mask, bias)
        ctx.problem, ctx.mode, ctx.deterministic = pb, mode, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached out (lse never carries one): every gradient is zero
            return None, None, None, None, None, None, None
        q, k, v, out, lse, mask, bias = ctx.saved_tensors
        want_dbias = bias is not None and ctx.needs_input_grad[4]
        with device_guard(q.device):
            dq, dk, dv, dbias = _attention_backward(ctx.problem, q, k, v, out, lse, dout, mask, bias,
                                                    ctx.mode, want_dbias, ctx.deterministic)
        return first_order_only("dynamic mask attention", (dq, dk, dv, None, dbias, None, None),
                                (q, k, v, bias))


def _check_qkv(q, k, v, varlen: bool):
    dims = 3 if varlen else 4
    layout = "[total, heads, head_dim]" if varlen else "[batch, seqlen, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dims=dims, dtypes=_INPUT_DTYPES)
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


def _finish(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale: expected a finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def _deterministic(requested) -> bool:
    """deterministic=True, or torch.use_deterministic_algorithms(True) in effect (as torch's own
    attention backward honours it)."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def flash_dma_func(q, k, v, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None,
                   return_lse=False, deterministic=False):
    """Dynamic mask attention: softmax(scale q k^T + attn_bias, hidden where attn_mask is False) v.

    q: [B, Sq, H, D]; k, v: [B, Sk, Hk, D] with H % Hk == 0; fp16 or bf16; D a multiple of 8
    up to 256. attn_mask (bool, True = keep) and attn_bias (q's dtype or fp32) broadcast to
    [B, H, Sq, Sk]: each dim 1 or full, the head dim 1, Hk or H. is_causal hides key j from
    query i when j > i + Sk - Sq. Returns out [B, Sq, H, D], and lse [B, H, Sq] (fp32, natural
    log, +inf for rows that see no key) with return_lse. Gradients reach q, k, v and attn_bias
    (in attn_bias's own shape). By default dq is summed over key tiles with fp32 atomics (and so
    is dbias over broadcast dims): bitwise run-to-run repeatability is not guaranteed.
    deterministic=True (or torch.use_deterministic_algorithms(True)) fixes every reduction order:
    dq from a separate kernel, dbias from one fp32 partial per contributor summed in order.
    """
    _check_qkv(q, k, v, varlen=False)
    device = check_same_device({"q": q, "k": k, "v": v, "attn_mask": attn_mask, "attn_bias": attn_bias})
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    words = ("Sq", "Sk")
    mask = _validate_pair("attn_mask", attn_mask, batch, heads, kv_heads, seqlen_q, seqlen_k,
                          (torch.bool,), device, words)
    bias = _validate_pair("attn_bias", attn_bias, batch, heads, kv_heads, seqlen_q, seqlen_k,
                          (q.dtype, torch.float32), device, words)
    pb = _Problem(batch, heads, kv_heads, head_dim, seqlen_q, seqlen_k, False, bool(is_causal),
                  _scale(softmax_scale, head_dim), None, None)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    with device_guard(device):
        out, lse = _DynamicMaskAttention.apply(q, k, v, mask, bias, pb, _deterministic(deterministic))
    return _finish(out, lse, return_lse)


@torch.compiler.disable  # under torch.compile: a graph break, run eagerly (see README)
def flash_dma_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None,
                          return_lse=False, deterministic=False):
    """Dynamic mask attention over packed sequences.

    q: [total_q, H, D]; k, v: [total_k, Hk, D]; cu_seqlens_q/k: int32 or int64 [N + 1] offsets
    starting at 0, never decreasing, the last at most total_q/total_k; max_seqlen_q/k: host ints,
    at least the longest sequence. The offsets are checked on the host once per tensor (one
    synchronisation the first time a cu_seqlens tensor is seen), so bad values raise a ValueError
    naming the argument instead of reaching a kernel.
    attn_mask/attn_bias are padded per sequence: ({1|N}, {1|Hk|H}, {1|max_seqlen_q},
    {1|max_seqlen_k}), indexed by (sequence, head, position in the sequence). Sequences of
    length 0 are fine. Returns out [total_q, H, D], and lse [H, total_q] with return_lse.
    """
    _check_qkv(q, k, v, varlen=True)
    device = check_same_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                "cu_seqlens_k": cu_seqlens_k, "attn_mask": attn_mask,
                                "attn_bias": attn_bias})
    n_seq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, n_seq)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name}: expected a non-negative Python int, got {value!r}")
    cu_seqlens_q = cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
    cu_seqlens_k = cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    _, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    words = ("max_seqlen_q", "max_seqlen_k")
    mask = _validate_pair("attn_mask", attn_mask, n_seq, heads, kv_heads, max_seqlen_q,
                          max_seqlen_k, (torch.bool,), device, words)
    bias = _validate_pair("attn_bias", attn_bias, n_seq, heads, kv_heads, max_seqlen_q,
                          max_seqlen_k, (q.dtype, torch.float32), device, words)
    pb = _Problem(n_seq, heads, kv_heads, head_dim, max_seqlen_q, max_seqlen_k, True,
                  bool(is_causal), _scale(softmax_scale, head_dim), cu_seqlens_q, cu_seqlens_k)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    with device_guard(device):
        out, lse = _DynamicMaskAttention.apply(q, k, v, mask, bias, pb, _deterministic(deterministic))
    return _finish(out, lse, return_lse)
