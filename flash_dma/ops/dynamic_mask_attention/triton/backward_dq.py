"""dq of dynamic mask attention, in each of the plan's ways (BackwardPlan.dq_strategy):
"kernel"  the query-major kernel here, one program per query tile, walking keys as the forward
          does (common.walk_keys_query_major);
"fused"   the key-major dk/dv kernel added dS k into an fp32 accumulator: scaled and cast here;
"matmul"  dS was stored as a full-shape dbias: dq = scale * dS k is one batched matmul.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .common import DQ_PASS, LOG2E, _load_rows, _query_tile_program, _store_rows, \
    walk_keys_query_major
from .host import bias_descriptor, grid_blocks, head_div, kv_descriptors, pair_constexprs, \
    pair_strides


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "stride_cb",
                               "stride_ch", "stride_cq", "stride_ib", "stride_ih", "stride_iq",
                               "stride_ik"])
def attn_bwd_dq_kernel(
    Q, K, V, K_DESC, V_DESC, DO, DQ, LSE, DELTA, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT,
    LIST_INDEX,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_cb, stride_ch, stride_cq,
    stride_ib, stride_ih, stride_iq, stride_ik,
    num_heads, kv_group, mask_head_div, bias_head_div, list_head_div,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
    BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, KV_MODE: tl.constexpr,
    KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr,
):
    """dq = scale * sum_j dS_ij k_j, query-tile-major: walks keys exactly as the forward does."""
    m_block, b64, h, hk, q_row0, seqlen_q, k_row0, seqlen_k = _query_tile_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, kv_group, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks
    v_base = V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs
    block_q0 = (m_block * BLOCK_M).to(tl.int64)
    mask_base = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh + block_q0 * stride_mq
    bias_base = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh + block_q0 * stride_bq

    q = _load_rows(Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs, offs_m, seqlen_q,
                   stride_qs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    do = _load_rows(DO + b64 * stride_dob + h * stride_doh + q_row0 * stride_dos, offs_m, seqlen_q,
                    stride_dos, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    row_stat = b64 * stride_lb + h * stride_lh + q_row0 + offs_m
    lse2 = tl.load(LSE + row_stat, mask=offs_m < seqlen_q, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + row_stat, mask=offs_m < seqlen_q, other=0.0)
    qk_scale = softmax_scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # first key row of this sequence in K/V seen as [tokens, Hk, D] (the descriptors' view)
    k_tok0 = (k_row0 + b64 * seqlen_k).to(tl.int32) if not IS_VARLEN else k_row0.to(tl.int32)
    # the bias tile's coordinates in its own [B|1, heads, Sq, Sk] descriptor
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)
    bias_h = h // bias_head_div
    q0 = m_block * BLOCK_M
    # (the walk carries the forward's running max and sum too: here lse2 and delta pass through)
    _, _, dq = walk_keys_query_major(
        lse2, delta, dq, q, do, lse2, delta, k_base, v_base, mask_base, bias_base, offs_m, local_m,
        offs_n, offs_d, m_block, b64, h, hk, seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs,
        stride_mq, stride_mk, stride_bq, stride_bk, LIST_COUNT, LIST_INDEX, stride_cb, stride_ch,
        stride_cq, stride_ib, stride_ih, stride_iq, stride_ik, list_head_div, K_DESC, V_DESC,
        k_tok0, B_DESC, bias_b, bias_h, q0, PASS=DQ_PASS, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IS_CAUSAL=IS_CAUSAL, HAS_MASK=HAS_MASK,
        HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
        BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST, KV_MODE=KV_MODE, KV_DESC=KV_DESC,
        BIAS_DESC=BIAS_DESC, WARP_SPECIALIZE=False, EXP2_POLY=False)

    dq_base = DQ + b64 * stride_dqb + h * stride_dqh + q_row0 * stride_dqs
    _store_rows(dq_base, offs_m, seqlen_q, stride_dqs, offs_d,
                (dq * softmax_scale).to(DQ.dtype.element_ty), HEAD_DIM)


@triton.jit
def scale_cast_kernel(SRC, DST, n, scale, BLOCK: tl.constexpr):
    """DST = SRC * scale in DST's dtype, over n contiguous elements (the fp32 dq accumulator into
    dq): one pass, where torch's mixed-dtype elementwise path is slower."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(SRC + offs, mask=ok)
    tl.store(DST + offs, (x * scale).to(DST.dtype.element_ty), mask=ok)


def dq_kernel(plan, q, k, v, dout, lse, delta, mask, bias):
    """dq by the query-major kernel (plan.dq, a PassPlan)."""
    pb, cfg = plan.problem, plan.dq.cfg
    walk = plan.dq.key_walk(mask, q.device)
    absent = lse  # stands in for absent tensors: pointer arguments the kernel never reads
    dq = torch.zeros_like(q) if pb.is_varlen else torch.empty_like(q)  # (rows past the last offset)
    k_desc, v_desc = kv_descriptors(pb, k, v, cfg)
    b_desc = bias_descriptor(bias, cfg, pb.block_d)
    grid = (grid_blocks(pb.seqlen_q, cfg.block_m), pb.batch * pb.num_heads)
    launch(attn_bwd_dq_kernel, grid,
        q, k, v, k_desc, v_desc, dout, dq, lse, delta,
        mask.view(torch.uint8) if mask is not None else absent,
        bias if bias is not None else absent, b_desc,
        pb.cu_q if pb.is_varlen else absent, pb.cu_k if pb.is_varlen else absent,
        walk.count, walk.index,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(dout),
        *pb.row_strides(dq), *pb.stat_strides(lse),
        *pair_strides(mask), *pair_strides(bias), *walk.strides,
        pb.num_heads, pb.kv_group, head_div(pb, mask), head_div(pb, bias), walk.head_div,
        **pair_constexprs(pb, cfg, mask, bias, plan.dq.kv_mode), KV_DESC=k_desc is not None,
        BIAS_DESC=b_desc is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq


_SCALE_CAST_BLOCK = 4096


def dq_from_accumulator(dq_acc: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dq = scale * the fp32 accumulator the key-major kernel added into, in q's dtype."""
    dq = torch.empty(dq_acc.shape, device=dq_acc.device, dtype=dtype)
    n = dq_acc.numel()
    if n == 0:
        return dq
    on_gpu = dq_acc.device.type == "cuda"  # (the interpreter: small blocks, one warp)
    block = _SCALE_CAST_BLOCK if on_gpu else 256
    launch(scale_cast_kernel, (ceil_div(n, block),), dq_acc, dq, n, scale, BLOCK=block,
           num_warps=8 if on_gpu else 1)
    return dq


def dq_by_matmul(pb, k, ds):
    """dq = scale * dS k, dS being the full-shape [B, H, Sq, Sk] dbias in q's dtype."""
    group = pb.kv_group
    # [B, H, Sq, Sk] -> [B, Hk, group * Sq, Sk]: the query heads of a group share one k
    ds = ds.view(pb.batch, pb.num_kv_heads, group * pb.seqlen_q, pb.seqlen_k)
    dq = torch.matmul(ds, k.transpose(1, 2)).mul_(pb.softmax_scale)
    dq = dq.view(pb.batch, pb.num_heads, pb.seqlen_q, pb.head_dim).transpose(1, 2)
    return dq.contiguous()
