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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait
)

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from .common import (
    CHUNK, allocate_ring, copy_chunk_tiles, exp2_ftz, gate_rows, last_gate, output_buffers, sequence_of_program,
    start_state, store_state, store_output
)


@gluon.jit
def _issue_loads(it, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai, q_ring, k_ring, v_ring, t_ring,
                 HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                 STAGES: gl.constexpr, NW: gl.constexpr):
    """Chunk `it`'s tiles into ring slot it % STAGES as one cp.async group (a chunk past the last
    loads nothing but zeros)."""
    n_valid = gl.maximum(gl.minimum(seq_len - it * CHUNK, CHUNK), 0)
    tok0 = bos + gl.minimum(it, gl.maximum(num_chunks - 1, 0)).to(gl.int64) * CHUNK
    slot = it % STAGES
    copy_chunk_tiles(q, k, v, ai, q_ring.index(slot), k_ring.index(slot), v_ring.index(slot), t_ring.index(slot),
                     tok0, n_valid, head, hv, v_start, HQ, HV, K, V, BV, NW)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["T"])
def gdn_fwd_fused_kernel(q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, order, T, scale,
                         HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                         BV: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr,
                         HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (V tile of BV, sequence x value head); BV // 16 warps (BV 64: one
    warpgroup, 128: two, which split V and share the chunk's q, k and T tiles). order: see
    common.sequence_of_program (a tensor argument before the constexprs, so that runtime.launch
    can replay the launch)."""
    NW: gl.constexpr = BV // 16
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    head = hv // (HV // HQ)
    v_start = gl.program_id(0) * BV
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
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    q_ring, k_ring, v_ring, t_ring = allocate_ring(dt, K, BV, STAGES)
    p_stage = gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem)  # P^T [j, i]

    state = start_state(h0, seq_hv, v_start, V, BV, K, state_acc, HAS_H0)
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_acc))  # the chunk's tokens, as columns
    p_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair_acc))  # j
    p_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, pair_acc))  # i
    log2_scale = gl.log2(scale)

    for i in gl.static_range(STAGES - 1):
        _issue_loads(i, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai, q_ring, k_ring, v_ring, t_ring,
                     HQ, HV, K, V, BV, STAGES, NW)
    for c in range(0, num_chunks):
        # every warp is past chunk c - 1's reads of the slot the next loads overwrite
        gl.thread_barrier()
        _issue_loads(c + STAGES - 1, num_chunks, bos, seq_len, head, hv, v_start, q, k, v, ai,
                     q_ring, k_ring, v_ring, t_ring, HQ, HV, K, V, BV, STAGES, NW)
        tok0 = bos + c.to(gl.int64) * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        b, b_beta = gate_rows(g_cum, beta, tok0, n_valid, hv, HV, cols, HAS_G)
        b_last = last_gate(g_cum, tok0, n_valid, hv, HV, HAS_G)
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        slot = c % STAGES
        k_tile = k_ring.index(slot)
        q_tile = q_ring.index(slot)

        # MMA groups complete in issue order: each wait below leaves only the last one running
        h_a = gl.convert_layout(state.to(dt), a_for_chunk)
        kh = warpgroup_mma(h_a, k_tile.permute((1, 0)), gl.zeros([BV, CHUNK], gl.float32, chunk_acc),
                           use_acc=False, is_async=True)
        qh = warpgroup_mma(h_a, q_tile.permute((1, 0)), gl.zeros([BV, CHUNK], gl.float32, chunk_acc),
                           use_acc=False, is_async=True)
        eb = exp2_ftz(b)
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
        decay = gl.where(cols < n_valid, exp2_ftz(b_last - b), 0.0)
        state = warpgroup_mma(gl.convert_layout((vn * decay[None, :]).to(dt), a_for_state), k_tile,
                              state * gl.exp2(b_last), is_async=True)
        # P^T off the chain, while the state product runs
        pt = warpgroup_mma_wait(num_outstanding=1, deps=(pt, ))
        b_j = gl.convert_layout(b, gl.SliceLayout(1, pair_acc))
        b_i = gl.convert_layout(b, gl.SliceLayout(0, pair_acc)) + log2_scale
        p_stage.store(gl.where(p_rows[:, None] <= p_cols[None, :], pt * exp2_ftz(b_i[None, :] - b_j[:, None]),
                               0.0).to(dt))
        fence_async_shared()
        gl.thread_barrier()  # every warp's part of P^T is in shared memory
        out = warpgroup_mma(gl.convert_layout(vn.to(dt), a_for_chunk), p_stage, out, is_async=True)
        out, state = warpgroup_mma_wait(num_outstanding=0, deps=(out, state))
        store_output(o, out, tok0, n_valid, hv, HV, V, v_start, BV, NW)
    async_copy.wait_group(0)
    if STORE_HT:
        # offsets formed again here: kept from the start they would hold registers through the loop
        store_state(ht, state, seq_hv, v_start, V, BV, K, state_acc)


def forward_fused(layout, q, k, v, beta, ai, g_cum, h0, store_final: bool, scale: float, block_v: int,
                  stages: int = 2, cu_seqlens=None, num_seqs=None, order=None):
    """-> (o [B, T, HV, V] in q's dtype, final state fp32 [num_seqs, HV, K, V] or None).
    ai: T per chunk in the inputs' 16-bit type; g_cum: the scalar gate's chunk cumsums or None.
    cu_seqlens / num_seqs: run over other sequences than the layout's (the segments of a
    sequence split, h0 then the segments' starts). order: the sequences in the order their
    programs run (layout.longest_first), or None."""
    T, HQ, K = q.shape[1:]
    HV, V = v.shape[2], v.shape[3]
    o, ht, cu_seqlens, num_seqs = output_buffers(layout, q, v, store_final, cu_seqlens, num_seqs)
    launch(gdn_fwd_fused_kernel, (ceil_div(V, block_v), num_seqs * HV),
           q, k, v, beta, ai, g_cum, h0, o, ht, cu_seqlens, order, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, BV=block_v, STAGES=stages, HAS_G=g_cum is not None, HAS_H0=h0 is not None,
           STORE_HT=store_final, IS_VARLEN=cu_seqlens is not None, num_warps=block_v // 16)
    return o, ht
