"""Experiment (2026-11-26): bwd_dhu with warp roles, the forward's warp-role skeleton
(gluon/forward_ws.py) turned around. First GPU run (H100): correct in modes A-C, fixed and
varlen; 0.45x the Triton kernel on long single sequences (fewer, wider V tiles), 0.96-1.00x at
full-GPU shapes (docs/perf/gated_delta_rule.md), so not wired. Not part of the package; bench/experiments/gluon_bwd_dhu_ws_check.py compares it
with the Triton kernel and times both.

The state gradient is carried transposed, D^T [BV, K], as the chain warpgroup's MMA accumulator;
chunks from last to first:
    dh[c]   = D                                              (handed to the store warpgroup)
    kd^T    = D^T k^T                                        (chain)
    D^T     = e^(B_last) D^T + (scale e^B do)^T q            (issued beside k d: needs no dv2)
    dv2^T   = dv^T + kd^T diag(e^(B_last - B))               (handed to the store warpgroup)
    D^T    -= dv2^T w                                        (chain)
A load warpgroup fills a ring of q, k, w, do and dv tiles by cp.async (per-thread arrivals on
the slot's mbarrier) and stores the chunk's gate rows; a store warpgroup writes dh (transposed
back to [K, V]) and dv2 from shared memory. Scalar gate or none; dht / dh0; fixed lengths or
varlen; K 64 or 128; V a multiple of 64; 16-bit inputs.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from flash_dma.ops.gated_delta_rule.gluon.common import (
    CHUNK, LOG2E, exp2_ftz, hand_off, sequence_of_program, start_state, state_offsets
)
from flash_dma.runtime.config import ceil_div

BV = gl.constexpr(64)


@gluon.jit
def _chunk_of(it, num_chunks, bos, seq_len):
    """Chunk index (last first), first token and valid rows of iteration it."""
    c = num_chunks - 1 - it
    return c, bos + c * CHUNK, gl.minimum(seq_len - c * CHUNK, CHUNK)


@gluon.jit
def _last_gate(g_cum, it, num_chunks, bos, seq_len, hv, HV: gl.constexpr, HAS_G: gl.constexpr):
    """The gate cumsum at iteration it's chunk's last row, log2 units (0 past the first chunk
    or without g)."""
    if HAS_G:
        c = gl.maximum(num_chunks - 1 - it, 0)
        row = bos + c * CHUNK + gl.maximum(gl.minimum(seq_len - c * CHUNK, CHUNK) - 1, 0)
        return gl.load(g_cum + row * HV + hv, mask=it < num_chunks, other=0.0) * LOG2E
    else:
        return 0.0


@gluon.jit
def _chain(dht, dh0, g_cum, cu_seqlens, T, scale, v_start, q_ring, k_ring, w_ring, do_ring, dv_ring, g_rows,
           d_buf, v2_buf, ready, free, d_ready, d_free, v2_ready, v2_free,
           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr,
           HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    dt: gl.constexpr = k_ring.dtype
    state_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, K, 16])
    chunk_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, CHUNK, 16])
    a_for_chunk: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=chunk_acc, k_width=2)
    a_for_state: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=state_acc, k_width=2)
    state = start_state(dht, seq_hv, v_start, V, BV, K, state_acc, HAS_DHT)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))
    # the gate at each chunk's last row is loaded an iteration ahead (a load at use sits on the chain)
    last = _last_gate(g_cum, 0, num_chunks, bos, seq_len, hv, HV, HAS_G)
    for it in range(0, num_chunks):
        c, tok0, n_valid = _chunk_of(it, num_chunks, bos, seq_len)
        slot = it % STAGES
        buf = it % 2
        phase = (it // 2) & 1
        last_next = _last_gate(g_cum, it + 1, num_chunks, bos, seq_len, hv, HV, HAS_G)
        d_low = state.to(dt)
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        b2 = g_rows.index(slot).load(gl.SliceLayout(0, chunk_acc))
        kd = warpgroup_mma(gl.convert_layout(d_low, a_for_chunk), k_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        # scale e^B do^T: its columns are the chunk's tokens
        do_t = do_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32)
        do_a = gl.convert_layout((do_t * (exp2_ftz(b2) * scale)[None, :]).to(dt), a_for_state)
        state = warpgroup_mma(do_a, q_ring.index(slot), state * gl.exp2(last), is_async=True)
        # dh[c] = D for the store warpgroup, while the products run
        hand_off(d_buf, d_low, d_ready, d_free, buf, phase)
        dv_t = dv_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32)
        decay = gl.where(cols < n_valid, exp2_ftz(last - b2), 0.0)
        kd = warpgroup_mma_wait(num_outstanding=1, deps=(kd, ))
        dv2 = dv_t + kd * decay[None, :]
        dv2_low = dv2.to(dt)
        hand_off(v2_buf, dv2_low, v2_ready, v2_free, buf, phase)
        state = warpgroup_mma(gl.convert_layout(-dv2_low, a_for_state), w_ring.index(slot), state, is_async=True)
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
        gl.thread_barrier()  # every warp's reads of the slot are done
        mbarrier.arrive(free.index(slot))
        last = last_next
    if STORE_DH0:
        s_offs, s_mask = state_offsets(v_start, V, BV, K, state_acc)
        gl.store(dh0 + seq_hv.to(gl.int64) * K * V + s_offs, state, mask=s_mask)


@gluon.jit
def _store(dh, dv2, cu_seqlens, chunk_offsets, T, v_start, d_buf, v2_buf, d_ready, d_free, v2_ready, v2_free,
           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The store warpgroup: dh[c] from D^T [BV, K] and dv2 from dv2^T [BV, 64], each thread a
    run of V columns (coalesced)."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    if IS_VARLEN:
        chunk0 = gl.load(chunk_offsets + seq_hv // HV).to(gl.int64)
    else:
        chunk0 = (seq_hv // HV).to(gl.int64) * gl.cdiv(T, CHUNK)
    state_out: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, 4], [0, 1])
    sv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, state_out))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, state_out))
    tc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, state_out))
    for it in range(0, num_chunks):
        c, tok0, n_valid = _chunk_of(it, num_chunks, bos, seq_len)
        buf = it % 2
        phase = (it // 2) & 1
        mbarrier.wait(d_ready.index(buf), phase)
        d_t = d_buf.index(buf).load(state_out)
        gl.thread_barrier()
        mbarrier.arrive(d_free.index(buf))
        d_offs = ((chunk0 + c) * HV + hv) * K * V + sk[None, :].to(gl.int64) * V + sv[:, None]
        gl.store(dh + d_offs, d_t)
        mbarrier.wait(v2_ready.index(buf), phase)
        v_t = v2_buf.index(buf).load(state_out)
        gl.thread_barrier()
        mbarrier.arrive(v2_free.index(buf))
        v_offs = ((tok0 + tc) * HV + hv)[None, :] * V + sv[:, None]
        gl.store(dv2 + v_offs, v_t, mask=(tc < n_valid)[None, :])


@gluon.jit
def _loader(q, k, w, do, dv, g_cum, cu_seqlens, T, v_start, q_ring, k_ring, w_ring, do_ring, dv_ring, g_rows,
            ready, free, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            STAGES: gl.constexpr, HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    head = hv // (HV // HQ)
    key_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8), K // 8], [4, 1], [1, 0])
    value_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [4, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, key_load))
    kcols = gl.arange(0, K, layout=gl.SliceLayout(0, key_load))
    vrows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, value_load))
    vcols = v_start + gl.arange(0, BV, layout=gl.SliceLayout(0, value_load))
    row_idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for it in range(0, num_chunks):
        c, tok0, n_valid = _chunk_of(it, num_chunks, bos, seq_len)
        slot = it % STAGES
        if HAS_G:
            b2 = gl.load(g_cum + (tok0 + row_idx) * HV + hv, mask=row_idx < n_valid, other=0.0) * LOG2E
        else:
            b2 = gl.zeros([CHUNK], gl.float32, gl.BlockedLayout([1], [32], [4], [0]))
        mbarrier.wait(free.index(slot), ((it // STAGES) & 1) ^ 1)
        key_mask = (rows < n_valid)[:, None] & (kcols < K)[None, :]
        qk_offs = ((tok0 + rows)[:, None] * HQ + head) * K + kcols[None, :]
        async_copy.async_copy_global_to_shared(q_ring.index(slot), q + qk_offs, key_mask)
        async_copy.async_copy_global_to_shared(k_ring.index(slot), k + qk_offs, key_mask)
        async_copy.async_copy_global_to_shared(w_ring.index(slot), w + ((tok0 + rows)[:, None] * HV + hv) * K
                                               + kcols[None, :], key_mask)
        value_mask = (vrows < n_valid)[:, None] & (vcols < V)[None, :]
        value_offs = ((tok0 + vrows)[:, None] * HV + hv) * V + vcols[None, :]
        async_copy.async_copy_global_to_shared(do_ring.index(slot), do + value_offs, value_mask)
        async_copy.async_copy_global_to_shared(dv_ring.index(slot), dv + value_offs, value_mask)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        g_rows.index(slot).store(b2)
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot))


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_ws_kernel(q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu_seqlens, chunk_offsets, T, scale,
                          HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                          STAGES: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr,
                          STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    dt: gl.constexpr = q.dtype.element_ty
    v_start = gl.program_id(0) * BV
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
    q_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    k_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    w_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    do_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    dv_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    g_rows = gl.allocate_shared_memory(gl.float32, [STAGES, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    d_buf = gl.allocate_shared_memory(dt, [2, BV, K], state_smem)
    v2_buf = gl.allocate_shared_memory(dt, [2, BV, CHUNK], value_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    d_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v2_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v2_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=129)  # 128 cp.async arrivals, one after the gate rows
        mbarrier.init(free.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(d_ready.index(i), count=1)
        mbarrier.init(d_free.index(i), count=1)
        mbarrier.init(v2_ready.index(i), count=1)
        mbarrier.init(v2_free.index(i), count=1)
    gl.warp_specialize([
        (_chain, (dht, dh0, g_cum, cu_seqlens, T, scale, v_start, q_ring, k_ring, w_ring, do_ring, dv_ring, g_rows,
                  d_buf, v2_buf, ready, free, d_ready, d_free, v2_ready, v2_free, HV, K, V, STAGES, HAS_G,
                  HAS_DHT, STORE_DH0, IS_VARLEN)),
        (_store, (dh, dv2, cu_seqlens, chunk_offsets, T, v_start, d_buf, v2_buf, d_ready, d_free, v2_ready, v2_free,
                  HV, K, V, IS_VARLEN)),
        (_loader, (q, k, w, do, dv, g_cum, cu_seqlens, T, v_start, q_ring, k_ring, w_ring, do_ring, dv_ring,
                   g_rows, ready, free, HQ, HV, K, V, STAGES, HAS_G, IS_VARLEN)),
    ], [4, 4], [128, 64])


def bwd_dhu_ws(layout, q, k, w, do, dv, g_cum, dht, want_dh0: bool, scale: float, stages: int = 2):
    """-> (dh [chunk states, HV, K, V] in q's dtype, dh0 fp32 or None, dv2 like dv), unsplit."""
    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=q.device, dtype=q.dtype)
    dv2 = torch.empty_like(dv)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    cu, offsets = (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)
    gdn_bwd_dhu_ws_kernel[(ceil_div(V, 64), layout.num_seqs * HV)](
        q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu, offsets, T, scale,
        HQ=HQ, HV=HV, K=K, V=V, STAGES=stages, HAS_G=g_cum is not None, HAS_DHT=dht is not None,
        STORE_DH0=want_dh0, IS_VARLEN=layout.is_varlen, num_warps=4, maxnreg=144)
    return dh, dh0, dv2
