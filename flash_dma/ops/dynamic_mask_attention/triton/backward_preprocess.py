"""The backward's first pass: delta = rowsum(dO * O) per query row (and, where the plan fuses dq
into the key-major pass, the clearing of its fp32 accumulator)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from .common import _load_rows, _sequence_span, _store_rows
from .host import grid_blocks


@triton.jit(do_not_specialize=["seqlen_q", "stride_lb", "stride_lh"])
def attn_bwd_delta_kernel(
    O, DO, DELTA, DQ_ACC, CU_Q, seqlen_q,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_ab, stride_as, stride_ah,
    stride_lb, stride_lh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
    ZERO_DQ_ACC: tl.constexpr,
):
    """delta = rowsum(dO * O): the softmax-gradient correction term, one value per query row.
    ZERO_DQ_ACC: also clear the same rows of the fp32 dq accumulator that the key-major pass adds
    into (one pass over the rows instead of a separate fill)."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    q_row0, seqlen_q = _sequence_span(CU_Q, b, seqlen_q, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + b64 * stride_ob + h * stride_oh + q_row0 * stride_os, offs_m, seqlen_q,
                   stride_os, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    do = _load_rows(DO + b64 * stride_db + h * stride_dh + q_row0 * stride_ds, offs_m, seqlen_q,
                    stride_ds, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b64 * stride_lb + h * stride_lh + q_row0 + offs_m, delta, mask=offs_m < seqlen_q)
    if ZERO_DQ_ACC:
        _store_rows(DQ_ACC + b64 * stride_ab + h * stride_ah + q_row0 * stride_as, offs_m, seqlen_q,
                    stride_as, offs_d, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), HEAD_DIM)


def preprocess(plan, out, dout, lse, dq_acc):
    """delta for a BackwardPlan; clears dq_acc's rows too where plan.zero_dq_in_delta."""
    pb = plan.problem
    delta = torch.empty_like(lse)
    block_m = plan.delta_block_m
    zero = plan.zero_dq_in_delta
    launch(attn_bwd_delta_kernel, (grid_blocks(pb.seqlen_q, block_m), pb.batch * pb.num_heads),
        out, dout, delta, dq_acc if dq_acc is not None else lse,
        pb.cu_q if pb.is_varlen else lse, pb.seqlen_q,
        *pb.row_strides(out), *pb.row_strides(dout),
        *(pb.row_strides(dq_acc) if zero else (0, 0, 0)),
        *pb.stat_strides(lse), pb.num_heads,
        HEAD_DIM=pb.head_dim, BLOCK_D=pb.block_d, BLOCK_M=block_m, IS_VARLEN=pb.is_varlen,
        ZERO_DQ_ACC=zero,
    )
    return delta
