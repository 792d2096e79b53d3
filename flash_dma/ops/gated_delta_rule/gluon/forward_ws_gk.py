"""The warp-role forward (forward_ws.py's three roles) with the per-key gate gk (Kimi Delta
Attention) instead of the scalar gate. The gated-pair and prepare passes have already formed,
per value head, everything gated: w = T diag(beta) (k e^C), u = T diag(beta) v, the keys decayed
to the chunk's end k~ = k e^(C_last - C), the queries q~ = q e^C and the gated query-key matrix
P (aqk, scale included), with C the chunk-local cumsum of gk. Per chunk the chain then runs two
dependent products where the scalar form runs three:
    v_new^T = u^T - h^T w^T,    h^T <- h^T diag(e^C_last) + v_new^T k~
and the output warpgroup o^T = scale h^T q~^T + v_new^T P^T. Per CTA: one (V tile of 64,
sequence x value head); gk without the scalar gate g; K 64 or 128; 16-bit inputs. The
per-chunk states are not written (the backward recomputes them, as without this kernel).

Barriers (mbarriers, one arrive each unless said):
    ready[s]   loads of ring slot s landed (cp.async arrivals of the load warpgroup's 128 threads,
               and one arrival after its store of the slot's decay row e^C_last)
    free[s]    slot s read by the chain and the output warpgroups (two arrivals)
    h_ready[i] / h_free[i]    h^T of chunk c in buffer i = c % 2, written / read
    v_ready[i] / v_free[i]    v_new^T of chunk c in buffer i, written / read
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .common import (
    CHUNK, LOG2E, forward_ws_barriers, hand_off, one_warpgroup_accumulator, output_buffers, register_a_operand,
    sequence_of_program, start_state, store_output, store_state
)

BV = gl.constexpr(64)


@gluon.jit
def _key_decay_at_end(gk_cum, tok0, n_valid, hv, HV: gl.constexpr, K: gl.constexpr, layout: gl.constexpr):
    """e^(C_last) of a chunk, [K] in `layout` (C_last: gk's chunk-local cumsum at the chunk's last
    valid row)."""
    cols = gl.arange(0, K, layout=layout)
    row = tok0 + n_valid - 1
    return gl.exp2(gl.load(gk_cum + (row * HV + hv) * K + cols) * LOG2E)


@gluon.jit
def _chain(h0, ht, cu_seqlens, order, T, v_start, w_ring, u_ring, kg_ring, decay_rows, h_buf, v_buf,
           ready, free, h_ready, h_free, v_ready, v_free,
           HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr,
           HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The state's warpgroup: per chunk v_new^T = u^T - h^T w^T, then
    h^T = h^T diag(e^C_last) + v_new^T k~; hands h^T and v_new^T on."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    dt: gl.constexpr = w_ring.dtype
    state_acc: gl.constexpr = one_warpgroup_accumulator(K)
    chunk_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    a_for_chunk: gl.constexpr = register_a_operand(chunk_acc)
    a_for_state: gl.constexpr = register_a_operand(state_acc)
    key_cols: gl.constexpr = gl.SliceLayout(0, state_acc)
    state = start_state(h0, seq_hv, v_start, V, BV, K, state_acc, HAS_H0)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))
    for c in range(0, num_chunks):
        slot = c % STAGES
        buf = c % 2
        phase = (c // 2) & 1
        h_low = state.to(dt)
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        wh = warpgroup_mma(gl.convert_layout(h_low, a_for_chunk), w_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        # h^T for the output warpgroup, while h^T w^T runs
        hand_off(h_buf, h_low, h_ready, h_free, buf, phase)
        valid = cols < gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        u_t = u_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32)
        # the state product's accumulator, while h^T w^T runs (the decay row from shared memory:
        # held in registers a chunk ahead, as the scalar gate is, it took 64 registers)
        state = state * decay_rows.index(slot).load(key_cols)[None, :]
        wh = warpgroup_mma_wait(num_outstanding=0, deps=(wh, ))
        vn = gl.where(valid[None, :], u_t - wh, 0.0)
        vn_low = vn.to(dt)
        # v_new^T for the output warpgroup, before the state product is issued
        hand_off(v_buf, vn_low, v_ready, v_free, buf, phase)
        state = warpgroup_mma(gl.convert_layout(vn_low, a_for_state), kg_ring.index(slot), state, is_async=True)
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
        gl.thread_barrier()  # every warp's reads of the slot (u^T, and w, k~ by the products) are done
        mbarrier.arrive(free.index(slot))
    if STORE_HT:
        store_state(ht, state, seq_hv, v_start, V, BV, K, state_acc)


@gluon.jit
def _output(o, cu_seqlens, order, T, scale, v_start, qg_ring, p_ring, h_buf, v_buf, ready, free,
            h_ready, h_free, v_ready, v_free,
            HV: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The output's warpgroup: o^T = scale h^T q~^T + v_new^T P^T, stored per chunk."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    chunk_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    for c in range(0, num_chunks):
        slot = c % STAGES
        buf = c % 2
        phase = (c // 2) & 1
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        mbarrier.wait(h_ready.index(buf), phase)
        qh = warpgroup_mma(h_buf.index(buf), qg_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        qh = warpgroup_mma_wait(num_outstanding=0, deps=(qh, ))
        gl.thread_barrier()  # every warp's product has read h^T
        mbarrier.arrive(h_free.index(buf))
        out = qh * scale
        mbarrier.wait(v_ready.index(buf), phase)
        out = warpgroup_mma(v_buf.index(buf), p_ring.index(slot).permute((1, 0)), out, is_async=True)
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out, ))
        gl.thread_barrier()  # v_new^T, q~ and P read
        mbarrier.arrive(v_free.index(buf))
        mbarrier.arrive(free.index(slot))
        store_output(o, out, bos + c * CHUNK, gl.minimum(seq_len - c * CHUNK, CHUNK), hv, HV, V, v_start, BV, 4)


@gluon.jit
def _copy_tile(dst, src, tok0, n_valid, hv, HV: gl.constexpr, D: gl.constexpr, col0, W: gl.constexpr,
               NW: gl.constexpr):
    """cp.async of rows tok0.. of value head hv, columns col0..+W of a [B, T, HV, D] tensor into a
    [64, W] slot by the NW issuing warps; rows from n_valid on are zero-filled."""
    tile_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (W // 8), W // 8], [NW, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, tile_load))
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, tile_load))
    mask = (rows < n_valid)[:, None] & (cols < D)[None, :]
    async_copy.async_copy_global_to_shared(dst, src + ((tok0 + rows)[:, None] * HV + hv) * D + cols[None, :], mask)


@gluon.jit
def _loader(q_gated, k_gated, w, u, aqk, gk_cum, cu_seqlens, order, T, v_start, qg_ring, kg_ring, w_ring, u_ring,
            p_ring, decay_rows, ready, free, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The load warpgroup: each chunk's q~, k~, w, u and P tiles into the ring, first to last, each
    thread's copies arriving on the slot's ready barrier as they land; and the chunk's decay row
    e^C_last into the slot's row (plain loads and a store), published by one more arrival."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for c in range(0, num_chunks):
        slot = c % STAGES
        tok0 = bos + c * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK)
        decay = _key_decay_at_end(gk_cum, tok0, n_valid, hv, HV, K, row_layout)  # in flight through the wait
        mbarrier.wait(free.index(slot), ((c // STAGES) & 1) ^ 1)
        _copy_tile(w_ring.index(slot), w, tok0, n_valid, hv, HV, K, 0, K, 4)
        _copy_tile(u_ring.index(slot), u, tok0, n_valid, hv, HV, V, v_start, BV, 4)
        _copy_tile(kg_ring.index(slot), k_gated, tok0, n_valid, hv, HV, K, 0, K, 4)
        _copy_tile(qg_ring.index(slot), q_gated, tok0, n_valid, hv, HV, K, 0, K, 4)
        _copy_tile(p_ring.index(slot), aqk, tok0, n_valid, hv, HV, CHUNK, 0, CHUNK, 4)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        decay_rows.index(slot).store(decay)
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot))


@gluon.jit(do_not_specialize=["T"])
def gdn_fwd_ws_gk_kernel(q_gated, k_gated, w, u, aqk, gk_cum, h0, o, ht, cu_seqlens, order, T, scale,
                         HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr,
                         HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (V tile of 64, sequence x value head); 4 warps here (the chain), plus the
    output and load warpgroups. order: see common.sequence_of_program."""
    dt: gl.constexpr = w.dtype.element_ty
    v_start = gl.program_id(0) * BV
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
    transposed_value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, CHUNK], dt)
    w_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    kg_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    qg_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    u_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    p_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, CHUNK], square_smem)
    h_buf = gl.allocate_shared_memory(dt, [2, BV, K], state_smem)
    v_buf = gl.allocate_shared_memory(dt, [2, BV, CHUNK], transposed_value_smem)
    decay_rows = gl.allocate_shared_memory(gl.float32, [STAGES, K], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # one cp.async arrival per load thread, one for the decay row
    ready, free, h_ready, h_free, v_ready, v_free = forward_ws_barriers(STAGES, 129)
    gl.warp_specialize([
        (_chain, (h0, ht, cu_seqlens, order, T, v_start, w_ring, u_ring, kg_ring, decay_rows, h_buf, v_buf,
                  ready, free, h_ready, h_free, v_ready, v_free, HV, K, V, STAGES, HAS_H0, STORE_HT, IS_VARLEN)),
        (_output, (o, cu_seqlens, order, T, scale, v_start, qg_ring, p_ring, h_buf, v_buf, ready, free,
                   h_ready, h_free, v_ready, v_free, HV, V, STAGES, IS_VARLEN)),
        (_loader, (q_gated, k_gated, w, u, aqk, gk_cum, cu_seqlens, order, T, v_start, qg_ring, kg_ring, w_ring,
                   u_ring, p_ring, decay_rows, ready, free, HV, K, V, STAGES, IS_VARLEN)),
    ], [4, 4], [160, 64])


def forward_ws_gk(layout, q_gated, k_gated, w, u, aqk, gk_cum, h0, store_final: bool, scale: float,
                  stages: int = 2, order=None):
    """o (and the final state where store_final) of the forward with the per-key gate, from the
    gated-pair and prepare passes' outputs (all per value head): q_gated, k_gated, w [B, T, HV, K],
    u [B, T, HV, V], aqk [B, T, HV, 64], gk_cum fp32 [B, T, HV, K]; h0 fp32 [N, HV, K, V] or None."""
    B, T, HV, K = w.shape
    V = u.shape[3]
    o, ht, cu_seqlens, num_seqs = output_buffers(layout, q_gated, u, store_final)
    launch(gdn_fwd_ws_gk_kernel, (ceil_div(V, 64), num_seqs * HV),
           q_gated, k_gated, w, u, aqk, gk_cum, h0, o, ht, cu_seqlens, order, T, scale,
           HV=HV, K=K, V=V, STAGES=stages, HAS_H0=h0 is not None, STORE_HT=store_final,
           IS_VARLEN=cu_seqlens is not None, num_warps=4, maxnreg=160)
    return o, ht
