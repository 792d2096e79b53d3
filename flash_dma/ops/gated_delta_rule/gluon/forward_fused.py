"""The forward's state pass and output in one Hopper kernel (Gluon: Triton's explicit-layout
dialect, warpgroup MMA). Per chunk it forms v_new from the kept T, the output and the next
state, so that neither the per-chunk states h nor v_new reach memory: only o and the final
state are written.

The state is carried transposed, h^T [BV, K] as a warpgroup MMA accumulator, so that every
operand that changes per chunk (h^T, the chunk's x^T and v_new^T) is a register A operand and
only loaded tiles (q, k, v, T) are read from shared memory: no register-to-shared store sits on
the chain of dependent products.

    kh^T   = h^T k^T                                    (chain)
    qh^T   = h^T q^T                                    (beside it)
    P^T    = scale (k q^T . e^(B_i - B_j)) on j <= i    (beside it; staged in shared memory)
    x^T    = (v^T - kh^T diag(e^B)) diag(beta)
    vn^T   = x^T T^T                                    (chain)
    o^T    = scale qh^T diag(e^B) + vn^T P^T
    h^T    = e^(B_last) h^T + (vn^T diag(e^(B_last - B))) k   (chain)

Scalar gate or none; K 64 or 128, V a multiple of BV; 16-bit inputs (T in the input type).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait
)

from ....runtime.config import ceil_div
from ....runtime.launch import launch

CHUNK = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _issue_loads(it, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai,
                 q_ring, k_ring, v_ring, t_ring,
                 HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                 STAGES: gl.constexpr, KEY_LOAD: gl.constexpr, VALUE_LOAD: gl.constexpr,
                 SQUARE_LOAD: gl.constexpr):
    """cp.async of chunk `it`'s q, k, v and T tiles into ring slot it % STAGES (rows past the
    sequence, or of a chunk past the last, are zero-filled)."""
    n_valid = gl.maximum(gl.minimum(seq_len - it * CHUNK, CHUNK), 0)
    tok0 = bos + gl.minimum(it, gl.maximum(num_chunks - 1, 0)).to(gl.int64) * CHUNK
    slot = it % STAGES
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, KEY_LOAD))
    kcols = gl.arange(0, K, layout=gl.SliceLayout(0, KEY_LOAD))
    key_mask = (rows < n_valid)[:, None] & (kcols < K)[None, :]
    key_offs = ((tok0 + rows)[:, None] * HQ + head) * K + kcols[None, :]
    async_copy.async_copy_global_to_shared(q_ring.index(slot), q + key_offs, key_mask)
    async_copy.async_copy_global_to_shared(k_ring.index(slot), k + key_offs, key_mask)
    vrows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, VALUE_LOAD))
    vcols = v_start + gl.arange(0, BV, layout=gl.SliceLayout(0, VALUE_LOAD))
    value_mask = (vrows < n_valid)[:, None] & (vcols < V)[None, :]
    async_copy.async_copy_global_to_shared(v_ring.index(slot), v + ((tok0 + vrows)[:, None] * HV + hv) * V
                                           + vcols[None, :], value_mask)
    trows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, SQUARE_LOAD))
    tcols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, SQUARE_LOAD))
    t_mask = (trows < n_valid)[:, None] & (tcols < CHUNK)[None, :]
    async_copy.async_copy_global_to_shared(t_ring.index(slot), ai + ((tok0 + trows)[:, None] * HV + hv) * CHUNK
                                           + tcols[None, :], t_mask)
    async_copy.commit_group()


@gluon.jit
def _chunk_rows(g_cum, beta, c, num_chunks, bos, seq_len, hv, HV: gl.constexpr, idx, HAS_G: gl.constexpr):
    """Chunk c's gate cumsums B in log2 units (B log2(e)), its beta (zero past the sequence) at
    positions idx, and B log2(e) at its last valid row."""
    n_valid = gl.maximum(gl.minimum(seq_len - c * CHUNK, CHUNK), 0)
    tok0 = bos + gl.minimum(c, gl.maximum(num_chunks - 1, 0)).to(gl.int64) * CHUNK
    valid = idx < n_valid
    b_beta = gl.load(beta + (tok0 + idx) * HV + hv, mask=valid, other=0.0).to(gl.float32)
    if HAS_G:
        b = gl.load(g_cum + (tok0 + idx) * HV + hv, mask=valid, other=0.0) * LOG2E
        last = gl.load(g_cum + (tok0 + gl.maximum(n_valid - 1, 0)) * HV + hv, mask=n_valid > 0, other=0.0) * LOG2E
    else:
        b = gl.zeros_like(b_beta)
        last = 0.0
    return b, b_beta, last


@gluon.jit
def _exp2(x):
    """2^x on the MUFU unit alone (denormal results flushed to zero)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _state_offsets(v_start, V: gl.constexpr, BV: gl.constexpr, K: gl.constexpr, layout: gl.constexpr):
    """Offsets and mask of h^T [BV, K] in a [K, V] state: element (v, k) at k * V + v."""
    sv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, layout))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    return sk[None, :] * V + sv[:, None], (sv < V)[:, None] & (sk < K)[None, :]


@gluon.jit(do_not_specialize=["T"])
def gdn_fwd_fused_kernel(q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, T, scale,
                         HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                         BV: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr,
                         HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (V tile of BV, sequence x value head); BV // 16 warps (BV 64: one
    warpgroup, 128: two, which split V and share the chunk's q, k and T tiles)."""
    NW: gl.constexpr = BV // 16
    v_tile = gl.program_id(0)
    seq_hv = gl.program_id(1)
    seq = seq_hv // HV
    hv = seq_hv % HV
    head = hv // (HV // HQ)
    if IS_VARLEN:
        bos = gl.load(cu_seqlens + seq).to(gl.int64)
        seq_len = gl.load(cu_seqlens + seq + 1).to(gl.int64) - bos
    else:
        bos = seq.to(gl.int64) * T
        seq_len = T.to(gl.int64)
    num_chunks = gl.cdiv(seq_len, CHUNK).to(gl.int32)
    v_start = v_tile * BV
    dt: gl.constexpr = q.dtype.element_ty

    # accumulators: h^T [BV, K]; the [BV, 64] chunk products; P^T [64, 64] (warpgroups split
    # its columns where there are two)
    state_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, K, 16])
    chunk_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, CHUNK, 16])
    pair_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NW // 4],
                                                       instr_shape=[16, CHUNK // (NW // 4), 16])
    a_for_chunk: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=chunk_acc, k_width=2)
    a_for_state: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=state_acc, k_width=2)
    key_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8), K // 8], [NW, 1], [1, 0])
    value_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [NW, 1], [1, 0])
    square_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    # o^T stored along V: each thread a run of V columns of one token (coalesced)
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, NW], [0, 1])
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    q_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    k_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem)
    v_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem)
    t_ring = gl.allocate_shared_memory(dt, [STAGES, CHUNK, CHUNK], square_smem)
    p_stage = gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem)  # P^T [j, i]

    if HAS_H0:
        s_offs, s_mask = _state_offsets(v_start, V, BV, K, state_acc)
        state = gl.load(h0 + seq_hv.to(gl.int64) * K * V + s_offs, mask=s_mask, other=0.0)
    else:
        state = gl.zeros([BV, K], gl.float32, state_acc)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))  # the chunk's tokens, as columns
    p_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair_acc))  # j
    p_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, pair_acc))  # i
    log2_scale = gl.log2(scale)
    ov = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, out_layout))
    oc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, out_layout))

    for i in gl.static_range(STAGES - 1):
        _issue_loads(i, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai, q_ring, k_ring, v_ring, t_ring,
                     HQ, HV, K, V, BV, STAGES, key_load, value_load, square_load)
    for c in range(0, num_chunks):
        # every warp is past chunk c - 1's reads of the slot the next loads overwrite
        gl.thread_barrier()
        _issue_loads(c + STAGES - 1, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai,
                     q_ring, k_ring, v_ring, t_ring, HQ, HV, K, V, BV, STAGES, key_load, value_load, square_load)
        b, b_beta, b_last = _chunk_rows(g_cum, beta, c, num_chunks, bos, seq_len, hv, HV, cols, HAS_G)
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        slot = c % STAGES
        tok0 = bos + c.to(gl.int64) * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        k_tile = k_ring.index(slot)
        q_tile = q_ring.index(slot)

        # MMA groups complete in issue order: each wait below leaves only the last one running
        h_a = gl.convert_layout(state.to(dt), a_for_chunk)
        kh = warpgroup_mma(h_a, k_tile.permute((1, 0)), gl.zeros([BV, CHUNK], gl.float32, chunk_acc),
                           use_acc=False, is_async=True)
        qh = warpgroup_mma(h_a, q_tile.permute((1, 0)), gl.zeros([BV, CHUNK], gl.float32, chunk_acc),
                           use_acc=False, is_async=True)
        eb = _exp2(b)
        v_t = v_ring.index(slot).permute((1, 0)).load(chunk_acc)  # v^T [BV, 64]
        kh = warpgroup_mma_wait(num_outstanding=1, deps=(kh, ))
        x = v_t.to(gl.float32) * b_beta[None, :] - kh * (eb * b_beta)[None, :]
        vn = warpgroup_mma(gl.convert_layout(x.to(dt), a_for_chunk), t_ring.index(slot).permute((1, 0)),
                           gl.zeros([BV, CHUNK], gl.float32, chunk_acc), use_acc=False, is_async=True)
        qh = warpgroup_mma_wait(num_outstanding=1, deps=(qh, ))
        pt = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc),
                           use_acc=False, is_async=True)
        out = qh * (eb * scale)[None, :]
        vn = warpgroup_mma_wait(num_outstanding=1, deps=(vn, ))
        decay = gl.where(cols < n_valid, _exp2(b_last - b), 0.0)
        state = warpgroup_mma(gl.convert_layout((vn * decay[None, :]).to(dt), a_for_state), k_tile,
                              state * gl.exp2(b_last), is_async=True)
        # P^T off the chain, while the state product runs
        pt = warpgroup_mma_wait(num_outstanding=1, deps=(pt, ))
        b_j = gl.convert_layout(b, gl.SliceLayout(1, pair_acc))
        b_i = gl.convert_layout(b, gl.SliceLayout(0, pair_acc)) + log2_scale
        p_stage.store(gl.where(p_rows[:, None] <= p_cols[None, :], pt * _exp2(b_i[None, :] - b_j[:, None]),
                               0.0).to(dt))
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of P^T is in shared memory
        out = warpgroup_mma(gl.convert_layout(vn.to(dt), a_for_chunk), p_stage, out, is_async=True)
        out, state = warpgroup_mma_wait(num_outstanding=0, deps=(out, state))
        o_t = gl.convert_layout(out.to(o.dtype.element_ty), out_layout)
        o_offs = ((tok0 + oc) * HV + hv)[None, :] * V + ov[:, None]
        gl.store(o + o_offs, o_t, mask=(oc < n_valid)[None, :] & (ov < V)[:, None])
    async_copy.wait_group(0)
    if STORE_HT:
        # offsets formed again here: kept from the start they would hold registers through the loop
        s_offs, s_mask = _state_offsets(v_start, V, BV, K, state_acc)
        gl.store(ht + seq_hv.to(gl.int64) * K * V + s_offs, state, mask=s_mask)


def forward_fused(layout, q, k, v, beta, ai, g_cum, h0, store_final: bool, scale: float, block_v: int,
                  stages: int = 2, cu_seqlens=None, num_seqs=None):
    """-> (o [B, T, HV, V] in q's dtype, final state fp32 [num_seqs, HV, K, V] or None).
    ai: T per chunk in the inputs' 16-bit type; g_cum: the scalar gate's chunk cumsums or None.
    cu_seqlens / num_seqs: run over other sequences than the layout's (the segments of a
    sequence split, h0 then the segments' starts)."""
    B, T, HQ, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        cu_seqlens = layout.cu_seqlens if layout.is_varlen else None
        num_seqs = layout.num_seqs
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if store_final else None
    launch(gdn_fwd_fused_kernel, (ceil_div(V, block_v), num_seqs * HV),
           q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, BV=block_v, STAGES=stages, HAS_G=g_cum is not None, HAS_H0=h0 is not None,
           STORE_HT=store_final, IS_VARLEN=cu_seqlens is not None, num_warps=block_v // 16)
    return o, ht
