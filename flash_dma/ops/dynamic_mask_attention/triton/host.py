"""Host-side pieces the Triton launchers share: strides and constexpr flags of a mask or bias, and
the tensor-memory-accelerator (TMA) descriptors over k, v, the bias and the dq accumulator."""
from __future__ import annotations

import torch

from ....runtime import tma
from ....runtime.config import LaunchConfig, ceil_div
from ....runtime.hardware import device_info

# Descriptors pay up to padded head dim 128 on Hopper; at 256 the [block_n, 1, 256] boxes lost to
# pointer loads, so they stop there.
DESCRIPTOR_MAX_HEAD_DIM = 128


def grid_blocks(length: int, block: int) -> int:
    return max(ceil_div(length, block), 1)


def pair_strides(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Strides of a broadcastable [B, H, Sq, Sk] mask or bias, 0 along size-1 dims."""
    if t is None:
        return 0, 0, 0, 0
    shape, stride = t.shape, t.stride()
    return tuple(0 if shape[i] == 1 else stride[i] for i in range(4))


def head_div(pb, t: torch.Tensor | None) -> int:
    """Query head h reads head h // head_div of a mask or bias."""
    return pb.num_heads // t.shape[1] if t is not None else 1


def pair_constexprs(pb, cfg: LaunchConfig, mask, bias, kv_mode: int) -> dict:
    """The constexprs every attention kernel but the delta pass takes."""
    return dict(
        HEAD_DIM=pb.head_dim, BLOCK_D=pb.block_d, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_CAUSAL=pb.is_causal, IS_VARLEN=pb.is_varlen,
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
        MASK_Q_BCAST=mask is not None and mask.shape[2] == 1,
        MASK_K_BCAST=mask is not None and mask.shape[3] == 1,
        BIAS_Q_BCAST=bias is not None and bias.shape[2] == 1,
        BIAS_K_BCAST=bias is not None and bias.shape[3] == 1, KV_MODE=kv_mode,
    )


def before_hopper(device: torch.device) -> bool:
    """A GPU without the tensor-memory accelerator (the interpreter emulates its loads)."""
    return device.type == "cuda" and device_info(device).arch < 90


def kv_descriptors(pb, k: torch.Tensor, v: torch.Tensor, cfg: LaunchConfig):
    """TMA descriptors over [tokens, Hk, D] views of k and v, for the kernels' whole interior key
    tiles; (None, None) where the device has no TMA (before Hopper) or the layout cannot be
    described (a batch stride that is not Sk token strides, strides or base not 16-byte
    aligned)."""
    if before_hopper(k.device):
        return None, None
    if pb.block_d > DESCRIPTOR_MAX_HEAD_DIM:
        return None, None
    tokens = k.shape[0] if pb.is_varlen else pb.batch * pb.seqlen_k
    if tokens == 0:
        return None, None
    descs = []
    block = [cfg.block_n, 1, pb.block_d]
    for t in (k, v):
        token_stride, head_stride = t.stride(-3), t.stride(-2)
        if not pb.is_varlen and t.stride(0) != pb.seqlen_k * token_stride and pb.batch > 1:
            return None, None
        strides = [token_stride, head_stride, 1]
        if not tma.aligned16(t, strides):
            return None, None
        descs.append(tma.descriptor(t, [tokens, pb.num_kv_heads, pb.head_dim], strides, block))
    return descs[0], descs[1]


def pair_tile_strides(shape, strides) -> list[int] | None:
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


def bias_descriptor(bias: torch.Tensor | None, cfg: LaunchConfig, block_d: int):
    """A descriptor over a bias (or a dbias buffer) that varies along both queries and keys,
    serving whole [block_m, block_n] tiles; None where there is no TMA or the layout cannot be
    described (an expanded dim with stride 0, a row stride not 16-byte aligned, as for odd Sk)."""
    if bias is None or block_d > DESCRIPTOR_MAX_HEAD_DIM or before_hopper(bias.device):
        return None
    strides = pair_tile_strides(bias.shape, bias.stride())
    if strides is None or not tma.aligned16(bias, strides):
        return None
    return tma.descriptor(bias, list(bias.shape), strides, [1, 1, cfg.block_m, cfg.block_n])


def dq_reduce_descriptor(pb, dq_acc: torch.Tensor, cfg: LaunchConfig):
    """A descriptor over the fp32 dq accumulator viewed as [tokens, H, D], for TMA bulk reductions
    of whole [block_m, 1, D] tiles; None before Hopper, in the interpreter (it has no bulk
    reduction), or where the rows are not 16-byte aligned."""
    if dq_acc.device.type != "cuda" or before_hopper(dq_acc.device):
        return None
    tokens = dq_acc.shape[0] if pb.is_varlen else pb.batch * pb.seqlen_q
    if tokens == 0 or (pb.head_dim * dq_acc.element_size()) % 16:
        return None
    return tma.descriptor(dq_acc, [tokens, pb.num_heads, pb.head_dim],
                          [pb.num_heads * pb.head_dim, pb.head_dim, 1],
                          [cfg.block_m, 1, pb.block_d])
