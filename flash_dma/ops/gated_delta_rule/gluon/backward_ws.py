"""The backward after the state pass in one kernel with warp roles: bwd_dhu, its intra-chunk dv
and the chunk-parallel gradients fused. One program per (sequence, value head) walks the chunks
last to first; dh, dv2, dv_local and w never reach memory. Scalar gate or none; K and V 64 or
128; 16-bit inputs; sequences whole.

Roles (gl.warp_specialize):
    chunk math (8 warps)  backward_chunk._chunk_backward in its SEQUENTIAL form: du = dv2 from
                          D's bf16 copy first, then the chunk's dq, dk, dv, dbeta, dg; it also
                          issues the next chunk's tile loads (cp.async)
    state (4 warps)       D = dh[c] in fp32 registers: publishes its bf16 copy, then
                          D <- e^(B_last) D + q^T (scale e^B do) + k^T (-beta e^B T^T dv2)
                          from the operands the chunk math leaves in do_s and du_s
The chain from one chunk's D to the next is the chunk math's k D, M^T do and T^T dv2, then the
state role's two products; the rest of the chunk math (dT, dA, dk's WY terms) runs beside the
update. Tiles are single-buffered (the chunk math's twelve fill shared memory), so each group is
refilled once its last reader has passed: h / v_new / v after the chunk math's dbeta, q / k / T
/ do after the chunk and the state role's update.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ....runtime.launch import launch
from .backward_chunk import (
    BAR_D_FREE, BAR_D_READY, BAR_UPDATE_DONE, BAR_UPDATE_READY, NUM_BARS, _allocate, _chunk_backward,
    gradient_buffers, issue_key_tiles, issue_state_tiles
)
from .common import (
    CHUNK, first_chunk_state, last_gate, one_warpgroup_accumulator, reverse_chunk, sequence_of_program
)

STATE_REGS = gl.constexpr(168)


@gluon.jit
def _step(it, num_chunks, bos, seq_len):
    """common.reverse_chunk with the valid rows as int32, as the chunk math takes them."""
    c, tok0, n_valid = reverse_chunk(it, num_chunks, bos, seq_len)
    return c, tok0, n_valid.to(gl.int32)


@gluon.jit
def _opaque_zero(x):
    """0, from an instruction the compiler does not look into (not pure: never hoisted)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _chunk_math(q, k, v, v_new, h, do, ai, dq, dk, dv, dbeta, dg, g_cum, beta, cu_seqlens, chunk_offsets, T, scale,
                do_b, vn_b, h_b, dh_b, du_b, v_b, q_b, k_b, t_b, dw_b, pair_b, dt_b, bars, HQ: gl.constexpr,
                HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The chunk math's warps: each chunk's gradients, and the loads of the next chunk's tiles as
    they are read out (h, v_new, v within the chunk math; q, k, T, do after it and the state
    role's update)."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    head = hv // (HV // HQ)
    chunk0 = first_chunk_state(chunk_offsets, seq_hv, T, HV, IS_VARLEN)
    if num_chunks > 0:
        c, tok0, n_valid = _step(0, num_chunks, bos, seq_len)
        issue_key_tiles(q, k, ai, do, q_b.index(0), k_b.index(0), t_b.index(0), do_b.index(0), tok0, n_valid, head,
                        hv, HQ, HV, K, V)
        issue_state_tiles(v, v_new, h, vn_b.index(0), h_b.index(0), v_b.index(0), tok0, n_valid,
                          (chunk0 + c) * HV + hv, hv, HV, K, V)
    for it in range(0, num_chunks):
        c, tok0, n_valid = _step(it, num_chunks, bos, seq_len)
        has_next = it + 1 < num_chunks
        next_c, next_tok0, next_n_valid = _step(gl.minimum(it + 1, num_chunks - 1), num_chunks, bos, seq_len)
        z = _opaque_zero(it)
        do_s, vn_s, h_s, dh_s, du_s, v_s = do_b.index(z), vn_b.index(z), h_b.index(z), dh_b.index(z), du_b.index(z), \
            v_b.index(z)
        q_s, k_s, t_s, dw_s, pair_s, dt_s = q_b.index(z), k_b.index(z), t_b.index(z), dw_b.index(z), pair_b.index(z), \
            dt_b.index(z)
        _chunk_backward(dq, dk, dv, dbeta, dg, g_cum, beta, hv, tok0, n_valid, scale,
                        do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s, bars, it & 1, z,
                        v, v_new, h, next_tok0, next_n_valid, (chunk0 + next_c) * HV + hv, has_next,
                        HV, K, V, HAS_G, True)
        # q, k and T read out by every warp; do, q, k and du by the state role's update
        mbarrier.wait(bars.index(BAR_UPDATE_DONE), it & 1)
        gl.thread_barrier()
        if has_next:
            issue_key_tiles(q, k, ai, do, q_s, k_s, t_s, do_s, next_tok0, next_n_valid, head, hv, HQ, HV, K, V)


@gluon.jit
def _publish_state(lo, hi, dh_s, bars, phase, K: gl.constexpr):
    """dh[c] = D's bf16 copy for the chunk math, once it has read the previous copy; a half at a
    time (few registers beside D's)."""
    mbarrier.wait(bars.index(BAR_D_FREE), phase ^ 1)
    dh_s.slice(0, CHUNK).store(lo.to(dh_s.dtype))
    if K == 2 * CHUNK:
        dh_s.slice(CHUNK, CHUNK).store(hi.to(dh_s.dtype))
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bars.index(BAR_D_READY))


@gluon.jit
def _update_half(half, decay, row0: gl.constexpr, q_s, k_s, do_s, du_s):
    """Rows row0.. of D <- decay D + q^T (scale e^B do) + k^T (-beta e^B T^T dv2), issued."""
    half = warpgroup_mma(q_s.slice(row0, CHUNK, dim=1).permute((1, 0)), do_s, half * decay, is_async=True)
    return warpgroup_mma(k_s.slice(row0, CHUNK, dim=1).permute((1, 0)), du_s, half, is_async=True)


@gluon.jit
def _state_offsets(seq_hv, row0: gl.constexpr, K: gl.constexpr, V: gl.constexpr, layout: gl.constexpr,
                   OPAQUE: gl.constexpr):
    """Offsets of rows row0..+64 of the [K, V] state seq_hv in `layout`. OPAQUE: from row indices
    the compiler cannot see through, so that the store after the loop does not keep the start's
    offsets (int64, as many registers as D) alive across it."""
    rows = row0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    if OPAQUE:
        rows = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows], dtype=gl.int32, is_pure=False, pack=1)
    cols = gl.arange(0, V, layout=gl.SliceLayout(0, layout))
    return seq_hv.to(gl.int64) * K * V + rows[:, None] * V + cols[None, :]


@gluon.jit
def _state(dht, dh0, g_cum, cu_seqlens, T, dh_s, do_s, du_s, q_s, k_s, bars, HV: gl.constexpr, K: gl.constexpr,
           V: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
           IS_VARLEN: gl.constexpr):
    """The state role (module docstring): D [K, V] as its one warpgroup's MMA accumulators, rows
    0..63 and (K = 128) 64..127."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    dh_s, do_s, du_s, q_s, k_s = dh_s.index(0), do_s.index(0), du_s.index(0), q_s.index(0), k_s.index(0)
    state_acc: gl.constexpr = one_warpgroup_accumulator(V)
    if HAS_DHT:
        lo = gl.load(dht + _state_offsets(seq_hv, 0, K, V, state_acc, False))
        hi = gl.load(dht + _state_offsets(seq_hv, CHUNK, K, V, state_acc, False), mask=K > CHUNK, other=0.0)
    else:
        lo = gl.zeros([CHUNK, V], gl.float32, state_acc)
        hi = gl.zeros([CHUNK, V], gl.float32, state_acc)
    if num_chunks > 0:
        _publish_state(lo, hi, dh_s, bars, 0, K)
    for it in range(0, num_chunks):
        c, tok0, n_valid = _step(it, num_chunks, bos, seq_len)
        decay = gl.exp2(last_gate(g_cum, tok0, n_valid, hv, HV, HAS_G))
        mbarrier.wait(bars.index(BAR_UPDATE_READY), it & 1)
        lo = _update_half(lo, decay, 0, q_s, k_s, do_s, du_s)
        if K == 2 * CHUNK:
            hi = _update_half(hi, decay, CHUNK, q_s, k_s, do_s, du_s)
        lo, hi, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(lo, hi, q_s, k_s, do_s, du_s))
        gl.thread_barrier()  # every warp's products have read do_s, q_s, k_s and du_s
        mbarrier.arrive(bars.index(BAR_UPDATE_DONE))
        if it + 1 < num_chunks:
            _publish_state(lo, hi, dh_s, bars, (it + 1) & 1, K)
    if STORE_DH0:
        gl.store(dh0 + _state_offsets(seq_hv, 0, K, V, state_acc, True), lo)
        if K == 2 * CHUNK:
            gl.store(dh0 + _state_offsets(seq_hv, CHUNK, K, V, state_acc, True), hi)


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_ws_kernel(q, k, v, v_new, h, do, ai, g_cum, beta, dht, dq, dk, dv, dbeta, dg, dh0, cu_seqlens,
                      chunk_offsets, T, scale, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                      V: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
                      IS_VARLEN: gl.constexpr):
    """One program per (sequence, value head): 8 warps of chunk math here, plus the state
    warpgroup."""
    do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s = _allocate(q.dtype.element_ty, K, V, True)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BARS):
        mbarrier.init(bars.index(i), count=1)
    gl.warp_specialize([
        (_chunk_math, (q, k, v, v_new, h, do, ai, dq, dk, dv, dbeta, dg, g_cum, beta, cu_seqlens, chunk_offsets, T,
                       scale, do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s, bars, HQ, HV, K, V,
                       HAS_G, IS_VARLEN)),
        (_state, (dht, dh0, g_cum, cu_seqlens, T, dh_s, do_s, du_s, q_s, k_s, bars, HV, K, V, HAS_G, HAS_DHT,
                  STORE_DH0, IS_VARLEN)),
    ], [4], [STATE_REGS])


def bwd_sequential(layout, q, k, v, v_new, h, do, ai, g_cum, beta, dht, want_dh0: bool, scale: float):
    """-> (dq, dk, dv, dbeta fp32, dg fp32 or None, dh0 fp32 or None), the sequences whole; dq and
    dk per value head as backward_chunk.bwd_chunk gives them. h, v_new: the state pass's; ai: the
    forward's T; do in q's dtype; dht fp32 or None."""
    B, T, HQ, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dq, dk, dv, dbeta, dg = gradient_buffers(q, v, g_cum is not None)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    cu, offsets = (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)
    launch(gdn_bwd_ws_kernel, (1, layout.num_seqs * HV),
           q, k, v, v_new, h, do, ai, g_cum, beta, dht, dq, dk, dv, dbeta, dg, dh0, cu, offsets, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, HAS_G=g_cum is not None, HAS_DHT=dht is not None, STORE_DH0=want_dh0,
           IS_VARLEN=layout.is_varlen, num_warps=8, maxnreg=168)
    return dq, dk, dv, dbeta, dg, dh0
