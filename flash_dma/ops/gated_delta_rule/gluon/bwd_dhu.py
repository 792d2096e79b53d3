"""bwd_dhu on Hopper's asynchronous warpgroup MMA (Gluon, Triton's explicit-layout dialect).

The same recursion as triton/bwd_dhu.py, chunks from last to first, D the state gradient at a
chunk's end:
    dh[c] = D;  dv2[c] = dv[c] + e^(g_last - g) (k[c] D)
    D = e^(g_last) D + scale (q[c] e^g)^T do[c] - w[c]^T dv2[c]
What Triton 3.6 cannot say and this kernel does: the three products of a chunk are issued
asynchronously (wgmma), so q^T do, which does not depend on D, runs beside k D instead of after
it; only k D and w^T dv2 stay on the chain from one chunk to the next. The state D is the fp32
accumulator of the last two products, in registers for the whole sequence. q, k, w, do and dv
of the chunks ahead stream into a ring of shared-memory stages by cp.async while a chunk
computes (masked rows arrive as zeros, so no row of another sequence reaches a product).

Serves the scalar gate or none, with or without dht and dh0, fixed lengths and varlen, on SM90;
everything else (gk, the sequence split's transition passes) stays on the Triton kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

CHUNK = gl.constexpr(64)


@gluon.jit
def _issue_loads(it, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                 q_ring, k_ring, w_ring, do_ring, dv_ring,
                 HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                 STAGES: gl.constexpr, KEY_LOAD: gl.constexpr, VALUE_LOAD: gl.constexpr):
    """cp.async of iteration `it`'s chunk (chunk num_chunks - 1 - it) into ring slot it % STAGES,
    one commit group; past the first chunk every load is masked off (an empty group)."""
    c = num_chunks - 1 - it
    n_valid = gl.where(c >= 0, gl.minimum(seq_len - c * CHUNK, CHUNK), 0)
    tok0 = bos + gl.maximum(c, 0).to(gl.int64) * CHUNK
    slot = it % STAGES
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, KEY_LOAD))
    kcols = gl.arange(0, K, layout=gl.SliceLayout(0, KEY_LOAD))
    key_mask = (rows < n_valid)[:, None] & (kcols < K)[None, :]
    tok = (tok0 + rows)[:, None]
    async_copy.async_copy_global_to_shared(q_ring.index(slot), q + (tok * HQ + head) * K + kcols[None, :], key_mask)
    async_copy.async_copy_global_to_shared(k_ring.index(slot), k + (tok * HQ + head) * K + kcols[None, :], key_mask)
    async_copy.async_copy_global_to_shared(w_ring.index(slot), w + (tok * HV + hv) * K + kcols[None, :], key_mask)
    vrows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, VALUE_LOAD))
    vcols = v_start + gl.arange(0, BV, layout=gl.SliceLayout(0, VALUE_LOAD))
    value_mask = (vrows < n_valid)[:, None] & (vcols < V)[None, :]
    vtok = (tok0 + vrows)[:, None]
    async_copy.async_copy_global_to_shared(do_ring.index(slot), do + (vtok * HV + hv) * V + vcols[None, :], value_mask)
    async_copy.async_copy_global_to_shared(dv_ring.index(slot), dv + (vtok * HV + hv) * V + vcols[None, :], value_mask)
    async_copy.commit_group()


@gluon.jit
def _gate_rows(g_cum, c, bos, seq_len, hv, HV: gl.constexpr, rows):
    """(g_cum over chunk c's rows, 0 past its end; g_cum at its last row); c < 0 reads nothing."""
    n_valid = gl.where(c >= 0, gl.minimum(seq_len - c * CHUNK, CHUNK), 0)
    tok0 = bos + gl.maximum(c, 0).to(gl.int64) * CHUNK
    b_row = gl.load(g_cum + (tok0 + rows) * HV + hv, mask=rows < n_valid, other=0.0)
    last = gl.load(g_cum + (tok0 + gl.maximum(n_valid - 1, 0)) * HV + hv, mask=n_valid > 0, other=0.0)
    return b_row, last


@gluon.jit
def _operands_ready():
    """Shared-memory writes of every thread (registers or cp.async) made visible to wgmma."""
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_wgmma_kernel(q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu_seqlens, chunk_offsets, T, scale,
                             HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                             BV: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr,
                             STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program (one warpgroup) per (V tile, sequence, value head)."""
    v_tile = gl.program_id(0)
    seq_hv = gl.program_id(1)
    seq = seq_hv // HV
    hv = seq_hv % HV
    head = hv // (HV // HQ)
    if IS_VARLEN:
        bos = gl.load(cu_seqlens + seq).to(gl.int64)
        seq_len = gl.load(cu_seqlens + seq + 1).to(gl.int64) - bos
        chunk0 = gl.load(chunk_offsets + seq).to(gl.int64)
    else:
        bos = seq.to(gl.int64) * T
        seq_len = T.to(gl.int64)
        chunk0 = seq.to(gl.int64) * gl.cdiv(T, CHUNK)
    num_chunks = gl.cdiv(seq_len, CHUNK).to(gl.int32)
    v_start = v_tile * BV
    dt: gl.constexpr = q.dtype.element_ty

    # the accumulator layout of every product: the state [K, BV] and the chunk's [64, BV]
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc)
    acc_cols: gl.constexpr = gl.SliceLayout(0, acc)
    key_vec: gl.constexpr = 8 if K >= 8 else K  # 16-byte cp.async per thread
    key_load: gl.constexpr = gl.BlockedLayout([1, key_vec], [32 // (K // key_vec), K // key_vec], [4, 1], [1, 0])
    value_vec: gl.constexpr = 8 if BV >= 8 else BV
    value_load: gl.constexpr = gl.BlockedLayout([1, value_vec], [32 // (BV // value_vec), BV // value_vec], [4, 1],
                                                [1, 0])
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dt)
    q_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    k_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    w_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    do_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    dv_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    d_op = gl.allocate_shared_memory(dt, [K, BV], state_smem)  # D, the B operand of k D
    do_op = gl.allocate_shared_memory(dt, [CHUNK, BV], value_smem)  # scale e^g do
    dv2_op = gl.allocate_shared_memory(dt, [CHUNK, BV], value_smem)  # -dv2

    krows = gl.arange(0, K, layout=acc_rows)
    vcols = v_start + gl.arange(0, BV, layout=acc_cols)
    state_mask = (krows < K)[:, None] & (vcols < V)[None, :]
    state_offs = krows.to(gl.int64)[:, None] * V + vcols[None, :]
    if HAS_DHT:
        state = gl.load(dht + (seq_hv.to(gl.int64) * K) * V + state_offs, mask=state_mask, other=0.0)
    else:
        state = gl.zeros([K, BV], gl.float32, acc)
    rows = gl.arange(0, CHUNK, layout=acc_rows)

    # the gate rows are read one chunk ahead into registers (a load at use sat on the chain)
    if HAS_G:
        b_row_next, b_last_next = _gate_rows(g_cum, num_chunks - 1, bos, seq_len, hv, HV, rows)
    for i in gl.static_range(STAGES - 1):
        _issue_loads(i, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                     q_ring, k_ring, w_ring, do_ring, dv_ring, HQ, HV, K, V, BV, STAGES, key_load, value_load)
    for it in range(0, num_chunks):
        # the chunk STAGES - 1 ahead goes into the slot the previous chunk freed
        _issue_loads(it + STAGES - 1, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                     q_ring, k_ring, w_ring, do_ring, dv_ring, HQ, HV, K, V, BV, STAGES, key_load, value_load)
        async_copy.wait_group(STAGES - 1)
        c = num_chunks - 1 - it
        slot = it % STAGES
        tok0 = bos + c.to(gl.int64) * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        valid = rows < n_valid
        d_low = state.to(dt)
        gl.store(dh + ((chunk0 + c) * HV + hv) * K * V + state_offs, d_low, mask=state_mask)
        d_op.store(d_low)
        _operands_ready()
        kd = warpgroup_mma(k_ring.index(slot), d_op, gl.zeros([CHUNK, BV], gl.float32, acc), use_acc=False,
                           is_async=True)
        # off the chain while k D runs: the gates, do's rows scaled, dv
        if HAS_G:
            b_row = b_row_next
            b_last = b_last_next
            b_row_next, b_last_next = _gate_rows(g_cum, c - 1, bos, seq_len, hv, HV, rows)
            do_scale = gl.where(valid, gl.exp(b_row) * scale, 0.0)
            kd_scale = gl.where(valid, gl.exp(b_last - b_row), 0.0)
            state = state * gl.exp(b_last)
        else:
            do_scale = gl.where(valid, scale, 0.0)
            kd_scale = gl.where(valid, 1.0, 0.0)
        do_t = do_ring.index(slot).load(acc).to(gl.float32)
        do_op.store((do_t * do_scale[:, None]).to(dt))
        dv_t = dv_ring.index(slot).load(acc).to(gl.float32)
        _operands_ready()
        state = warpgroup_mma(q_ring.index(slot).permute((1, 0)), do_op, state, is_async=True)
        kd = warpgroup_mma_wait(num_outstanding=1, deps=(kd, ))
        dv2_t = dv_t + kd * kd_scale[:, None]
        vrow_offs = ((tok0 + rows) * HV + hv)[:, None] * V + vcols[None, :]
        gl.store(dv2 + vrow_offs, dv2_t.to(dv2.dtype.element_ty), mask=valid[:, None] & (vcols < V)[None, :])
        dv2_op.store((-dv2_t).to(dt))
        _operands_ready()
        state = warpgroup_mma(w_ring.index(slot).permute((1, 0)), dv2_op, state, is_async=True)
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
    async_copy.wait_group(0)
    if STORE_DH0:
        gl.store(dh0 + (seq_hv.to(gl.int64) * K) * V + state_offs, state, mask=state_mask)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def bwd_dhu_wgmma(layout, q, k, w, do, dv, g_cum, dht, want_dh0: bool, scale: float, block_v: int, stages: int):
    """-> (dh [B * NT or slots, HV, K, V] in q's dtype, dh0 or None, dv2 like dv): the outputs of
    triton/bwd_dhu.bwd_dhu, for the calls this kernel serves (module docstring)."""
    import torch

    from ....runtime.config import ceil_div
    from ....runtime.launch import launch
    from ..triton.common import seq_args

    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dev = q.device
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=dev, dtype=q.dtype)
    dv2 = torch.empty_like(dv)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=dev, dtype=torch.float32) if want_dh0 else None
    cu, offsets = seq_args(layout)
    launch(gdn_bwd_dhu_wgmma_kernel, (ceil_div(V, block_v), layout.num_seqs * HV),
           q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu, offsets, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, BV=block_v, STAGES=stages, HAS_G=g_cum is not None, HAS_DHT=dht is not None,
           STORE_DH0=want_dh0, IS_VARLEN=layout.is_varlen, num_warps=4)
    return dh, dh0, dv2
