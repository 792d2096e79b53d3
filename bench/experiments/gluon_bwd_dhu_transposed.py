"""Experiment: bwd_dhu with the state transposed (D^T [BV, K], BV = 64 rows per warpgroup), so that
every chain operand that changes per chunk (D^T, -dv2^T, scale e^g do^T) is a register A operand
of wgmma and only the chunk's loads (q, k, w, do, dv) sit in shared memory:
    kd^T  = D^T k^T                       (A = D^T registers, B = k^T from the k tile)
    dv2^T = dv^T + kd^T . e^(g_last - g)  (per column)
    D^T   = e^(g_last) D^T + (scale e^g do)^T q - dv2^T w   (B = q, w tiles, N-contiguous)
Scalar gate or none; dht / dh0; fixed lengths or varlen. Not part of the package.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

CHUNK = gl.constexpr(64)


@gluon.jit
def _issue_loads(it, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                 q_ring, k_ring, w_ring, do_ring, dv_ring,
                 HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                 STAGES: gl.constexpr, KEY_LOAD: gl.constexpr, VALUE_LOAD: gl.constexpr):
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
def _gate_cols(g_cum, c, bos, seq_len, hv, HV: gl.constexpr, cols):
    n_valid = gl.where(c >= 0, gl.minimum(seq_len - c * CHUNK, CHUNK), 0)
    tok0 = bos + gl.maximum(c, 0).to(gl.int64) * CHUNK
    b = gl.load(g_cum + (tok0 + cols) * HV + hv, mask=cols < n_valid, other=0.0)
    last = gl.load(g_cum + (tok0 + gl.maximum(n_valid - 1, 0)) * HV + hv, mask=n_valid > 0, other=0.0)
    return b, last


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_t_kernel(q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu_seqlens, chunk_offsets, T, scale,
                         HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                         BV: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr,
                         STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
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

    # D^T [BV, K]: accumulator of the state products; kd^T [BV, 64]: of k's
    state_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    chunk_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, CHUNK, 16])
    a_for_chunk: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=chunk_acc, k_width=2)
    a_for_state: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=state_acc, k_width=2)
    key_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8), K // 8], [4, 1], [1, 0])
    value_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [4, 1], [1, 0])
    # stores along V: each thread a run of V columns of one K row (coalesced)
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, 4], [0, 1])
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    stage_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])
    d_stage = gl.allocate_shared_memory(dt, [BV, K], stage_layout)  # D^T on its way to dh
    dv2_stage = gl.allocate_shared_memory(dt, [BV, CHUNK], stage_layout)
    q_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    k_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    w_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    do_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    dv_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)

    # D^T's element (v, k) lives at k * V + v of a [K, V] state
    sv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, state_acc))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, state_acc))
    s_offs = sk.to(gl.int64)[None, :] * V + sv[:, None]
    s_mask = (sv < V)[:, None] & (sk < K)[None, :]
    ov = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, out_layout))
    ok = gl.arange(0, K, layout=gl.SliceLayout(0, out_layout))
    o_offs = ok.to(gl.int64)[None, :] * V + ov[:, None]
    o_mask = (ov < V)[:, None] & (ok < K)[None, :]
    out_chunk: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, 4], [0, 1])
    ocv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, out_chunk))
    oc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, out_chunk))
    if HAS_DHT:
        state = gl.load(dht + seq_hv.to(gl.int64) * K * V + s_offs, mask=s_mask, other=0.0)
    else:
        state = gl.zeros([BV, K], gl.float32, state_acc)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))  # the chunk's rows, as columns
    cv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, chunk_acc))
    if HAS_G:
        b_next, b_last_next = _gate_cols(g_cum, num_chunks - 1, bos, seq_len, hv, HV, cols)
    for i in gl.static_range(STAGES - 1):
        _issue_loads(i, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                     q_ring, k_ring, w_ring, do_ring, dv_ring, HQ, HV, K, V, BV, STAGES, key_load, value_load)
    for it in range(0, num_chunks):
        _issue_loads(it + STAGES - 1, num_chunks, bos, seq_len, head, hv, v_start, q, k, w, do, dv,
                     q_ring, k_ring, w_ring, do_ring, dv_ring, HQ, HV, K, V, BV, STAGES, key_load, value_load)
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        c = num_chunks - 1 - it
        slot = it % STAGES
        tok0 = bos + c.to(gl.int64) * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        valid = cols < n_valid
        d_low = state.to(dt)
        kd = warpgroup_mma(gl.convert_layout(d_low, a_for_chunk), k_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        if HAS_G:
            b = b_next
            b_last = b_last_next
            b_next, b_last_next = _gate_cols(g_cum, c - 1, bos, seq_len, hv, HV, cols)
            do_scale = gl.where(valid, gl.exp(b) * scale, 0.0)
            kd_scale = gl.where(valid, gl.exp(b_last - b), 0.0)
            state = state * gl.exp(b_last)
        else:
            do_scale = gl.where(valid, scale, 0.0)
            kd_scale = gl.where(valid, 1.0, 0.0)
        do_t = do_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32)  # do^T [BV, 64]
        do_a = gl.convert_layout((do_t * do_scale[None, :]).to(dt), a_for_state)
        state = warpgroup_mma(do_a, q_ring.index(slot), state, is_async=True)
        dv_t = dv_ring.index(slot).permute((1, 0)).load(chunk_acc).to(gl.float32)
        kd = warpgroup_mma_wait(num_outstanding=1, deps=(kd, ))
        dv2_t = dv_t + kd * kd_scale[None, :]
        state = warpgroup_mma(gl.convert_layout((-dv2_t).to(dt), a_for_state), w_ring.index(slot), state,
                              is_async=True)
        # stores off the chain, while the state product runs
        d_stage.store(d_low)
        dv2_stage.store(dv2_t.to(dv2.dtype.element_ty))
        gl.store(dh + ((chunk0 + c) * HV + hv) * K * V + o_offs, d_stage.load(out_layout), mask=o_mask)
        dv2_out = dv2_stage.load(out_chunk)
        dv2_offs = ((tok0 + oc) * HV + hv)[None, :] * V + ocv[:, None]
        gl.store(dv2 + dv2_offs, dv2_out, mask=(oc < n_valid)[None, :] & (ocv < V)[:, None])
        state = warpgroup_mma_wait(num_outstanding=0, deps=(state, ))
    async_copy.wait_group(0)
    if STORE_DH0:
        gl.store(dh0 + seq_hv.to(gl.int64) * K * V + s_offs, state, mask=s_mask)


def bwd_dhu_t(layout, q, k, w, do, dv, g_cum, dht, want_dh0: bool, scale: float, block_v: int = 64,
              stages: int = 2):
    import torch

    from flash_dma.ops.gated_delta_rule.triton.common import seq_args
    from flash_dma.runtime.config import ceil_div

    B, T, HQ, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    dev = q.device
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=dev, dtype=q.dtype)
    dv2 = torch.empty_like(dv)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=dev, dtype=torch.float32) if want_dh0 else None
    cu, offsets = seq_args(layout)
    gdn_bwd_dhu_t_kernel[(ceil_div(V, block_v), layout.num_seqs * HV)](
        q, k, w, do, dv, g_cum, dht, dh, dh0, dv2, cu, offsets, T, scale,
        HQ=HQ, HV=HV, K=K, V=V, BV=block_v, STAGES=stages, HAS_G=g_cum is not None, HAS_DHT=dht is not None,
        STORE_DH0=want_dh0, IS_VARLEN=layout.is_varlen, num_warps=4)
    return dh, dh0, dv2
