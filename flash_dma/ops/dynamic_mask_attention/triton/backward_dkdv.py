"""The backward's key-major pass: dk, dv (and dbias, and where the plan fuses it, dq), one program
per key tile of one kv head, walking the query tiles that see it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from .. import sparsity
from .common import KV_BLOCK_LIST, KV_GATHERED, LOG2E, _load_bias_and_keep, _load_rows, \
    _scores_log2, _sequence_span, _store_rows
from .host import bias_descriptor, dq_reduce_descriptor, head_div, pair_constexprs, pair_strides

# Where dq comes from (DQ_MODE): a separate query-major kernel (DQ_NONE here), or this kernel adds
# dS k into an fp32 accumulator, by element atomics or by TMA bulk reductions (Hopper and later).
DQ_NONE = tl.constexpr(0)
DQ_ATOMIC = tl.constexpr(1)
DQ_TMA_REDUCE = tl.constexpr(2)


@triton.jit
def _write_dbias(ptr, value, ok, DBIAS_ATOMIC: tl.constexpr):
    if DBIAS_ATOMIC:
        tl.atomic_add(ptr, value.to(tl.float32), mask=ok, sem="relaxed")
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_dq_share(dq_base, dq_desc, dq_row0, dq_h, m_block, offs_m, q_ok, offs_d, stride_dqs, part,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DQ_MODE: tl.constexpr):
    """Add one key tile's share of dq (dS k, unscaled, fp32) into the fp32 dq accumulator that all
    key tiles of the sequence add into: element atomics, or one bulk reduction by the tensor-memory
    accelerator (DQ_TMA_REDUCE: the add happens in L2, the SM only issues it)."""
    if DQ_MODE == DQ_TMA_REDUCE:
        # rows past the sequence carry exact zeros (their probabilities are 0), but they land in
        # the next sequence's rows: clear them anyway, so that nothing but 0 can ever leak there
        part = tl.where(q_ok[:, None], part, 0.0)
        dq_desc.atomic_add([dq_row0 + m_block * BLOCK_M, dq_h, 0],
                           part.reshape(BLOCK_M, 1, part.shape[1]))
    else:
        ptrs = dq_base + offs_m.to(tl.int64)[:, None] * stride_dqs + offs_d[None, :]
        tl.atomic_add(ptrs, part, mask=q_ok[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")


@triton.jit
def _dkdv_tile(dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA, stat_base,
               mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
               seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
               stride_bq, stride_bk, stride_dbq, stride_dbk, bias_desc, dbias_desc, bias_b, bias_h, k0,
               dq_base, dq_desc, dq_row0, dq_h, stride_dqs,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               IS_CAUSAL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
               MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
               BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr,
               HAS_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
               CHECK: tl.constexpr, BOUNDS: tl.constexpr,
               BIAS_BY_DESC: tl.constexpr, DQ_MODE: tl.constexpr, DBIAS_DESC: tl.constexpr):
    """One query tile against this program's key tile: accumulates dk, dv, and writes or
    accumulates dbias (and, with DQ_MODE, adds this key tile's share of dq). The tile has keys on
    rows: P^T and dS^T feed the dk/dv products directly."""
    offs_m = m_block * BLOCK_M + local_m
    q_ok = offs_m < seqlen_q
    block_q0 = tl.full([], 0, tl.int64) + m_block * BLOCK_M  # int64 before it meets the strides
    # query rows past the sequence read lse = +inf, so their probabilities are exactly 0
    q = _load_rows(q_base, offs_m, seqlen_q, stride_qs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    do = _load_rows(do_base, offs_m, seqlen_q, stride_dos, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    lse2 = tl.load(LSE + stat_base + offs_m, mask=q_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + stat_base + offs_m, mask=q_ok, other=0.0)
    bias, keep = _load_bias_and_keep(mask_head + block_q0 * stride_mq, bias_head + block_q0 * stride_bq,
                                     local_m, k_pos, q_ok, k_ok, stride_mq, stride_mk, stride_bq,
                                     stride_bk, bias_desc, bias_b, bias_h, m_block * BLOCK_M, k0,
                                     APPLY_MASK=APPLY_MASK and CHECK, HAS_BIAS=HAS_BIAS,
                                     MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
                                     BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST,
                                     KEY_ROWS=True, BOUNDS=BOUNDS, BIAS_BY_DESC=BIAS_BY_DESC)
    s = _scores_log2(q, k, bias, keep, offs_m, k_pos, seqlen_q, seqlen_k, qk_scale,
                     IS_CAUSAL=IS_CAUSAL, APPLY_MASK=APPLY_MASK, HAS_BIAS=HAS_BIAS, CHECK=CHECK,
                     BOUNDS=BOUNDS, KEY_ROWS=True)
    # [keys, queries]
    p = tl.math.exp2(s - lse2[None, :])
    dv += tl.dot(p.to(do.dtype), do)
    ds = p * (tl.dot(v, tl.trans(do)) - delta[None, :])
    ds_in = ds.to(q.dtype)
    dk += tl.dot(ds_in, q)
    if DQ_MODE != DQ_NONE:  # (dS^T)^T k, as k^T dS^T: k is the operand already in shared memory
        _add_dq_share(dq_base, dq_desc, dq_row0, dq_h, m_block, offs_m, q_ok, offs_d,
                      stride_dqs,
                      tl.trans(tl.dot(tl.trans(k), ds_in)), HEAD_DIM, BLOCK_M, DQ_MODE)
    qi = local_m[None, :]
    kj = k_pos[:, None]
    tile_ok = q_ok[None, :]
    tile_ok_bounds = q_ok[None, :] & k_ok[:, None]
    if HAS_DBIAS:
        db_tile = dbias_head + block_q0 * stride_dbq
        if BIAS_Q_BCAST:
            db_keys += tl.sum(ds, 1)
        elif BIAS_K_BCAST:
            _write_dbias(db_tile + local_m * stride_dbq, tl.sum(ds, 0), q_ok, DBIAS_ATOMIC)
        elif DBIAS_DESC:  # the whole tile by the tensor-memory accelerator (asynchronous; it
            # clips rows and keys past the tensor's edges)
            tile = tl.trans(ds).to(dbias_head.dtype.element_ty)
            dbias_desc.store([bias_b, bias_h, m_block * BLOCK_M, k0],
                             tile.reshape(1, 1, BLOCK_M, tile.shape[1]))
        elif BOUNDS:
            _write_dbias(db_tile + qi * stride_dbq + kj * stride_dbk, ds, tile_ok_bounds, DBIAS_ATOMIC)
        else:
            _write_dbias(db_tile + qi * stride_dbq + kj * stride_dbk, ds, tile_ok, DBIAS_ATOMIC)
    return dk, dv, db_keys


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "slot_stride_b",
                               "slot_stride_h", "slot_stride_n", "stride_cb", "stride_ch",
                               "stride_cn", "stride_ib", "stride_ih", "stride_in", "stride_ik"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DBIAS, LSE, DELTA, MASK, BIAS, B_DESC, CU_Q, CU_K, LIST_COUNT, LIST_INDEX,
    DQ_ACC, DQ_DESC, DB_DESC,
    softmax_scale, seqlen_q, seqlen_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_bb, stride_bh, stride_bq, stride_bk,
    stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    slot_stride_b, slot_stride_h, slot_stride_n,
    stride_cb, stride_ch, stride_cn,
    stride_ib, stride_ih, stride_in, stride_ik,
    num_heads, kv_group, mask_head_div, bias_head_div, list_head_div,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK_Q_BCAST: tl.constexpr, MASK_K_BCAST: tl.constexpr,
    BIAS_Q_BCAST: tl.constexpr, BIAS_K_BCAST: tl.constexpr, KV_MODE: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
    BIAS_DESC: tl.constexpr, DQ_MODE: tl.constexpr, DBIAS_DESC: tl.constexpr,
):
    """dk, dv (and dbias) for one key tile of one kv head, summed over the heads of its group.

    Each program owns its key rows, so dk and dv need no atomics and no per-query-head buffer.
    dbias: written tile by tile, or reduced along a broadcast axis in registers; when several
    programs add into one bias entry (a bias shared by batch or heads, or broadcast along keys)
    the host asks for fp32 atomics (DBIAS_ATOMIC) or gives each program its own slot
    (deterministic mode) and sums the slots afterwards.
    """
    # gathered key tiles are not contiguous in the bias: no whole-tile dbias stores there
    tl.static_assert(not (DBIAS_DESC and KV_MODE == KV_GATHERED))
    n_block = tl.program_id(0)
    bhk = tl.program_id(1)
    num_kv_heads = num_heads // kv_group
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    q_row0, seqlen_q = _sequence_span(CU_Q, b, seqlen_q, IS_VARLEN)
    k_row0, seqlen_k = _sequence_span(CU_K, b, seqlen_k, IS_VARLEN)
    # first row of this sequence in the dq accumulator's [tokens, H, D] view (descriptor coordinate)
    if IS_VARLEN:
        dq_row0 = q_row0.to(tl.int32)
    else:
        dq_row0 = b * seqlen_q
    b64 = b.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    local_m = tl.arange(0, BLOCK_M)

    if KV_MODE == KV_GATHERED:
        hl0 = (hk * kv_group) // list_head_div  # gathered keys are one set per kv head (host checks)
        kept_total = tl.load(LIST_COUNT + b64 * stride_cb + hl0 * stride_ch)
        if n_block * BLOCK_N >= kept_total:
            return
        slot = n_block * BLOCK_N + offs_n
        k_pos = tl.load(LIST_INDEX + b64 * stride_ib + hl0 * stride_ih + slot,
                        mask=slot < kept_total, other=0)
        k_pos = tl.where(slot < kept_total, k_pos, seqlen_k)
        ragged = (n_block + 1) * BLOCK_N > kept_total
        first_key = tl.min(k_pos, 0)
        last_key = tl.max(tl.where(slot < kept_total, k_pos, 0), 0)
    else:
        if n_block * BLOCK_N >= seqlen_k:
            return
        k_pos = n_block * BLOCK_N + offs_n
        ragged = (n_block + 1) * BLOCK_N > seqlen_k
        first_key = n_block * BLOCK_N
        last_key = first_key + BLOCK_N - 1

    k = _load_rows(K + b64 * stride_kb + hk * stride_kh + k_row0 * stride_ks, k_pos, seqlen_k,
                   stride_ks, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    v = _load_rows(V + b64 * stride_vb + hk * stride_vh + k_row0 * stride_vs, k_pos, seqlen_k,
                   stride_vs, offs_d, HEAD_DIM, BLOCK_D, BOUNDS=True)
    k_ok = k_pos < seqlen_k
    qk_scale = softmax_scale * LOG2E
    bias_b = tl.where(stride_bb != 0, b64, 0).to(tl.int32)  # bias descriptor coordinates
    k0 = n_block * BLOCK_N
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Dense and gathered walks: query tiles [m_lo, m_full) cross the causal diagonal and are
    # checked; from m_full on, every row sees every key of this tile.
    n_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_lo = 0
    m_full = 0
    if IS_CAUSAL:
        shift = seqlen_k - seqlen_q
        m_lo = tl.maximum(first_key - shift, 0) // BLOCK_M
        m_full = tl.minimum(tl.cdiv(tl.maximum(last_key - shift, 0), BLOCK_M), n_m_blocks)
    # a ragged key tile is checked against every query tile. Loop bounds are settled here, outside
    # the head loop: Triton fuses the nested loops only when their bounds are invariant.
    m_check = tl.where(ragged, n_m_blocks, m_full)

    for g in range(0, kv_group):
        h = hk * kv_group + g
        q_base = Q + b64 * stride_qb + h * stride_qh + q_row0 * stride_qs
        dq_base = DQ_ACC + b64 * stride_dqb + h * stride_dqh + q_row0 * stride_dqs
        do_base = DO + b64 * stride_dob + h * stride_doh + q_row0 * stride_dos
        stat_base = b64 * stride_lb + h * stride_lh + q_row0
        mask_head = MASK + b64 * stride_mb + (h // mask_head_div) * stride_mh
        bias_head = BIAS + b64 * stride_bb + (h // bias_head_div) * stride_bh
        bias_h = h // bias_head_div
        dbias_head = (DBIAS + b64 * stride_dbb + (h // bias_head_div) * stride_dbh
                      + (b64 * slot_stride_b + (h % bias_head_div) * slot_stride_h
                         + n_block * slot_stride_n))
        db_keys = tl.zeros([BLOCK_N], tl.float32)  # dbias summed over queries (Sq-broadcast bias)
        if KV_MODE == KV_BLOCK_LIST:
            hl = h // list_head_div
            counts = LIST_COUNT + b64 * stride_cb + hl * stride_ch + n_block * stride_cn
            lists = LIST_INDEX + b64 * stride_ib + hl * stride_ih + n_block * stride_in
            n_full = tl.load(counts)
            n_part = tl.load(counts + 1)
            for it in range(0, n_full):  # (a ragged key tile is never listed as full)
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + it), q_base, do_base, LSE, DELTA,
                    stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d,
                    seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk,
                    stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h,
                    k0, dq_base, DQ_DESC, dq_row0, h, stride_dqs, HEAD_DIM=HEAD_DIM,
                    BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=HAS_MASK,
                    HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
                    BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST, HAS_DBIAS=HAS_DBIAS,
                    DBIAS_ATOMIC=DBIAS_ATOMIC, CHECK=False, BOUNDS=False,
                    BIAS_BY_DESC=BIAS_DESC and KV_MODE != KV_GATHERED, DQ_MODE=DQ_MODE,
                    DBIAS_DESC=DBIAS_DESC)
            # partial tiles are bounds-checked only when this key tile is ragged
            n_lean = tl.where(ragged, 0, n_part)
            for it in range(0, n_lean):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + stride_ik + it), q_base, do_base, LSE,
                    DELTA, stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m,
                    offs_d, seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq,
                    stride_mk, stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC,
                    bias_b, bias_h, k0, dq_base, DQ_DESC, dq_row0, h, stride_dqs,
                    HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, IS_CAUSAL=IS_CAUSAL,
                    APPLY_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST,
                    MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                    BIAS_K_BCAST=BIAS_K_BCAST, HAS_DBIAS=HAS_DBIAS, DBIAS_ATOMIC=DBIAS_ATOMIC,
                    CHECK=True, BOUNDS=False, BIAS_BY_DESC=BIAS_DESC and KV_MODE != KV_GATHERED,
                    DQ_MODE=DQ_MODE, DBIAS_DESC=DBIAS_DESC)
            for it in range(n_lean, n_part):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, tl.load(lists + stride_ik + it), q_base, do_base, LSE,
                    DELTA, stat_base, mask_head, bias_head, dbias_head, k_pos, k_ok, local_m,
                    offs_d, seqlen_q, seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq,
                    stride_mk, stride_bq, stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC,
                    bias_b, bias_h, k0, dq_base, DQ_DESC, dq_row0, h, stride_dqs,
                    HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, IS_CAUSAL=IS_CAUSAL,
                    APPLY_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, MASK_Q_BCAST=MASK_Q_BCAST,
                    MASK_K_BCAST=MASK_K_BCAST, BIAS_Q_BCAST=BIAS_Q_BCAST,
                    BIAS_K_BCAST=BIAS_K_BCAST, HAS_DBIAS=HAS_DBIAS, DBIAS_ATOMIC=DBIAS_ATOMIC,
                    CHECK=True, BOUNDS=True, BIAS_BY_DESC=False, DQ_MODE=DQ_MODE,
                    DBIAS_DESC=DBIAS_DESC)
        else:
            for m_block in range(m_lo, m_check):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA, stat_base,
                    mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d, seqlen_q,
                    seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk, stride_bq,
                    stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    BLOCK_M=BLOCK_M, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                    MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
                    BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST, HAS_DBIAS=HAS_DBIAS,
                    DBIAS_ATOMIC=DBIAS_ATOMIC, CHECK=True, BOUNDS=True, BIAS_BY_DESC=False,
                    DQ_MODE=DQ_MODE, DBIAS_DESC=DBIAS_DESC)
            for m_block in range(tl.maximum(m_check, m_lo), n_m_blocks):
                dk, dv, db_keys = _dkdv_tile(
                    dk, dv, db_keys, k, v, m_block, q_base, do_base, LSE, DELTA, stat_base,
                    mask_head, bias_head, dbias_head, k_pos, k_ok, local_m, offs_d, seqlen_q,
                    seqlen_k, qk_scale, stride_qs, stride_dos, stride_mq, stride_mk, stride_bq,
                    stride_bk, stride_dbq, stride_dbk, B_DESC, DB_DESC, bias_b, bias_h, k0,
                    dq_base, DQ_DESC, dq_row0, h, stride_dqs, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                    BLOCK_M=BLOCK_M, IS_CAUSAL=IS_CAUSAL, APPLY_MASK=False, HAS_BIAS=HAS_BIAS,
                    MASK_Q_BCAST=MASK_Q_BCAST, MASK_K_BCAST=MASK_K_BCAST,
                    BIAS_Q_BCAST=BIAS_Q_BCAST, BIAS_K_BCAST=BIAS_K_BCAST, HAS_DBIAS=HAS_DBIAS,
                    DBIAS_ATOMIC=DBIAS_ATOMIC, CHECK=False, BOUNDS=False,
                    BIAS_BY_DESC=BIAS_DESC and KV_MODE != KV_GATHERED, DQ_MODE=DQ_MODE,
                    DBIAS_DESC=DBIAS_DESC)
        if HAS_DBIAS:
            if BIAS_Q_BCAST:
                if BIAS_K_BCAST:
                    _write_dbias(dbias_head, tl.sum(db_keys, 0), n_block >= 0, DBIAS_ATOMIC)
                else:
                    _write_dbias(dbias_head + k_pos * stride_dbk, db_keys, k_ok, DBIAS_ATOMIC)

    _store_rows(DK + b64 * stride_dkb + hk * stride_dkh + k_row0 * stride_dks, k_pos, seqlen_k,
                stride_dks, offs_d, (dk * softmax_scale).to(DK.dtype.element_ty), HEAD_DIM)
    _store_rows(DV + b64 * stride_dvb + hk * stride_dvh + k_row0 * stride_dvs, k_pos, seqlen_k,
                stride_dvs, offs_d, dv.to(DV.dtype.element_ty), HEAD_DIM)


def dkdv(plan, q, k, v, dout, lse, delta, mask, bias, dq_acc):
    """dk, dv and the dbias buffer (None without dbias) for a BackwardPlan; adds into dq_acc where
    plan.dq_strategy is "fused"."""
    pb, cfg, dbp = plan.problem, plan.dkdv.cfg, plan.dbias
    absent = lse  # stands in for absent tensors: pointer arguments the kernel never reads
    walk = plan.dkdv.key_walk(mask, q.device)
    # gathered-away keys get no program's store, nor do varlen rows past the last offset: they
    # must read 0
    alloc = torch.zeros if plan.kv_mode == sparsity.KV_GATHERED or pb.is_varlen else torch.empty
    dk = alloc(k.shape, device=k.device, dtype=k.dtype)
    dv = alloc(v.shape, device=v.device, dtype=v.dtype)
    db_buf = dbp.allocate(bias) if dbp is not None else None
    db_strides = (0, 0, 0, 0) if dbp is None else \
        pair_strides(db_buf[0] if dbp.slotted else db_buf)
    # no bias descriptor here: the key-major tile wants the bias transposed, and the transposed
    # TMA tile lost to pointer loads on Hopper
    db_desc = bias_descriptor(db_buf, cfg, pb.block_d) if dbp is not None and dbp.by_descriptor \
        else None
    fused = plan.dq_strategy.value == "fused"
    dq_desc = dq_reduce_descriptor(pb, dq_acc, cfg) if fused and plan.dq_by_tma_reduce else None
    if not fused:
        dq_mode = DQ_NONE.value
    else:
        dq_mode = DQ_TMA_REDUCE.value if dq_desc is not None else DQ_ATOMIC.value
    launch(attn_bwd_dkdv_kernel, (plan.dkdv_key_programs, pb.batch * pb.num_kv_heads),
        q, k, v, dout, dk, dv, db_buf if db_buf is not None else absent, lse, delta,
        mask.view(torch.uint8) if mask is not None else absent,
        bias if bias is not None else absent, None,
        pb.cu_q if pb.is_varlen else absent, pb.cu_k if pb.is_varlen else absent,
        walk.count, walk.index, dq_acc if fused else absent, dq_desc, db_desc,
        pb.softmax_scale, pb.seqlen_q, pb.seqlen_k,
        *pb.row_strides(q), *pb.row_strides(k), *pb.row_strides(v), *pb.row_strides(dout),
        *pb.row_strides(dk), *pb.row_strides(dv),
        *(pb.row_strides(dq_acc) if fused else (0, 0, 0)), *pb.stat_strides(lse),
        *pair_strides(mask), *pair_strides(bias), *db_strides,
        *(dbp.slot_strides if dbp is not None else (0, 0, 0)),
        *walk.strides,
        pb.num_heads, pb.kv_group, head_div(pb, mask), head_div(pb, bias), walk.head_div,
        **pair_constexprs(pb, cfg, mask, bias, plan.dkdv.kv_mode),
        HAS_DBIAS=dbp is not None, DBIAS_ATOMIC=dbp is not None and dbp.atomic,
        BIAS_DESC=False, DQ_MODE=dq_mode, DBIAS_DESC=db_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dk, dv, db_buf
