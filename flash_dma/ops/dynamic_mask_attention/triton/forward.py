"""The forward pass of dynamic mask attention: out and the log-sum-exp, one program per query
tile of one (batch or sequence, head); the key walk is common.walk_keys_query_major."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from .common import FORWARD_PASS, LN2, LOG2E, _load_rows, _query_tile_program, _store_rows, \
    walk_keys_query_major
from .host import bias_descriptor, grid_blocks, head_div, kv_descriptors, pair_constexprs, \
    pair_strides


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "stride_cb",
                               "stride_ch", "stride_cq", "stride_ib", "stride_ih", "stride_iq",
                               "stride_ik"])
def attn_fwd_kernel(
    Q, K, V, K_DESC, V_DESC, O, LSE, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT, LIST_INDEX,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
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
    KV_DESC: tl.constexpr, BIAS_DESC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    EXP2_POLY: tl.constexpr,
):
    m_block, b64, h, hk, q_row0, seqlen_q, k_row0, seqlen_k = _query_tile_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, num_heads, kv_group, IS_VARLEN)
    if m_block * BLOCK_M >= seqlen_q:
        return
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_base = Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs
    k_base = K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks
    v_base = V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs
    block_q0 = (m_block * BLOCK_M).to(tl.int64)
    mask_base = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh + block_q0 * stride_mq
    bias_base = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh + block_q0 * stride_bq

    q = _load_rows(q_base, offs_m, seqlen_q, stride_qs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    qk_scale = softmax_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # first key row of this sequence in K/V seen as [tokens, Hk, D] (the descriptors' view)
    k_tok0 = (k_row0 + b64 * seqlen_k).to(tl.int32) if not IS_VARLEN else k_row0.to(tl.int32)
    # the bias tile's coordinates in its own [B|1, heads, Sq, Sk] descriptor
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)
    bias_h = h // bias_head_div
    q0 = m_block * BLOCK_M
    m_i, l_i, acc = walk_keys_query_major(
        m_i, l_i, acc, q, q, m_i, l_i, k_base, v_base, mask_base, bias_base, offs_m, local_m,
        offs_n, offs_d, m_block, b64, h, hk, seqlen_q, seqlen_k, qk_scale, stride_ks, stride_vs,
        stride_mq, stride_mk, stride_bq, stride_bk, LIST_COUNT, LIST_INDEX, stride_cb, stride_ch,
        stride_cq, stride_ib, stride_ih, stride_iq, stride_ik, list_head_div, K_DESC, V_DESC,
        k_tok0, B_DESC, bias_b, bias_h, q0, PASS=FORWARD_PASS, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IS_CAUSAL=IS_CAUSAL, HAS_MASK=HAS_MASK,
        HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
        BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST, KV_MODE=KV_MODE, KV_DESC=KV_DESC,
        BIAS_DESC=BIAS_DESC, WARP_SPECIALIZE=WARP_SPECIALIZE, EXP2_POLY=EXP2_POLY)

    empty_row = l_i == 0.0
    out = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    lse = tl.where(empty_row, float("inf"), (m_i + tl.math.log2(l_i)) * LN2)
    o_base = O + b64 * stride_ob + h * stride_oh + q_row0 * stride_os
    _store_rows(o_base, offs_m, seqlen_q, stride_os, offs_d, out.to(O.dtype.element_ty), HEAD_DIM)
    tl.store(LSE + b64 * stride_lb + h * stride_lh + q_row0 + offs_m, lse, mask=offs_m < seqlen_q)




def forward(plan, q, k, v, mask, bias):
    """Launch the forward of a ForwardPlan: returns (out, lse)."""
    pb, cfg = plan.problem, plan.forward.cfg
    walk = plan.forward.key_walk(mask, q.device)
    out = torch.empty_like(q)
    lse = torch.empty(pb.stat_shape(q.shape[0]), device=q.device, dtype=torch.float32)
    if pb.is_varlen:  # rows past the last offset belong to no sequence: they see no key
        out.zero_()
        lse.fill_(math.inf)
    absent = lse  # stands in for absent tensors: pointer arguments the kernel never reads
    grid = (grid_blocks(pb.seqlen_q, cfg.block_m), pb.batch * pb.num_heads)
    k_desc, v_desc = kv_descriptors(pb, k, v, cfg)
    b_desc = bias_descriptor(bias, cfg, pb.block_d)
    launch(attn_fwd_kernel, grid,
        q, k, v, k_desc, v_desc, out, lse,
        mask.view(torch.uint8) if mask is not None else absent,
        bias if bias is not None else absent, b_desc,
        pb.cu_q if pb.is_varlen else absent, pb.cu_k if pb.is_varlen else absent,
        walk.count, walk.index,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(out),
        *pb.stat_strides(lse), *pair_strides(mask), *pair_strides(bias), *walk.strides,
        pb.num_heads, pb.kv_group, head_div(pb, mask), head_div(pb, bias), walk.head_div,
        **pair_constexprs(pb, cfg, mask, bias, plan.forward.kv_mode), KV_DESC=k_desc is not None,
        BIAS_DESC=b_desc is not None, WARP_SPECIALIZE=cfg.warp_specialize, EXP2_POLY=cfg.exp2_poly,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
