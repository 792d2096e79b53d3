"""The backward's state-gradient pass (bwd_dhu) with warp roles, forming its two small inputs
itself: the intra-chunk dv (the Triton path's local_dv pass) and w (its recompute of w from T),
both off the chain. One program per (V tile of 64, sequence x value head), chunks from last to
first. Scalar gate or none; K 64 or 128; V a multiple of 64; 16-bit inputs; sequences whole (not
cut into segments).

The state gradient is carried transposed, D^T [64, K], as the chain warpgroup's MMA accumulator:
    dh[c]   = D                                                   (to the helper, which stores it)
    kd^T    = D^T k^T                                             (chain)
    D^T     = e^(B_last) D^T + (scale e^B do)^T q                 (chain, beside k D)
    dv2^T   = dvl^T + kd^T diag(e^(B_last - B))                   (chain; to the helper, stored)
    D^T    -= dv2^T w                                             (chain)
The helper warpgroup forms, a chunk ahead of the chain:
    M       = scale (q k^T) . e^(B_i - B_j) on j <= i (valid i)   (the forward's attention matrix)
    dvl^T   = do^T M                                              (the intra-chunk dv, 16-bit)
    w       = T diag(beta e^B) k                                  (16-bit)
and stores dh and dv2 from the chain's hand-offs. A load warpgroup fills a ring of q, k, do and
T tiles by cp.async and the chunk's gate and beta rows.

Barriers (mbarriers, one arrive each unless said):
    ready[s]                 loads of ring slot s landed (128 cp.async arrivals, one after the rows)
    free[s]                  slot s read by the chain and the helper (two arrivals)
    d_*, v2_*, dvl_*, w_*    double-buffered hand-offs (buffer i = chunk step % 2)
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .common import (
    CHUNK, LOG2E, exp2_ftz, fill_ring_slot, first_chunk_state, hand_off, one_warpgroup_accumulator, register_a_operand,
    reverse_chunk, sequence_of_program, start_state, store_state
)

BV = gl.constexpr(64)
HELPER_REGS = gl.constexpr(168)
LOAD_REGS = gl.constexpr(40)


@gluon.jit
def _last_gate(g_cum, it, num_chunks, bos, seq_len, hv, HV: gl.constexpr, HAS_G: gl.constexpr):
    """The gate cumsum at step it's chunk's last row, log2 units (0 past the first chunk or
    without g)."""
    if HAS_G:
        c = gl.maximum(num_chunks - 1 - it, 0)
        row = bos + c * CHUNK + gl.maximum(gl.minimum(seq_len - c * CHUNK, CHUNK) - 1, 0)
        return gl.load(g_cum + row * HV + hv, mask=it < num_chunks, other=0.0) * LOG2E
    else:
        return 0.0


@gluon.jit
def _chain(dht, dh0, g_cum, cu_seqlens, T, scale, v_start, q_ring, k_ring, do_ring, g_rows,
           d_buf, v2_buf, dvl_buf, w_buf, ready, free, d_ready, d_free, v2_ready, v2_free, dvl_ready, dvl_free,
           w_ready, w_free, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, STAGES: gl.constexpr,
           HAS_G: gl.constexpr, HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The state gradient's warpgroup (module docstring)."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    dt: gl.constexpr = k_ring.dtype
    state_acc: gl.constexpr = one_warpgroup_accumulator(K)
    chunk_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    a_for_chunk: gl.constexpr = register_a_operand(chunk_acc)
    a_for_state: gl.constexpr = register_a_operand(state_acc)
    state = start_state(dht, seq_hv, v_start, V, BV, K, state_acc, HAS_DHT)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))
    # the gate at each chunk's last row is loaded a step ahead (a load at use sits on the chain)
    last = _last_gate(g_cum, 0, num_chunks, bos, seq_len, hv, HV, HAS_G)
    for it in range(0, num_chunks):
        c, tok0, n_valid = reverse_chunk(it, num_chunks, bos, seq_len)
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
        # dh[c] = D for the helper, while the products run
        hand_off(d_buf, d_low, d_ready, d_free, buf, phase)
        decay = gl.where(cols < n_valid, exp2_ftz(last - b2), 0.0)
        mbarrier.wait(dvl_ready.index(buf), phase)
        dvl = dvl_buf.index(buf).load(chunk_acc).to(gl.float32)
        kd = warpgroup_mma_wait(num_outstanding=1, deps=(kd, ))
        gl.thread_barrier()  # every warp has read dvl^T
        mbarrier.arrive(dvl_free.index(buf))
        dv2_low = (dvl + kd * decay[None, :]).to(dt)
        hand_off(v2_buf, dv2_low, v2_ready, v2_free, buf, phase)
        mbarrier.wait(w_ready.index(buf), phase)
        state = warpgroup_mma(gl.convert_layout(-dv2_low, a_for_state), w_buf.index(buf), state, is_async=True)
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
        gl.thread_barrier()  # every warp's reads of the slot and of w are done
        mbarrier.arrive(free.index(slot))
        mbarrier.arrive(w_free.index(buf))
        last = last_next
    if STORE_DH0:
        store_state(dh0, state, seq_hv, v_start, V, BV, K, state_acc)


@gluon.jit
def _form_inputs(it, num_chunks, bos, seq_len, scale, q_ring, k_ring, do_ring, t_ring, g_rows, beta_rows, m_stage,
                 kb_stage, dvl_buf, w_buf, ready, free, dvl_ready, dvl_free, w_ready, w_free,
                 K: gl.constexpr, STAGES: gl.constexpr):
    """The helper's part of step it: dvl^T and w for the chain (module docstring)."""
    c, tok0, n_valid = reverse_chunk(it, num_chunks, bos, seq_len)
    slot = it % STAGES
    buf = it % 2
    phase = (it // 2) & 1
    dt: gl.constexpr = q_ring.dtype
    pair_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    key_acc: gl.constexpr = one_warpgroup_accumulator(K)
    key_rows: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8), K // 8], [4, 1], [1, 0])
    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
    s = warpgroup_mma(q_ring.index(slot), k_ring.index(slot).permute((1, 0)),
                      gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False, is_async=True)
    # beta e^B k, the B operand of w, while q k^T runs
    kb_scale = exp2_ftz(g_rows.index(slot).load(gl.SliceLayout(1, key_rows))) \
        * beta_rows.index(slot).load(gl.SliceLayout(1, key_rows))
    k_rows = k_ring.index(slot).load(key_rows).to(gl.float32)
    kb_stage.store((k_rows * kb_scale[:, None]).to(dt))
    fence_async_shared()
    # M = scale (q k^T) . e^(B_i - B_j) on j <= i of valid rows i, exponents only where kept
    ri = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair_acc))
    cj = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, pair_acc))
    b_i = g_rows.index(slot).load(gl.SliceLayout(1, pair_acc))
    b_j = g_rows.index(slot).load(gl.SliceLayout(0, pair_acc))
    keep = (cj[None, :] <= ri[:, None]) & (ri < n_valid)[:, None]
    gamma = exp2_ftz(gl.where(keep, b_i[:, None] - b_j[None, :], float("-inf"))) * scale
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    m_stage.store((s * gamma).to(dt))
    fence_async_shared()
    gl.thread_barrier()  # M and beta e^B k whole in shared memory
    dvl = warpgroup_mma(do_ring.index(slot).permute((1, 0)), m_stage,
                        gl.zeros([BV, CHUNK], gl.float32, pair_acc), use_acc=False, is_async=True)
    w = warpgroup_mma(t_ring.index(slot), kb_stage, gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                      is_async=True)
    dvl = warpgroup_mma_wait(num_outstanding=1, deps=(dvl, ))
    hand_off(dvl_buf, dvl.to(dt), dvl_ready, dvl_free, buf, phase)
    w = warpgroup_mma_wait(num_outstanding=0, deps=(w, ))
    gl.thread_barrier()  # q, k, do and T of the slot read
    mbarrier.arrive(free.index(slot))
    hand_off(w_buf, w.to(dt), w_ready, w_free, buf, phase)


@gluon.jit
def _helper(dh, dv2, cu_seqlens, chunk_offsets, T, scale, v_start, q_ring, k_ring, do_ring, t_ring, g_rows,
            beta_rows, m_stage, kb_stage, d_buf, v2_buf, dvl_buf, w_buf, ready, free, d_ready, d_free, v2_ready,
            v2_free, dvl_ready, dvl_free, w_ready, w_free, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            STAGES: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The helper warpgroup: the chain's inputs a step ahead, then dh[c] from D^T [64, K] and dv2
    from dv2^T [64, 64], each thread a run of V columns (coalesced)."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    chunk0 = first_chunk_state(chunk_offsets, seq_hv, T, HV, IS_VARLEN)
    state_out: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, 4], [0, 1])
    sv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, state_out))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, state_out))
    tc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, state_out))
    if num_chunks > 0:
        _form_inputs(0, num_chunks, bos, seq_len, scale, q_ring, k_ring, do_ring, t_ring, g_rows, beta_rows, m_stage,
                     kb_stage, dvl_buf, w_buf, ready, free, dvl_ready, dvl_free, w_ready, w_free, K, STAGES)
    for it in range(0, num_chunks):
        if it + 1 < num_chunks:
            _form_inputs(it + 1, num_chunks, bos, seq_len, scale, q_ring, k_ring, do_ring, t_ring, g_rows, beta_rows,
                         m_stage, kb_stage, dvl_buf, w_buf, ready, free, dvl_ready, dvl_free, w_ready, w_free, K,
                         STAGES)
        c, tok0, n_valid = reverse_chunk(it, num_chunks, bos, seq_len)
        buf = it % 2
        phase = (it // 2) & 1
        mbarrier.wait(d_ready.index(buf), phase)
        d_t = d_buf.index(buf).load(state_out)
        gl.thread_barrier()
        mbarrier.arrive(d_free.index(buf))
        d_offs = ((chunk0 + c) * HV + hv) * K * V + sk[None, :].to(gl.int64) * V + sv[:, None]
        gl.store(dh + d_offs, d_t, mask=(sv < V)[:, None])
        mbarrier.wait(v2_ready.index(buf), phase)
        v_t = v2_buf.index(buf).load(state_out)
        gl.thread_barrier()
        mbarrier.arrive(v2_free.index(buf))
        v_offs = ((tok0 + tc) * HV + hv)[None, :] * V + sv[:, None]
        gl.store(dv2 + v_offs, v_t.to(dv2.dtype.element_ty), mask=(tc < n_valid)[None, :] & (sv < V)[:, None])


@gluon.jit
def _loader(q, k, do, ai, g_cum, beta, cu_seqlens, T, v_start, q_ring, k_ring, do_ring, t_ring, g_rows, beta_rows,
            ready, free, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
            STAGES: gl.constexpr, HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The load warpgroup: each chunk's q, k, do (this V tile) and T tiles and gate and beta rows
    into the ring (common.fill_ring_slot), last to first."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    head = hv // (HV // HQ)
    row_idx = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [4], [0]))
    for it in range(0, num_chunks):
        fill_ring_slot(q, k, do, ai, g_cum, beta, q_ring, k_ring, do_ring, t_ring, g_rows, beta_rows, ready, free, it,
                       num_chunks - 1 - it, bos, seq_len, head, hv, v_start, row_idx, HQ, HV, K, V, BV, STAGES, HAS_G)


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_ws_kernel(q, k, do, ai, beta, g_cum, dht, dh, dh0, dv2, cu_seqlens, chunk_offsets, T, scale,
                          HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                          STAGES: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr,
                          STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (V tile of 64, sequence x value head); 4 warps here (the chain), plus the
    helper and load warpgroups."""
    dt: gl.constexpr = q.dtype.element_ty
    v_start = gl.program_id(0) * BV
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BV, K], dt)
    row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    k_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    do_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    t_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, CHUNK], square_smem)
    g_rows = gl.allocate_shared_memory(gl.float32, [STAGES, CHUNK], row_smem)
    beta_rows = gl.allocate_shared_memory(gl.float32, [STAGES, CHUNK], row_smem)
    m_stage = gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem)
    kb_stage = gl.allocate_shared_memory(dt, [CHUNK, K], key_smem)
    d_buf = gl.allocate_shared_memory(dt, [2, BV, K], state_smem)
    v2_buf = gl.allocate_shared_memory(dt, [2, BV, CHUNK], value_smem)
    dvl_buf = gl.allocate_shared_memory(dt, [2, BV, CHUNK], value_smem)
    w_buf = gl.allocate_shared_memory(dt, [2, CHUNK, K], key_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    d_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v2_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v2_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dvl_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dvl_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    w_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=129)  # 128 cp.async arrivals, one after the rows
        mbarrier.init(free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(d_ready.index(i), count=1)
        mbarrier.init(d_free.index(i), count=1)
        mbarrier.init(v2_ready.index(i), count=1)
        mbarrier.init(v2_free.index(i), count=1)
        mbarrier.init(dvl_ready.index(i), count=1)
        mbarrier.init(dvl_free.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_free.index(i), count=1)
    gl.warp_specialize([
        (_chain, (dht, dh0, g_cum, cu_seqlens, T, scale, v_start, q_ring, k_ring, do_ring, g_rows, d_buf, v2_buf,
                  dvl_buf, w_buf, ready, free, d_ready, d_free, v2_ready, v2_free, dvl_ready, dvl_free, w_ready,
                  w_free, HV, K, V, STAGES, HAS_G, HAS_DHT, STORE_DH0, IS_VARLEN)),
        (_helper, (dh, dv2, cu_seqlens, chunk_offsets, T, scale, v_start, q_ring, k_ring, do_ring, t_ring, g_rows,
                   beta_rows, m_stage, kb_stage, d_buf, v2_buf, dvl_buf, w_buf, ready, free, d_ready, d_free,
                   v2_ready, v2_free, dvl_ready, dvl_free, w_ready, w_free, HV, K, V, STAGES, IS_VARLEN)),
        (_loader, (q, k, do, ai, g_cum, beta, cu_seqlens, T, v_start, q_ring, k_ring, do_ring, t_ring, g_rows,
                   beta_rows, ready, free, HQ, HV, K, V, STAGES, HAS_G, IS_VARLEN)),
    ], [4, 4], [HELPER_REGS, LOAD_REGS])


def bwd_dhu_ws(layout, q, k, ai, beta, do, g_cum, dht, want_dh0: bool, scale: float, dv_dtype: torch.dtype,
               stages: int = 2):
    """-> (dh [chunk states, HV, K, V] in q's dtype, dh0 fp32 or None, dv2 [B, T, HV, V] in
    dv_dtype), the sequences whole. ai: the forward's T; beta: the op's; do in q's dtype."""
    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=q.device, dtype=q.dtype)
    dv2 = torch.empty(B, T, HV, V, device=q.device, dtype=dv_dtype)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    cu, offsets = (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)
    launch(gdn_bwd_dhu_ws_kernel, (ceil_div(V, 64), layout.num_seqs * HV),
           q, k, do, ai, beta, g_cum, dht, dh, dh0, dv2, cu, offsets, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, STAGES=stages, HAS_G=g_cum is not None, HAS_DHT=dht is not None,
           STORE_DH0=want_dh0, IS_VARLEN=layout.is_varlen, num_warps=4, maxnreg=144)
    return dh, dh0, dv2
