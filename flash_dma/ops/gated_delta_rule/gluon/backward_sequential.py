"""The backward's state-gradient pass and chunk gradients in one sequential SM90 kernel: one
program per (sequence, value head) walks its chunks last to first, carrying the state gradient
D (the gradient at the chunk's end) and running, per chunk, what the Triton path spreads over the
local_dv pass, bwd_dhu and the fused chunk kernel (backward_chunk.py): neither dh, dv2, dv_local
nor w reaches memory. It reads the per-chunk states h[c] and v_new of the backward's state pass.

Per chunk, with B the gate cumsums, T the WY inverse, P^T = scale (k q^T . e^(B_i - B_j)) on
j <= i:
    dv2 = e^(B_last - B) (k D) + P^T do            (D in shared memory as bf16: dh_s)
    the chunk's dq, dk, dv, dbeta, dg              (backward_chunk._chunk_backward, unchanged)
    D  <- e^(B_last) D + (scale e^B q)^T do - (beta e^B k)^T (T^T dv2)
          (w^T dv2 = k^T diag(beta e^B) T^T dv2: w is never formed)
D in fp32 lives in a per-program scratch tile in global memory (L2-resident; 64 KB at
K = V = 128) between its updates: the chunk math needs every register the program has.

One role, everything in order: the chain is not hidden behind the chunk math (a warp-role form
would be, docs/perf/gated_delta_rule.md), so it pays where (sequence, value head) pairs fill the
GPU. Scalar gate or none; K = V, 64 or 128; 16-bit inputs; no sequence split.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from ....runtime.launch import launch
from .backward_chunk import _chunk_backward, chunk_gradients, _copy_rows, _copy_state, _landed, _publish
from .common import CHUNK, LOG2E, exp2_ftz, last_gate, sequence_of_program


@gluon.jit
def _issue_chunk_loads(q, k, v, v_new, h, do, ai, q_s, k_s, v_s, vn_s, h_s, do_s, t_s, hv, head, tok0, n_valid,
                       state_index, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                       NW: gl.constexpr):
    """The chunk's tiles as two cp.async groups: what dv2 needs first (q, k, do, T), then the
    rest of the chunk math's (v_new, v, h[c])."""
    _copy_rows(q_s, q, tok0, n_valid, HQ, head, K, NW)
    _copy_rows(k_s, k, tok0, n_valid, HQ, head, K, NW)
    _copy_rows(do_s, do, tok0, n_valid, HV, hv, V, NW)
    _copy_rows(t_s, ai, tok0, n_valid, HV, hv, CHUNK, NW)
    async_copy.commit_group()
    _copy_rows(vn_s, v_new, tok0, n_valid, HV, hv, V, NW)
    _copy_rows(v_s, v, tok0, n_valid, HV, hv, V, NW)
    _copy_state(h_s, h, state_index, K, V, NW)
    async_copy.commit_group()


@gluon.jit
def _gate_rows(g_cum, tok0, n_valid, hv, HV: gl.constexpr, idx, HAS_G: gl.constexpr):
    """Gate cumsums in log2 units at positions idx (0 from n_valid on, or without g)."""
    if HAS_G:
        return gl.load(g_cum + (tok0 + idx) * HV + hv, mask=idx < n_valid, other=0.0) * LOG2E
    else:
        return gl.zeros_like(idx).to(gl.float32)


@gluon.jit
def _allocate_once(dt: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """backward_chunk._allocate's tiles, each with a leading dimension of one: the loop takes its
    views through an index the compiler cannot see is zero (_opaque_zero), so that it recomputes
    the tiles' swizzled addresses per chunk instead of hoisting all of them out of the loop,
    where they would not fit in registers beside the chunk math (spills)."""
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, V], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, V], dt)
    return (gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem),  # do
            gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem),  # v_new
            gl.allocate_shared_memory(dt, [1, K, V], state_smem),  # h
            gl.allocate_shared_memory(dt, [1, K, V], state_smem),  # D (bf16)
            gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem),  # dv2
            gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem),  # v
            gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem),  # q
            gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem),  # k
            gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem),  # T
            gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem),  # dw, then T^T dv2
            gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem),  # P^T, Pg, X
            gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem))  # dT


@gluon.jit
def _opaque_zero(x):
    """0, from an instruction the compiler does not look into (not pure: never hoisted)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _d_offsets(K: gl.constexpr, V: gl.constexpr, layout: gl.constexpr):
    """Offsets of D [K, V] in a [.., K, V] state, in D's register layout (formed at each use:
    kept, they would hold K x V / threads registers through the chunk loop)."""
    rows = gl.arange(0, K, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, V, layout=gl.SliceLayout(0, layout))
    return rows[:, None] * V + cols[None, :]


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_sequential_kernel(q, k, v, v_new, h, do, ai, g_cum, beta, dht, dq, dk, dv, dbeta, dg, dh0, scratch,
                              cu_seqlens, chunk_offsets, order, T, scale,
                              HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                              HAS_G: gl.constexpr, HAS_DHT: gl.constexpr, STORE_DH0: gl.constexpr,
                              IS_VARLEN: gl.constexpr):
    """One program per (sequence x value head) (grid axis 1); 8 warps, two warpgroups that split
    every product's columns (the chunk math's layout)."""
    NW: gl.constexpr = gl.num_warps()
    WG: gl.constexpr = NW // 4
    dt: gl.constexpr = q.dtype.element_ty
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN, order)
    head = hv // (HV // HQ)
    if IS_VARLEN:
        chunk0 = gl.load(chunk_offsets + seq_hv // HV).to(gl.int64)
    else:
        chunk0 = (seq_hv // HV).to(gl.int64) * gl.cdiv(T, CHUNK)

    # D [K, V] (rows over all warps); the [64, V] and [64, 64] chunk products (columns split
    # between the warpgroups); q^T, k^T [K, 64] as the update's A operands
    state_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, V, 16])
    value_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, V // WG, 16])
    pair_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, CHUNK // WG, 16])
    token_cols: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                         instr_shape=[16, CHUNK, 16])
    a_for_state: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=state_acc, k_width=2)
    tiles = _allocate_once(dt, K, V)

    own = scratch + seq_hv.to(gl.int64) * K * V  # this program's D, fp32
    if HAS_DHT:
        d_state = gl.load(dht + seq_hv.to(gl.int64) * K * V + _d_offsets(K, V, state_acc))
    else:
        d_state = gl.zeros([K, V], gl.float32, state_acc)
    gl.store(own + _d_offsets(K, V, state_acc), d_state)
    _publish(tiles[3].index(0), d_state.to(dt))

    p_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair_acc))  # j (keys)
    p_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, pair_acc))  # i (queries)
    v_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, value_acc))
    t_cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, token_cols))
    log2_scale = gl.log2(scale)
    for i in range(0, num_chunks):
        c = num_chunks - 1 - i
        z = _opaque_zero(c)
        do_s, vn_s, h_s, dh_s = tiles[0].index(z), tiles[1].index(z), tiles[2].index(z), tiles[3].index(z)
        du_s, v_s, q_s, k_s = tiles[4].index(z), tiles[5].index(z), tiles[6].index(z), tiles[7].index(z)
        t_s, dw_s, pair_s, dt_s = tiles[8].index(z), tiles[9].index(z), tiles[10].index(z), tiles[11].index(z)
        tok0 = bos + c.to(gl.int64) * CHUNK
        n_valid = gl.minimum(seq_len - c * CHUNK, CHUNK).to(gl.int32)
        _issue_chunk_loads(q, k, v, v_new, h, do, ai, q_s, k_s, v_s, vn_s, h_s, do_s, t_s, hv, head, tok0, n_valid,
                           (chunk0 + c) * HV + hv, HQ, HV, K, V, NW)
        b2_last = last_gate(g_cum, tok0, n_valid, hv, HV, HAS_G)
        _landed(1)  # q, k, do, T

        # dv2 = e^(B_last - B) (k D) + P^T do, into du_s for the chunk math and the update
        pt = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc),
                           use_acc=False, is_async=True)
        kd = warpgroup_mma(k_s, dh_s, gl.zeros([CHUNK, V], gl.float32, value_acc), use_acc=False, is_async=True)
        pt = warpgroup_mma_wait(num_outstanding=1, deps=(pt, ))
        b_j = _gate_rows(g_cum, tok0, n_valid, hv, HV, p_rows, HAS_G)
        b_i = _gate_rows(g_cum, tok0, n_valid, hv, HV, p_cols, HAS_G) + log2_scale
        _publish(pair_s, gl.where(p_rows[:, None] <= p_cols[None, :],
                                  pt * exp2_ftz(b_i[None, :] - b_j[:, None]), 0.0).to(dt))
        kd = warpgroup_mma_wait(num_outstanding=0, deps=(kd, k_s, q_s, dh_s))[0]
        b_v = _gate_rows(g_cum, tok0, n_valid, hv, HV, v_rows, HAS_G)
        decay = gl.where(v_rows < n_valid, exp2_ftz(b2_last - b_v), 0.0)
        du = warpgroup_mma(pair_s, do_s, kd * decay[:, None], is_async=True)
        du = warpgroup_mma_wait(num_outstanding=0, deps=(du, pair_s, do_s))[0]
        _publish(du_s, du.to(dt))
        _landed(0)  # v_new, v, h[c]

        _chunk_backward(dq, dk, dv, dbeta, dg, g_cum, beta, hv, tok0, n_valid, scale,
                        do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s, HV, K, V, HAS_G)

        # D <- e^(B_last) D + (scale e^B q)^T do - (beta e^B k)^T (T^T dv2)
        y = warpgroup_mma(t_s.permute((1, 0)), du_s, gl.zeros([CHUNK, V], gl.float32, value_acc), use_acc=False,
                          is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, t_s, du_s))[0]
        gl.thread_barrier()  # both warpgroups are past the chunk math's last product reading dw_s
        _publish(dw_s, y.to(dt))  # (K == V: dw's tile holds T^T dv2)
        b_t = _gate_rows(g_cum, tok0, n_valid, hv, HV, t_cols, HAS_G)
        e_t = exp2_ftz(b_t)
        beta_t = gl.load(beta + (tok0 + t_cols) * HV + hv, mask=t_cols < n_valid, other=0.0).to(gl.float32)
        q_t = q_s.permute((1, 0)).load(token_cols).to(gl.float32)  # q^T [K, 64]
        k_t = k_s.permute((1, 0)).load(token_cols).to(gl.float32)
        a_q = gl.convert_layout((q_t * (e_t * scale)[None, :]).to(dt), a_for_state)
        a_k = gl.convert_layout((k_t * (-(beta_t * e_t))[None, :]).to(dt), a_for_state)
        d_state = gl.load(own + _d_offsets(K, V, state_acc)) * gl.exp2(b2_last)
        d_state = warpgroup_mma(a_q, do_s, d_state, is_async=True)
        d_state = warpgroup_mma(a_k, dw_s, d_state, is_async=True)
        d_state = warpgroup_mma_wait(num_outstanding=0, deps=(d_state, do_s, dw_s))[0]
        gl.store(own + _d_offsets(K, V, state_acc), d_state)
        gl.thread_barrier()  # every warp is past its reads of dh_s (the chunk math's state sums)
        _publish(dh_s, d_state.to(dt))
    if STORE_DH0:
        # (the thread that stored each element reads it back: no barrier needed)
        d_offs = _d_offsets(K, V, state_acc)
        gl.store(dh0 + seq_hv.to(gl.int64) * K * V + d_offs, gl.load(own + d_offs))


def bwd_sequential(layout, q, k, v, v_new, h, do, ai, g_cum, beta, dht, want_dh0: bool, scale: float, order=None):
    """-> (dq, dk, dv, dbeta fp32, dg fp32 or None, dh0 fp32 or None): dq and dk per value head,
    in q's dtype where the q/k heads are the value heads, else fp32 (for the caller's sum over
    each group). h, v_new: the backward's state pass; dht: the final state's gradient or None."""
    B, T, HQ, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dq, dk, dv, dbeta, dg = chunk_gradients(q, v, g_cum is not None)
    programs = layout.num_seqs * HV
    scratch = torch.empty(programs, K, V, device=q.device, dtype=torch.float32)
    dh0 = torch.empty(layout.num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    cu, offsets = (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)
    launch(gdn_bwd_sequential_kernel, (1, programs),
           q, k, v, v_new, h, do, ai, g_cum, beta, dht, dq, dk, dv, dbeta, dg, dh0, scratch, cu, offsets, order,
           T, scale, HQ=HQ, HV=HV, K=K, V=V, HAS_G=g_cum is not None, HAS_DHT=dht is not None,
           STORE_DH0=want_dh0, IS_VARLEN=layout.is_varlen, num_warps=8)
    return dq, dk, dv, dbeta, dg, dh0
