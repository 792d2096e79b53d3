"""The backward's chunk-parallel part in one kernel: the Triton path's bwd_dqkw and bwd_wy passes
fused (dw, the partial dk and the gate row sums never reach memory). One program per (chunk,
value head), two warpgroups splitting every product's columns; scalar gate or none; K and V 64 or 128; 16-bit inputs.

With h = h[c], D = dh[c] (the state gradient at the chunk's end), vn = v_new, du = dv2, T the WY
inverse, B the gate cumsum, Gamma_ij = e^(B_i - B_j) on j <= i:
    dP = do vn^T,  Pg = scale dP . Gamma
    dq = scale e^B (do h^T) + Pg k
    dk = e^(B_last - B) (vn D^T) + Pg^T q  + the WY terms below
    dw = -du h^T
    dT = du (v beta)^T + dw (k e^B beta)^T,  dA = -T^T dT T^T (strictly lower), dAg = dA . Gamma
    dv = beta (T^T du),  dk += e^B beta (T^T dw) + (X + X^T) k with X = diag(beta) dAg
    dbeta = rows of (T^T du) . v + (T^T dw) . k e^B + dAg . K K^T
    dg = reverse cumsum of q.dq - k.dk (before the WY terms) + k e^B beta . (T^T dw)
         + rows - columns of (dAg . K K^T . beta) + the chunk-end terms at the last row.
Every product is a warpgroup MMA; each wait names the shared-memory operands of the products it
waits for, which keeps them allocated until then (in straight-line code the compiler otherwise
ends a buffer's life at its last product's issue and may hand its memory to a layout
conversion's scratch while the product still reads it). The loads are cp.async groups in the
order of use: the state tiles' products start while q, k and T arrive. Row sums are few and
late (each crosses the two warpgroups through shared memory). backward_ws.py splits the same math
by product between warp roles, beside bwd_dhu's chain.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ....runtime.launch import launch
from .common import CHUNK, LOG2E, exp2_ftz

@gluon.jit
def _chunk_of_item(slot, bhv, chunk_map, cu_seqlens, T, HV: gl.constexpr, IS_VARLEN: gl.constexpr):
    """(value head, first token (int64), valid rows, global chunk index (int64)) of the work item
    (chunk slot, batch x value head). An unused varlen slot gets 0 valid rows. The Gluon twin of
    triton/common.py's chunk_of_slot (a triton.jit function cannot be called from a Gluon
    kernel)."""
    if IS_VARLEN:
        seq = gl.load(chunk_map + 2 * slot)
        local = gl.load(chunk_map + 2 * slot + 1)
        used = seq >= 0
        seq = gl.where(used, seq, 0)
        bos = gl.load(cu_seqlens + seq).to(gl.int64)
        eos = gl.load(cu_seqlens + seq + 1).to(gl.int64)
        tok0 = bos + local.to(gl.int64) * CHUNK
        n_valid = gl.where(used, gl.minimum(eos - tok0, CHUNK), 0).to(gl.int32)
        chunk = slot.to(gl.int64)
    else:
        tok0 = (bhv // HV).to(gl.int64) * T + slot.to(gl.int64) * CHUNK
        n_valid = gl.minimum(T - slot * CHUNK, CHUNK).to(gl.int32)
        chunk = (bhv // HV).to(gl.int64) * gl.cdiv(T, CHUNK) + slot
    return bhv % HV, tok0, n_valid, chunk


@gluon.jit
def _copy_rows(smem, base, tok0, n_valid, heads: gl.constexpr, head, D: gl.constexpr, NW: gl.constexpr, zero=0):
    """cp.async of a [64, D] tile (rows tok0.. of a [tokens, heads, D] tensor) into smem by NW
    warps; rows from n_valid on are zero-filled. zero: see _store_rows."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [NW, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout)) + zero
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = ((tok0 + rows)[:, None] * heads + head) * D + cols[None, :]
    async_copy.async_copy_global_to_shared(smem, base + offs, (rows < n_valid)[:, None] & (cols < D)[None, :])


@gluon.jit
def _copy_state(smem, base, index, K: gl.constexpr, V: gl.constexpr, NW: gl.constexpr, zero=0):
    """cp.async of the [K, V] state at `index` (int64) of a [.., K, V] tensor into smem by NW warps.
    zero: see _store_rows."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (V // 8), V // 8], [NW, 1], [1, 0])
    rows = gl.arange(0, K, layout=gl.SliceLayout(1, layout)) + zero
    cols = gl.arange(0, V, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(smem, base + index * K * V + rows[:, None] * V + cols[None, :])


@gluon.jit
def _store_rows(base, tile, tok0, n_valid, heads: gl.constexpr, head, D: gl.constexpr, zero=0):
    """Store a [64, D] tile to rows tok0.. of a [tokens, heads, D] tensor (rows from n_valid on
    not written), converted to the tensor's dtype; each thread a run of 8 columns (coalesced).
    zero: 0, or in a loop over chunks an opaque 0, so that the lane offsets are formed per chunk
    instead of being hoisted out of the loop into registers it cannot spare."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout)) + zero
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    value = gl.convert_layout(tile.to(base.dtype.element_ty), layout)
    gl.store(base + ((tok0 + rows)[:, None] * heads + head) * D + cols[None, :], value,
             mask=(rows < n_valid)[:, None] & (cols < D)[None, :])


@gluon.jit
def _landed(pending: gl.constexpr):
    """Wait until only `pending` cp.async groups are in flight, for every thread, and make the
    tiles visible to warpgroup MMA."""
    async_copy.wait_group(pending)
    gl.thread_barrier()
    fence_async_shared()


@gluon.jit
def _publish(smem, value):
    """Store an operand that a following warpgroup MMA reads from shared memory."""
    smem.store(value)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _sum(x, axis: gl.constexpr):
    """gl.sum with a combine function of this module (gl.sum's own is a triton.jit function,
    which Triton's interpreter wraps, so a kernel using it would not compile in CPU test runs)."""
    return gl.reduce(x, axis, _add)


@gluon.jit
def _state_dot(h_s, dh_s, K: gl.constexpr, V: gl.constexpr, ROWS: gl.constexpr = 16, FENCED: gl.constexpr = False):
    """sum(h . dh) of two [K, V] states in shared memory, ROWS rows at a time (few registers).
    FENCED: a thread barrier after each slice, so that the compiler cannot hoist every slice's
    loads to the start (for a caller whose registers are nearly all taken)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (V // 8), V // 8], [gl.num_warps(), 1], [1, 0])
    total = gl.zeros([ROWS, V], gl.float32, layout)
    for r in gl.static_range(0, K, ROWS):
        total += h_s.slice(r, ROWS).load(layout).to(gl.float32) * dh_s.slice(r, ROWS).load(layout).to(gl.float32)
        if FENCED:
            gl.thread_barrier()
    # one reduction at the end: each one crosses warps through shared memory
    return _sum(_sum(total, axis=1), axis=0)


@gluon.jit
def _gamma(b2, ri, cj, n_valid, INCLUSIVE: gl.constexpr):
    """e^(B_i - B_j) on j <= i (j < i unless INCLUSIVE) of valid rows i, else 0; exponents only
    where kept (a masked row's B would give e^(large) elsewhere)."""
    if INCLUSIVE:
        keep = (cj[None, :] <= ri[:, None]) & (ri < n_valid)[:, None]
    else:
        keep = (cj[None, :] < ri[:, None]) & (ri < n_valid)[:, None]
    b2_col = gl.convert_layout(b2, gl.SliceLayout(0, b2.type.layout.parent))
    return exp2_ftz(gl.where(keep, b2[:, None] - b2_col[None, :], float("-inf")))


@gluon.jit
def d_a_gated(t_s, d_tmat, k_s, b2, ri, cj, n_valid, pair_acc: gl.constexpr):
    """-> (dAg, K K^T): dA = -T^T dT T^T on the strict lower triangle, dAg = dA . Gamma, with dT
    the [64, 64] shared-memory operand d_tmat (a view: backward_ws.py keeps dT transposed)."""
    tdt = warpgroup_mma(t_s.permute((1, 0)), d_tmat, gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                        is_async=True)
    kkt = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                        is_async=True)
    tdt = warpgroup_mma_wait(num_outstanding=1, deps=(tdt, t_s, d_tmat))[0]
    a_for_pair: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=pair_acc, k_width=2)
    d_a = warpgroup_mma(gl.convert_layout(tdt.to(t_s.dtype), a_for_pair), t_s.permute((1, 0)),
                        gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False, is_async=True)
    d_a, kkt, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(d_a, kkt, t_s, k_s))
    return -d_a * _gamma(b2, ri, cj, n_valid, False), kkt


@gluon.jit
def _tiles_ready(group: gl.constexpr):
    """Wait for the chunk's load group (0: do, v_new, h; 1: dv2, v; 2: dh; 3: q, k, T; cp.async
    groups issued in that order)."""
    _landed(3 - group)


@gluon.jit
def _issue_loads(q, k, v, v_new, h, dh, do, dv2, ai, do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s,
                 hv, head, tok0, n_valid, chunk, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                 V: gl.constexpr, NW: gl.constexpr):
    """The chunk's tiles as four cp.async commit groups in the order the math uses them."""
    state_index = chunk * HV + hv
    _copy_rows(do_s, do, tok0, n_valid, HV, hv, V, NW)
    _copy_rows(vn_s, v_new, tok0, n_valid, HV, hv, V, NW)
    _copy_state(h_s, h, state_index, K, V, NW)
    async_copy.commit_group()
    _copy_rows(du_s, dv2, tok0, n_valid, HV, hv, V, NW)
    _copy_rows(v_s, v, tok0, n_valid, HV, hv, V, NW)
    async_copy.commit_group()
    _copy_state(dh_s, dh, state_index, K, V, NW)
    async_copy.commit_group()
    _copy_rows(q_s, q, tok0, n_valid, HQ, head, K, NW)
    _copy_rows(k_s, k, tok0, n_valid, HQ, head, K, NW)
    _copy_rows(t_s, ai, tok0, n_valid, HV, hv, CHUNK, NW)
    async_copy.commit_group()


@gluon.jit
def _chunk_backward(dq, dk, dv, dbeta, dg, g_cum, beta, hv, tok0, n_valid, scale,
                    do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s,
                    HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, HAS_G: gl.constexpr):
    """One chunk's gradients from its tiles in shared memory (the module docstring's math), as
    _issue_loads' groups land."""
    dt: gl.constexpr = q_s.dtype
    # WG warpgroups split every product's columns
    WG: gl.constexpr = gl.num_warps() // 4
    key_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, K // WG, 16])
    value_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                        instr_shape=[16, V // WG, 16])
    pair_acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                       instr_shape=[16, CHUNK // WG, 16])
    a_for_key: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=key_acc, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, pair_acc)
    cols_of: gl.constexpr = gl.SliceLayout(0, pair_acc)
    key_rows: gl.constexpr = gl.SliceLayout(1, key_acc)
    value_rows: gl.constexpr = gl.SliceLayout(1, value_acc)

    # the chunk's rows: gate cumsums (log2 units) and beta
    ri = gl.arange(0, CHUNK, layout=rows_of)
    cj = gl.arange(0, CHUNK, layout=cols_of)
    row_ok = ri < n_valid
    b_beta = gl.load(beta + (tok0 + ri) * HV + hv, mask=row_ok, other=0.0).to(gl.float32)
    if HAS_G:
        b2 = gl.load(g_cum + (tok0 + ri) * HV + hv, mask=row_ok, other=0.0) * LOG2E
        b2_last = gl.load(g_cum + (tok0 + gl.maximum(n_valid - 1, 0)) * HV + hv, mask=n_valid > 0,
                          other=0.0) * LOG2E
    else:
        b2 = gl.zeros([CHUNK], gl.float32, rows_of)
        b2_last = 0.0
    eb = exp2_ftz(b2)  # e^B per row
    eb_k = gl.convert_layout(eb, key_rows)

    # the products of the state tiles first (do h^T, du h^T, vn dh^T, dP = do vn^T), so that
    # few accumulators live at once (registers)
    _tiles_ready(0)
    dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                       is_async=True)
    dqh = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                        is_async=True)
    _tiles_ready(1)
    dwa = warpgroup_mma(du_s, h_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                        is_async=True)
    dp = warpgroup_mma_wait(num_outstanding=2, deps=(dp, do_s, vn_s))[0]
    # Pg = scale dP . Gamma, for dq (Pg k) and dk (Pg^T q)
    pg = dp * _gamma(b2, ri, cj, n_valid, True) * scale
    _publish(pair_s, pg.to(dt))
    dqh, dwa, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dqh, dwa, do_s, h_s, du_s))
    # dw in the input dtype, as the Triton path keeps it between its passes
    _publish(dw_s, (-dwa).to(dt))
    _tiles_ready(2)
    dkl = warpgroup_mma(vn_s, dh_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                        is_async=True)
    last_extra = gl.exp2(b2_last) * _state_dot(h_s, dh_s, K, V)
    dkl = warpgroup_mma_wait(num_outstanding=0, deps=(dkl, vn_s, dh_s))[0]

    # dq = scale e^B (do h^T) + Pg k, finished before the next products (registers)
    _tiles_ready(3)
    dq_t = warpgroup_mma(gl.convert_layout(pg.to(dt), a_for_key), k_s, dqh * (eb_k * scale)[:, None],
                         is_async=True)
    dq_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq_t, k_s))[0]
    gate = gl.convert_layout(_sum(q_s.load(key_acc).to(gl.float32) * dq_t, axis=1), rows_of)
    _store_rows(dq, dq_t, tok0, n_valid, HV, hv, K)
    # dk's state and intra parts; the chunk-end terms of dB_last
    dk_t = dkl * gl.convert_layout(exp2_ftz(b2_last - b2), key_rows)[:, None]
    last_extra += _sum(_sum(k_s.load(key_acc).to(gl.float32) * dk_t, axis=1), axis=0)
    dk_t = warpgroup_mma(pair_s.permute((1, 0)), q_s, dk_t, is_async=True)
    # dv = beta (T^T du), and du's other product, du v^T (dT below), so that du_s is read out here
    dvb = warpgroup_mma(t_s.permute((1, 0)), du_s, gl.zeros([CHUNK, V], gl.float32, value_acc), use_acc=False,
                        is_async=True)
    duv = warpgroup_mma(du_s, v_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                        is_async=True)
    dk_t, dvb, duv, _, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0,
                                                       deps=(dk_t, dvb, duv, pair_s, q_s, t_s, du_s, v_s))
    dbeta_t = gl.convert_layout(_sum(dvb * v_s.load(value_acc).to(gl.float32), axis=1), rows_of)
    beta_v = gl.convert_layout(b_beta, value_rows)
    _store_rows(dv, dvb * beta_v[:, None], tok0, n_valid, HV, hv, V)

    # dT = du (v beta)^T + dw (k e^B beta)^T
    dwk = warpgroup_mma(dw_s, k_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                        is_async=True)
    dwk = warpgroup_mma_wait(num_outstanding=0, deps=(dwk, dw_s, k_s))[0]
    gate -= gl.convert_layout(_sum(k_s.load(key_acc).to(gl.float32) * dk_t, axis=1), rows_of)
    gate += gl.where(ri == n_valid - 1, last_extra, 0.0)
    d_tmat = duv * gl.convert_layout(b_beta, cols_of)[None, :] + dwk * gl.convert_layout(eb * b_beta, cols_of)[None, :]
    _publish(dt_s, d_tmat.to(dt))

    d_ag, kkt = d_a_gated(t_s, dt_s, k_s, b2, ri, cj, n_valid, pair_acc)
    m = d_ag * kkt
    m_rows = _sum(m, axis=1)
    dbeta_t += m_rows
    # rows and columns of m . beta (beta scales rows)
    gate += m_rows * b_beta - gl.convert_layout(_sum(m * b_beta[:, None], axis=0), rows_of)
    x_dab = (d_ag * b_beta[:, None]).to(dt)
    _publish(pair_s, x_dab)  # Pg's last reader (dk) was waited for above

    # dk's WY terms: e^B beta (T^T dw) + X k + X^T k, X = diag(beta) dAg
    dkb = warpgroup_mma(t_s.permute((1, 0)), dw_s, gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                        is_async=True)
    dk_t = warpgroup_mma(gl.convert_layout(x_dab, a_for_key), k_s, dk_t, is_async=True)
    dk_t = warpgroup_mma(pair_s.permute((1, 0)), k_s, dk_t, is_async=True)
    dkb = warpgroup_mma_wait(num_outstanding=2, deps=(dkb, t_s, dw_s))[0]
    kb_row = _sum(dkb * (k_s.load(key_acc).to(gl.float32) * eb_k[:, None]), axis=1)
    kb_row = gl.convert_layout(kb_row, rows_of)
    dbeta_t += kb_row
    gate += kb_row * b_beta
    dk_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk_t, pair_s, k_s))[0]
    dk_t += dkb * (eb_k * gl.convert_layout(b_beta, key_rows))[:, None]
    _store_rows(dk, dk_t, tok0, n_valid, HV, hv, K)
    gl.store(dbeta + (tok0 + ri) * HV + hv, dbeta_t, mask=row_ok)
    if HAS_G:
        # the reverse cumsum as a masked row sum (a scan over this layout does not lower)
        gate_col = gl.convert_layout(gate, cols_of)
        d_gate = _sum(gl.where(cj[None, :] >= ri[:, None], gate_col[None, :], 0.0), axis=1)
        gl.store(dg + (tok0 + ri) * HV + hv, d_gate, mask=row_ok)


@gluon.jit
def _allocate(dt: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """The item's tiles and the on-chip operands formed from them."""
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, V], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, V], dt)
    return (gl.allocate_shared_memory(dt, [CHUNK, V], value_smem),  # do
            gl.allocate_shared_memory(dt, [CHUNK, V], value_smem),  # v_new
            gl.allocate_shared_memory(dt, [K, V], state_smem),  # h
            gl.allocate_shared_memory(dt, [K, V], state_smem),  # dh
            gl.allocate_shared_memory(dt, [CHUNK, V], value_smem),  # du = dv2
            gl.allocate_shared_memory(dt, [CHUNK, V], value_smem),  # v
            gl.allocate_shared_memory(dt, [CHUNK, K], key_smem),  # q
            gl.allocate_shared_memory(dt, [CHUNK, K], key_smem),  # k
            gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem),  # T
            gl.allocate_shared_memory(dt, [CHUNK, K], key_smem),  # dw
            gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem),  # Pg, then X
            gl.allocate_shared_memory(dt, [CHUNK, CHUNK], square_smem))  # dT


@gluon.jit(do_not_specialize=["T"])
def gdn_bwd_chunk_kernel(q, k, v, v_new, h, dh, do, dv2, ai, g_cum, beta,
                         dq, dk, dv, dbeta, dg, chunk_map, cu_seqlens, T, scale,
                         HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                         HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    """One program per (chunk slot, batch x value head)."""
    hv, tok0, n_valid, chunk = _chunk_of_item(gl.program_id(0), gl.program_id(1), chunk_map, cu_seqlens, T, HV,
                                              IS_VARLEN)
    do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s = _allocate(q.dtype.element_ty, K, V)
    _issue_loads(q, k, v, v_new, h, dh, do, dv2, ai, do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s,
                 hv, hv // (HV // HQ), tok0, n_valid, chunk, HQ, HV, K, V, gl.num_warps())
    _chunk_backward(dq, dk, dv, dbeta, dg, g_cum, beta, hv, tok0, n_valid, scale,
                    do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pair_s, dt_s, HV, K, V, HAS_G)


def gradient_buffers(q, v, has_g: bool):
    """-> (dq, dk, dv, dbeta, dg or None) for the chunk math's stores: dq and dk per value head, in
    q's dtype where the q/k heads are the value heads, else fp32 (for the caller's sum over each
    group); dbeta and dg fp32."""
    B, T, HQ, K = q.shape
    HV = v.shape[2]
    grad_dtype = q.dtype if HQ == HV else torch.float32
    dq = torch.empty(B, T, HV, K, device=q.device, dtype=grad_dtype)
    dk = torch.empty(B, T, HV, K, device=q.device, dtype=grad_dtype)
    dbeta = torch.empty(B, T, HV, device=q.device, dtype=torch.float32)
    dg = torch.empty(B, T, HV, device=q.device, dtype=torch.float32) if has_g else None
    return dq, dk, torch.empty_like(v), dbeta, dg


def bwd_chunk(layout, q, k, v, v_new, h, dh, do, dv2, ai, g_cum, beta, scale: float):
    """-> (dq, dk, dv, dbeta fp32, dg fp32 or None): dq and dk per value head, in q's dtype where
    the q/k heads are the value heads, else fp32 (for the caller's sum over each group)."""
    B, T, HQ, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dq, dk, dv, dbeta, dg = gradient_buffers(q, v, g_cum is not None)
    chunk_map, cu = (layout.chunk_map, layout.cu_seqlens) if layout.is_varlen else (None, None)
    launch(gdn_bwd_chunk_kernel, (layout.num_slots, B * HV),
           q, k, v, v_new, h, dh, do, dv2, ai, g_cum, beta, dq, dk, dv, dbeta, dg, chunk_map, cu, T, scale,
           HQ=HQ, HV=HV, K=K, V=V, HAS_G=g_cum is not None, IS_VARLEN=layout.is_varlen, num_warps=8)
    return dq, dk, dv, dbeta, dg
