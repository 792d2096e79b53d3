"""The fused forward (forward_fused.py's math) with warp roles: the chain warpgroup runs only
the dependent products of each chunk (k h^T, T x^T, the state update) and hands h^T and v_new^T
through shared memory to an output warpgroup, which computes P^T, q h^T and o beside it, while a
load warpgroup fills a ring of q, k, v and T tiles. Per CTA: one (V tile of 64, sequence x value
head). Scalar gate or none; K 64 or 128; 16-bit inputs.

Barriers (mbarriers, one arrive each unless said):
    ready[s]   loads of ring slot s landed (cp.async arrivals of the load warpgroup's 128 threads,
               and one arrival after its stores of the slot's gate and beta rows)
    free[s]    slot s read by the chain and the output warpgroups (two arrivals)
    h_ready[i] / h_free[i]    h^T of chunk c in buffer i = c % 2, written / read
    v_ready[i] / v_free[i]    v_new^T of chunk c in buffer i, written / read
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .common import (
    CHUNK, allocate_ring, exp2_ftz, fill_ring_slot, forward_ws_barriers, hand_off, last_gate, one_warpgroup_accumulator,
    output_buffers, register_a_operand, sequence_of_program, start_state, store_state, store_output
)

BV = gl.constexpr(64)


@gluon.jit
def _chain(h0, ht, g_cum, cu_seqlens, order, T, v_start,
           k_ring, v_ring, t_ring, g_rows, beta_rows, h_buf, v_buf, ready, free, h_ready, h_free, v_ready, v_free,
           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr,
           HAS_G: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The state's warpgroup: per chunk kh^T = h^T k^T, x^T = (v^T - kh^T e^B) beta,
    vn^T = x^T T^T, h^T = e^(B_last) h^T + (vn^T e^(B_last - B)) k; hands h^T and vn^T on."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    dt: gl.constexpr = k_ring.dtype
    state_acc: gl.constexpr = one_warpgroup_accumulator(K)
    chunk_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    a_for_chunk: gl.constexpr = register_a_operand(chunk_acc)
    a_for_state: gl.constexpr = register_a_operand(state_acc)
    state = start_state(h0, seq_hv, v_start, V, BV, K, state_acc, HAS_H0)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))
    # the gate at the next chunk's last row is loaded a chunk ahead (a load at use would sit on the chain)
    b2_last = last_gate(g_cum, bos, gl.minimum(seq_len, CHUNK), hv, HV, HAS_G)
    for c in range(0, num_chunks):
        slot = c % STAGES
        buf = c % 2
        phase = (c // 2) & 1
        next_rows = gl.maximum(gl.minimum(seq_len - (c + 1) * CHUNK, CHUNK), 0)
        b2_last_next = last_gate(g_cum, bos + (c + 1) * CHUNK, next_rows, hv, HV, HAS_G)
        h_low = state.to(dt)
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        b2 = g_rows.index(slot).load(gl.SliceLayout(0, chunk_acc))
        b_beta = beta_rows.index(slot).load(gl.SliceLayout(0, chunk_acc))
        k_tile = k_ring.index(slot)
        kh = warpgroup_mma(gl.convert_layout(h_low, a_for_chunk), k_tile.permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        # h^T for the output warpgroup, while k h^T runs
        hand_off(h_buf, h_low, h_ready, h_free, buf, phase)
        # everything that does not need k h^T, while it runs
        valid = cols < gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        eb_beta = exp2_ftz(b2) * b_beta
        decay = exp2_ftz(b2_last - b2)
        v_beta = v_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32) * b_beta[None, :]  # v^T beta
        kh = warpgroup_mma_wait(num_outstanding=0, deps=(kh, ))
        x = v_beta - kh * eb_beta[None, :]
        vn = warpgroup_mma(gl.convert_layout(x.to(dt), a_for_chunk), t_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        state = state * gl.exp2(b2_last)  # while T x^T runs
        vn = warpgroup_mma_wait(num_outstanding=0, deps=(vn, ))
        vn = gl.where(valid[None, :], vn, 0.0)
        # vn^T for the output warpgroup, before the state product is issued (stored beside it,
        # ptxas 12.8 and 12.9 crashed at -O3)
        hand_off(v_buf, vn.to(dt), v_ready, v_free, buf, phase)
        state = warpgroup_mma(gl.convert_layout((vn * decay[None, :]).to(dt), a_for_state), k_tile, state,
                              is_async=True)
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
        gl.thread_barrier()  # every warp's reads of the slot (v^T, and k, T by the products) are done
        mbarrier.arrive(free.index(slot))
        b2_last = b2_last_next
    if STORE_HT:
        store_state(ht, state, seq_hv, v_start, V, BV, K, state_acc)


@gluon.jit
def _output(o, cu_seqlens, order, T, scale, v_start,
            q_ring, k_ring, p_stage, g_rows, h_buf, v_buf, ready, free, h_ready, h_free, v_ready, v_free,
            HV: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The output's warpgroup: P^T = scale (k q^T . e^(B_i - B_j)) on j <= i, then
    o^T = scale (h^T q^T) e^B + vn^T P^T, stored per chunk."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    dt: gl.constexpr = q_ring.dtype
    chunk_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))
    p_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, chunk_acc))
    log2_scale = gl.log2(scale)
    for c in range(0, num_chunks):
        slot = c % STAGES
        buf = c % 2
        phase = (c // 2) & 1
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        b2 = g_rows.index(slot).load(gl.SliceLayout(0, chunk_acc))
        q_tile = q_ring.index(slot)
        pt = warpgroup_mma(k_ring.index(slot), q_tile.permute((1, 0)),
                           gl.zeros([CHUNK, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        mbarrier.wait(h_ready.index(buf), phase)
        qh = warpgroup_mma(h_buf.index(buf), q_tile.permute((1, 0)), gl.zeros([BV, CHUNK], gl.float32, chunk_acc),
                           use_acc=False, is_async=True)
        # the decays of P^T and of q h^T while the products run
        b_j = gl.convert_layout(b2, gl.SliceLayout(1, chunk_acc))
        gamma = gl.where(p_rows[:, None] <= cols[None, :], exp2_ftz(b2[None, :] + log2_scale - b_j[:, None]), 0.0)
        eb_scale = exp2_ftz(b2) * scale
        pt = warpgroup_mma_wait(num_outstanding=1, deps=(pt, ))
        p_stage.store((pt * gamma).to(dt))
        fence_async_shared()
        qh = warpgroup_mma_wait(num_outstanding=0, deps=(qh, ))
        gl.thread_barrier()  # P^T whole in shared memory; q, k and h^T read
        mbarrier.arrive(h_free.index(buf))
        mbarrier.arrive(free.index(slot))
        out = qh * eb_scale[None, :]
        mbarrier.wait(v_ready.index(buf), phase)
        out = warpgroup_mma(v_buf.index(buf), p_stage, out, is_async=True)
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out, ))
        gl.thread_barrier()
        mbarrier.arrive(v_free.index(buf))
        store_output(o, out, bos + c * CHUNK, gl.minimum(seq_len - c * CHUNK, CHUNK), hv, HV, V, v_start, BV, 4)


@gluon.jit
def _loader(q, k, v, ai, g_cum, beta, cu_seqlens, order, T, v_start, q_ring, k_ring, v_ring, t_ring, g_rows, beta_rows,
            ready, free, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            STAGES: gl.constexpr, HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The load warpgroup: each chunk's q, k, v and T tiles and gate and beta rows into the ring
    (common.fill_ring_slot), first to last."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    head = hv // (HV // HQ)
    row_idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for c in range(0, num_chunks):
        fill_ring_slot(q, k, v, ai, g_cum, beta, q_ring, k_ring, v_ring, t_ring, g_rows, beta_rows, ready, free, c, c,
                       bos, seq_len, head, hv, v_start, row_idx, HQ, HV, K, V, BV, STAGES, HAS_G)


@gluon.jit(do_not_specialize=["T"])
def gdn_fwd_ws_kernel(q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, order, T, scale,
                      HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                      STAGES: gl.constexpr, HAS_G: gl.constexpr, HAS_H0: gl.constexpr,
                      STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (V tile of 64, sequence x value head); 4 warps here (the chain), plus the
    output and load warpgroups. order: see common.sequence_of_program (a tensor argument before
    the constexprs, so that runtime.launch can replay the launch)."""
    dt: gl.constexpr = q.dtype.element_ty
    v_start = gl.program_id(0) * BV
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
    q_ring, k_ring, v_ring, t_ring = allocate_ring(dt, K, BV, STAGES)
    h_buf = gl.allocate_shared_memory(dt, [2, BV, K], state_smem)
    v_buf = gl.allocate_shared_memory(dt, [2, BV, CHUNK], value_smem)
    p_stage = gl.allocate_shared_memory(dt, [CHUNK, CHUNK], value_smem)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    g_rows = gl.allocate_shared_memory(gl.float32, [STAGES, CHUNK], row_smem)
    beta_rows = gl.allocate_shared_memory(gl.float32, [STAGES, CHUNK], row_smem)
    # one cp.async arrival per load thread, one for the rows
    ready, free, h_ready, h_free, v_ready, v_free = forward_ws_barriers(STAGES, 129)
    gl.warp_specialize([
        (_chain, (h0, ht, g_cum, cu_seqlens, order, T, v_start, k_ring, v_ring, t_ring, g_rows, beta_rows, h_buf, v_buf,
                  ready, free, h_ready, h_free, v_ready, v_free, HV, K, V, STAGES, HAS_G, HAS_H0, STORE_HT,
                  IS_VARLEN)),
        (_output, (o, cu_seqlens, order, T, scale, v_start, q_ring, k_ring, p_stage, g_rows, h_buf, v_buf, ready, free,
                   h_ready, h_free, v_ready, v_free, HV, V, STAGES, IS_VARLEN)),
        (_loader, (q, k, v, ai, g_cum, beta, cu_seqlens, order, T, v_start, q_ring, k_ring, v_ring, t_ring, g_rows,
                   beta_rows, ready, free, HQ, HV, K, V, STAGES, HAS_G, IS_VARLEN)),
    ], [4, 4], [160, 64])


def forward_ws(layout, q, k, v, beta, ai, g_cum, h0, store_final: bool, scale: float, stages: int = 2,
               cu_seqlens=None, num_seqs=None, order=None):
    """As forward_fused.forward_fused with 64-wide V tiles."""
    T, HQ, K = q.shape[1:]
    HV, V = v.shape[2], v.shape[3]
    o, ht, cu_seqlens, num_seqs = output_buffers(layout, q, v, store_final, cu_seqlens, num_seqs)
    launch(gdn_fwd_ws_kernel, (ceil_div(V, 64), num_seqs * HV),
           q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, order, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, STAGES=stages, HAS_G=g_cum is not None, HAS_H0=h0 is not None,
           STORE_HT=store_final, IS_VARLEN=cu_seqlens is not None, num_warps=4, maxnreg=160)
    return o, ht
