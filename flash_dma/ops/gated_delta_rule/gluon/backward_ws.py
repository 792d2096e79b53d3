"""The backward after the state pass in one kernel with warp roles: bwd_dhu, its intra-chunk dv and
the chunk-parallel gradients (backward_chunk.py's math) fused. One program per (sequence, value
head) walks the chunks last to first; dh, dv2, dv_local and w never reach memory. Scalar gate or
none; K and V 64 or 128; 16-bit inputs; sequences whole or cut into segments (each run from its
end's state gradient).

The chunk math is split by product between two warpgroups, so that each holds at most about two
accumulators (a split by columns would leave every product's accumulators live in both):
    value role (4 warps)  M = scale (q k^T) . Gamma and Pg = scale (do v_new^T) . Gamma; once
                          D's copy is in, du = dv2 = e^(B_last - B) (k D) + M^T do, dw = -du h^T,
                          dv = beta (T^T du); leaves scale e^B do and -beta e^B (T^T du) for the
                          update; then dq beside the update, and dbeta and dg from every role's
                          row sums; issues the next chunk's h, v_new, v
    pair role (4 warps)   dk's state and intra parts (v_new D^T, Pg^T q), dT (transposed, so that
                          its scales and row sums stay within warps), dA, dk's WY terms
                          (X k + X^T k + diag(e^B beta) T^T dw, T^T from registers) and its row
                          sums of the gate and beta gradients
    state role (4 warps)  D = dh[c] in fp32 registers: publishes its bf16 copy and sum(h . D),
                          then D <- e^(B_last) D + q^T (scale e^B do) + k^T (-beta e^B T^T dv2);
                          issues the next chunk's q, k, T, do
The pair role's chain (dT, dA, its WY terms) is the longest, so the rest (dq, dbeta and dg, the
state dot) sits with the other two. Tiles are single-buffered (twelve fill shared memory); each
group is refilled once its last reader has passed. Row vectors cross through shared memory, a
buffer per chunk parity.

mbarriers (one phase per chunk; arrivals per phase):
    LOAD_KEYS, LOAD_STATE  q, k, T, do / h, v_new, v landed (cp.async arrivals of the issuing
                           role's 128 threads)
    D_READY     D's copy in dh_s (state, 1)             D_FREE      dh_s read (value, pair: 2)
    PG_READY    Pg in pg_s (value, 1)                   DU_READY    du in du_s, M read (value, 1)
    DW_READY    dw in dw_s (value, 1)                   DU_FREE     du, v, v_new read (pair, 1)
    UPDATE_READY  the update's operands (value, 1)      KEYS_FREE   q, k, T, do read (value, pair: 2)
    PAIR_ROWS   the pair role's row sums (pair, 1)      DOT_DONE    sum(h . D) written, h read (state, 1)
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ....runtime.launch import launch
from .backward_chunk import (
    _copy_rows, _copy_state, _gamma, _publish, _state_dot, _store_rows, _sum, d_a_gated, gradient_buffers
)
from .common import (
    CHUNK, first_chunk_state, gate_rows, last_gate, one_warpgroup_accumulator, register_a_operand, reverse_chunk,
    sequence_of_program
)

LOAD_KEYS = gl.constexpr(0)
LOAD_STATE = gl.constexpr(1)
D_READY = gl.constexpr(2)
D_FREE = gl.constexpr(3)
PG_READY = gl.constexpr(4)
DU_READY = gl.constexpr(5)
DW_READY = gl.constexpr(6)
DU_FREE = gl.constexpr(7)
UPDATE_READY = gl.constexpr(8)
KEYS_FREE = gl.constexpr(9)
PAIR_ROWS = gl.constexpr(10)
DOT_DONE = gl.constexpr(11)
NUM_BARS = gl.constexpr(12)
ARRIVALS = (128, 128, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1)
# the row vectors that cross between the roles, per chunk parity p at 3 p + these
GATE_ROWS = gl.constexpr(0)  # the pair role's part of the gate gradient's rows
DBETA_ROWS = gl.constexpr(1)  # the pair role's part of dbeta
STATE_DOT = gl.constexpr(2)  # sum(h . D) of the chunk (the state role's), in every row

# registers a thread: the value role (the default partition) gets what these leave of the 504
# (setmaxnreg's pool for 12 warps): 160
PAIR_REGS = gl.constexpr(176)
STATE_REGS = gl.constexpr(168)


@gluon.jit
def _step(it, num_chunks, bos, seq_len):
    """common.reverse_chunk with the valid rows as int32."""
    c, tok0, n_valid = reverse_chunk(it, num_chunks, bos, seq_len)
    return c, tok0, n_valid.to(gl.int32)


@gluon.jit
def _issue_keys(q, k, ai, do, q_s, k_s, t_s, do_s, tok0, n_valid, head, hv, bars, zero, HQ: gl.constexpr,
                HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """cp.async of a chunk's q, k, T and do, arriving on LOAD_KEYS as they land."""
    _copy_rows(q_s, q, tok0, n_valid, HQ, head, K, gl.num_warps(), zero)
    _copy_rows(k_s, k, tok0, n_valid, HQ, head, K, gl.num_warps(), zero)
    _copy_rows(t_s, ai, tok0, n_valid, HV, hv, CHUNK, gl.num_warps(), zero)
    _copy_rows(do_s, do, tok0, n_valid, HV, hv, V, gl.num_warps(), zero)
    async_copy.mbarrier_arrive(bars.index(LOAD_KEYS), increment_count=False)


@gluon.jit
def _issue_state(v, v_new, h, vn_s, h_s, v_s, tok0, n_valid, state_index, hv, bars, zero, HV: gl.constexpr,
                 K: gl.constexpr, V: gl.constexpr):
    """cp.async of a chunk's h (at state_index), v_new and v, arriving on LOAD_STATE."""
    _copy_state(h_s, h, state_index, K, V, gl.num_warps(), zero)
    _copy_rows(vn_s, v_new, tok0, n_valid, HV, hv, V, gl.num_warps(), zero)
    _copy_rows(v_s, v, tok0, n_valid, HV, hv, V, gl.num_warps(), zero)
    async_copy.mbarrier_arrive(bars.index(LOAD_STATE), increment_count=False)


@gluon.jit
def _opaque_zero(x):
    """0, from an instruction the compiler does not look into (not pure: never hoisted)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _views(z, do_b, vn_b, h_b, dh_b, du_b, v_b, q_b, k_b, t_b, dw_b, pg_b, m_b):
    """The tiles of one chunk, through an index the compiler cannot see is zero, so that each
    role forms their swizzled addresses per chunk instead of hoisting them all out of its loop
    (spills)."""
    return (do_b.index(z), vn_b.index(z), h_b.index(z), dh_b.index(z), du_b.index(z), v_b.index(z), q_b.index(z),
            k_b.index(z), t_b.index(z), dw_b.index(z), pg_b.index(z), m_b.index(z))


@gluon.jit
def _chunk_rows(g_cum, beta, tok0, n_valid, hv, z, bars, phase, pair_acc: gl.constexpr, HV: gl.constexpr,
                HAS_G: gl.constexpr):
    """A chunk's start in the value and pair roles: -> (row and column indices through the opaque
    zero z, the gate cumsums B (log2 units), beta, B at the last row, e^B), once its tiles have
    landed."""
    ri = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, pair_acc)) + z
    cj = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, pair_acc)) + z
    b2, b_beta = gate_rows(g_cum, beta, tok0, n_valid, hv, HV, ri, HAS_G)
    b2_last = last_gate(g_cum, tok0, n_valid, hv, HV, HAS_G)
    eb = gl.exp2(b2)
    mbarrier.wait(bars.index(LOAD_KEYS), phase)
    mbarrier.wait(bars.index(LOAD_STATE), phase)
    return ri, cj, b2, b_beta, b2_last, eb


@gluon.jit
def _signal(bars, index: gl.constexpr):
    """Arrive once for the role, after every warp of it got here."""
    gl.thread_barrier()
    mbarrier.arrive(bars.index(index))


@gluon.jit
def _value_role(q, k, v, v_new, h, do, ai, dq, dv, dbeta, dg, g_cum, beta, cu_seqlens, chunk_offsets, T, scale,
                do_b, vn_b, h_b, dh_b, du_b, v_b, q_b, k_b, t_b, dw_b, pg_b, m_b, row_sums, bars,
                HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, HAS_G: gl.constexpr,
                IS_VARLEN: gl.constexpr):
    """The value side of each chunk (module docstring), and the loads of the first chunk and of
    every next chunk's h, v_new and v."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    head = hv // (HV // HQ)
    chunk0 = first_chunk_state(chunk_offsets, seq_hv, T, HV, IS_VARLEN)
    dt: gl.constexpr = q_b.dtype
    key_acc: gl.constexpr = one_warpgroup_accumulator(K)
    value_acc: gl.constexpr = one_warpgroup_accumulator(V)
    pair_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    rows_of: gl.constexpr = gl.SliceLayout(1, pair_acc)
    cols_of: gl.constexpr = gl.SliceLayout(0, pair_acc)
    value_rows: gl.constexpr = gl.SliceLayout(1, value_acc)
    if num_chunks > 0:
        c, tok0, n_valid = _step(0, num_chunks, bos, seq_len)
        _issue_keys(q, k, ai, do, q_b.index(0), k_b.index(0), t_b.index(0), do_b.index(0), tok0, n_valid, head, hv,
                    bars, 0, HQ, HV, K, V)
        _issue_state(v, v_new, h, vn_b.index(0), h_b.index(0), v_b.index(0), tok0, n_valid, (chunk0 + c) * HV + hv,
                     hv, bars, 0, HV, K, V)
    for it in range(0, num_chunks):
        phase = it & 1
        c, tok0, n_valid = _step(it, num_chunks, bos, seq_len)
        z = _opaque_zero(it)
        do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pg_s, m_s = _views(z, do_b, vn_b, h_b, dh_b, du_b, v_b,
                                                                                  q_b, k_b, t_b, dw_b, pg_b, m_b)
        ri, cj, b2, b_beta, b2_last, eb = _chunk_rows(g_cum, beta, tok0, n_valid, hv, z, bars, phase, pair_acc, HV,
                                                      HAS_G)
        s = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc), use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_s, vn_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc),
                           use_acc=False, is_async=True)
        gamma = _gamma(b2, ri, cj, n_valid, True) * scale
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_s, k_s))[0]
        _publish(m_s, (s * gamma).to(dt))
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_s, vn_s))[0]
        _publish(pg_s, (dp * gamma).to(dt))
        mbarrier.arrive(bars.index(PG_READY))

        # du = dv2 = e^(B_last - B) (k D) + M^T do: the chain to the state role
        mbarrier.wait(bars.index(D_READY), phase)
        kd = warpgroup_mma(k_s, dh_s, gl.zeros([CHUNK, V], gl.float32, value_acc), use_acc=False, is_async=True)
        kd = warpgroup_mma_wait(num_outstanding=0, deps=(kd, k_s, dh_s))[0]
        _signal(bars, D_FREE)
        decay = gl.convert_layout(gl.where(ri < n_valid, gl.exp2(b2_last - b2), 0.0), value_rows)
        du_t = warpgroup_mma(m_s.permute((1, 0)), do_s, kd * decay[:, None], is_async=True)
        du_t = warpgroup_mma_wait(num_outstanding=0, deps=(du_t, m_s, do_s))[0]
        _publish(du_s, du_t.to(dt))
        mbarrier.arrive(bars.index(DU_READY))

        # dw = -du h^T for the pair role, then scale e^B do in place for the state role
        dwa = warpgroup_mma(du_s, h_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                            is_async=True)
        dwa = warpgroup_mma_wait(num_outstanding=0, deps=(dwa, du_s, h_s))[0]
        _publish(dw_s, (-dwa).to(dt))
        mbarrier.arrive(bars.index(DW_READY))
        do_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (V // 8), V // 8], [gl.num_warps(), 1], [1, 0])
        do_t = do_s.load(do_layout).to(gl.float32)
        do_t = do_t * gl.convert_layout(eb * scale, gl.SliceLayout(1, do_layout))[:, None]
        _publish(do_s, do_t.to(dt))

        # dv = beta (T^T du); -beta e^B (T^T du) for the update, once the pair role has read du
        dvb = warpgroup_mma(t_s.permute((1, 0)), du_s, gl.zeros([CHUNK, V], gl.float32, value_acc), use_acc=False,
                            is_async=True)
        dvb = warpgroup_mma_wait(num_outstanding=0, deps=(dvb, t_s, du_s))[0]
        beta_v = gl.convert_layout(b_beta, value_rows)
        mbarrier.wait(bars.index(DU_FREE), phase)
        _publish(du_s, (dvb * (-beta_v * gl.convert_layout(eb, value_rows))[:, None]).to(dt))
        mbarrier.arrive(bars.index(UPDATE_READY))
        dbeta_v = _sum(dvb * v_s.load(value_acc).to(gl.float32), axis=1)
        _store_rows(dv, dvb * beta_v[:, None], tok0, n_valid, HV, hv, V, z)

        # dq = scale e^B (do h^T) + Pg k = (scale e^B do) h^T + Pg k, beside the update (off the
        # chain from one chunk's D to the next)
        dq_t = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                             is_async=True)
        dq_t = warpgroup_mma(pg_s, k_s, dq_t, is_async=True)
        dq_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq_t, do_s, h_s, pg_s, k_s))[0]
        gate = gl.convert_layout(_sum(q_s.load(key_acc).to(gl.float32) * dq_t, axis=1), rows_of)
        _signal(bars, KEYS_FREE)
        _store_rows(dq, dq_t, tok0, n_valid, HV, hv, K, z)
        # h, v_new and v read out (the state role's sum(h . D) too)
        mbarrier.wait(bars.index(DOT_DONE), phase)
        if it + 1 < num_chunks:
            next_c, next_tok0, next_n_valid = _step(it + 1, num_chunks, bos, seq_len)
            _issue_state(v, v_new, h, vn_s, h_s, v_s, next_tok0, next_n_valid, (chunk0 + next_c) * HV + hv, hv,
                         bars, z, HV, K, V)

        # dbeta and dg: this role's row sums with the pair and state roles'
        mbarrier.wait(bars.index(PAIR_ROWS), phase)
        row_ok = ri < n_valid
        dbeta_t = gl.convert_layout(dbeta_v, rows_of) + row_sums.index(3 * phase + DBETA_ROWS).load(rows_of)
        gl.store(dbeta + (tok0 + ri) * HV + hv, dbeta_t, mask=row_ok)
        if HAS_G:
            state_dot = row_sums.index(3 * phase + STATE_DOT).load(rows_of)
            gate += row_sums.index(3 * phase + GATE_ROWS).load(rows_of)
            gate += gl.where(ri == n_valid - 1, gl.exp2(b2_last) * state_dot, 0.0)
            # the reverse cumsum as a masked row sum (a scan over this layout does not lower)
            gate_col = gl.convert_layout(gate, cols_of)
            d_gate = _sum(gl.where(cj[None, :] >= ri[:, None], gate_col[None, :], 0.0), axis=1)
            gl.store(dg + (tok0 + ri) * HV + hv, d_gate, mask=row_ok)


@gluon.jit
def _pair_role(dk, g_cum, beta, cu_seqlens, T, do_b, vn_b, h_b, dh_b, du_b, v_b, q_b, k_b,
               t_b, dw_b, pg_b, m_b, row_sums, bars, HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
               V: gl.constexpr, HAS_G: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The pair side of each chunk (module docstring)."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    dt: gl.constexpr = q_b.dtype
    key_acc: gl.constexpr = one_warpgroup_accumulator(K)
    pair_acc: gl.constexpr = one_warpgroup_accumulator(CHUNK)
    a_for_key: gl.constexpr = register_a_operand(key_acc)
    rows_of: gl.constexpr = gl.SliceLayout(1, pair_acc)
    key_rows: gl.constexpr = gl.SliceLayout(1, key_acc)
    for it in range(0, num_chunks):
        phase = it & 1
        c, tok0, n_valid = _step(it, num_chunks, bos, seq_len)
        z = _opaque_zero(it)
        do_s, vn_s, h_s, dh_s, du_s, v_s, q_s, k_s, t_s, dw_s, pg_s, m_s = _views(z, do_b, vn_b, h_b, dh_b, du_b, v_b,
                                                                                  q_b, k_b, t_b, dw_b, pg_b, m_b)
        ri, cj, b2, b_beta, b2_last, eb = _chunk_rows(g_cum, beta, tok0, n_valid, hv, z, bars, phase, pair_acc, HV,
                                                      HAS_G)

        # dk's state part e^(B_last - B) (v_new D^T) and the chunk-end terms of dB_last
        mbarrier.wait(bars.index(D_READY), phase)
        dkl = warpgroup_mma(vn_s, dh_s.permute((1, 0)), gl.zeros([CHUNK, K], gl.float32, key_acc), use_acc=False,
                            is_async=True)
        dkl = warpgroup_mma_wait(num_outstanding=0, deps=(dkl, vn_s, dh_s))[0]
        _signal(bars, D_FREE)
        dk_t = dkl * gl.convert_layout(gl.exp2(b2_last - b2), key_rows)[:, None]
        last_extra = _sum(_sum(k_s.load(key_acc).to(gl.float32) * dk_t, axis=1), axis=0)
        # its intra part Pg^T q
        mbarrier.wait(bars.index(PG_READY), phase)
        dk_t = warpgroup_mma(pg_s.permute((1, 0)), q_s, dk_t, is_async=True)
        dk_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk_t, pg_s, q_s))[0]
        gate = -gl.convert_layout(_sum(k_s.load(key_acc).to(gl.float32) * dk_t, axis=1), rows_of)

        # dT^T = diag(beta) (v du^T) + diag(e^B beta) (k dw^T): transposed, its scales are per row, and
        # the row sums kb_i = e^(B_i) sum_j T_ji (dw k^T)_ji = e^(B_i) sum_j (T^T)_ij (k dw^T)_ij are
        # within warps
        mbarrier.wait(bars.index(DU_READY), phase)
        duv_t = warpgroup_mma(v_s, du_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc),
                              use_acc=False, is_async=True)
        duv_t = warpgroup_mma_wait(num_outstanding=0, deps=(duv_t, du_s, v_s))[0]
        _signal(bars, DU_FREE)
        d_tmat_t = duv_t * b_beta[:, None]
        mbarrier.wait(bars.index(DW_READY), phase)
        dwk_t = warpgroup_mma(k_s, dw_s.permute((1, 0)), gl.zeros([CHUNK, CHUNK], gl.float32, pair_acc),
                              use_acc=False, is_async=True)
        dwk_t = warpgroup_mma_wait(num_outstanding=0, deps=(dwk_t, dw_s, k_s))[0]
        kb_row = _sum(t_s.permute((1, 0)).load(pair_acc).to(gl.float32) * dwk_t, axis=1) * eb
        d_tmat_t += dwk_t * (eb * b_beta)[:, None]
        _publish(m_s, d_tmat_t.to(dt))  # M's reader (the value role's dv2) passed before DU_READY

        d_ag, kkt = d_a_gated(t_s, m_s.permute((1, 0)), k_s, b2, ri, cj, n_valid, pair_acc)
        m = d_ag * kkt
        m_rows = _sum(m, axis=1)
        # rows and columns of m . beta (beta scales rows)
        gate += m_rows * b_beta - gl.convert_layout(_sum(m * b_beta[:, None], axis=0), rows_of)
        x_dab = (d_ag * b_beta[:, None]).to(dt)
        _publish(m_s, x_dab)  # dT's reader was waited for

        # dk's WY terms: X k + X^T k + diag(e^B beta) T^T dw, X = diag(beta) dAg
        t_scaled = t_s.permute((1, 0)).load(pair_acc).to(gl.float32) * (eb * b_beta)[:, None]
        dk_t = warpgroup_mma(gl.convert_layout(x_dab, a_for_key), k_s, dk_t, is_async=True)
        dk_t = warpgroup_mma(m_s.permute((1, 0)), k_s, dk_t, is_async=True)
        dk_t = warpgroup_mma(gl.convert_layout(t_scaled.to(dt), a_for_key), dw_s, dk_t, is_async=True)
        dk_t = warpgroup_mma_wait(num_outstanding=0, deps=(dk_t, m_s, k_s, dw_s))[0]
        _signal(bars, KEYS_FREE)  # the state role reloads q, k, T and do
        row_sums.index(3 * phase + DBETA_ROWS).store(m_rows + kb_row)
        gate += kb_row * b_beta + gl.where(ri == n_valid - 1, last_extra, 0.0)
        row_sums.index(3 * phase + GATE_ROWS).store(gate)
        _signal(bars, PAIR_ROWS)
        _store_rows(dk, dk_t, tok0, n_valid, HV, hv, K, z)


@gluon.jit
def _publish_state(lo, hi, dh_s, bars, phase, K: gl.constexpr):
    """dh[c] = D's bf16 copy for the other roles, once they have read the previous copy; a half at
    a time (few registers beside D's)."""
    mbarrier.wait(bars.index(D_FREE), phase ^ 1)
    dh_s.slice(0, CHUNK).store(lo.to(dh_s.dtype))
    if K == 2 * CHUNK:
        dh_s.slice(CHUNK, CHUNK).store(hi.to(dh_s.dtype))
    fence_async_shared()
    _signal(bars, D_READY)


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
def _state_role(q, k, ai, do, dht, dh0, g_cum, cu_seqlens, T, dh_s, do_s, du_s, q_s, k_s, h_s, t_s, row_sums, bars,
                HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, HAS_G: gl.constexpr, HAS_DHT: gl.constexpr,
                STORE_DH0: gl.constexpr, IS_VARLEN: gl.constexpr):
    """The state role (module docstring): D [K, V] as its warpgroup's MMA accumulators, rows
    0..63 and (K = 128) 64..127."""
    seq_hv, hv, bos, seq_len, num_chunks = sequence_of_program(cu_seqlens, T, HV, IS_VARLEN)
    head = hv // (HV // HQ)
    dh_s, do_s, du_s, q_s, k_s, h_s, t_s = dh_s.index(0), do_s.index(0), du_s.index(0), q_s.index(0), k_s.index(0), \
        h_s.index(0), t_s.index(0)
    rows_of: gl.constexpr = gl.SliceLayout(1, one_warpgroup_accumulator(CHUNK))
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
        # sum(h . D) for the gate's chunk-end term, from D's copy, while the others work
        mbarrier.wait(bars.index(LOAD_STATE), it & 1)
        state_dot = _state_dot(h_s, dh_s, K, V, 8, True)  # a slice at a time: beside D's 128 registers
        row_sums.index(3 * (it & 1) + STATE_DOT).store(gl.zeros([CHUNK], gl.float32, rows_of) + state_dot)
        _signal(bars, DOT_DONE)
        mbarrier.wait(bars.index(UPDATE_READY), it & 1)
        lo = _update_half(lo, decay, 0, q_s, k_s, do_s, du_s)
        if K == 2 * CHUNK:
            hi = _update_half(hi, decay, CHUNK, q_s, k_s, do_s, du_s)
        lo, hi, _, _, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(lo, hi, q_s, k_s, do_s, du_s))
        if it + 1 < num_chunks:
            # the next chunk's q, k, T and do, once the value and pair roles have read them out
            # (this role is idle here; the others' loads would sit on their chains)
            mbarrier.wait(bars.index(KEYS_FREE), it & 1)
            next_c, next_tok0, next_n_valid = _step(it + 1, num_chunks, bos, seq_len)
            _issue_keys(q, k, ai, do, q_s, k_s, t_s, do_s, next_tok0, next_n_valid, head, hv, bars,
                        _opaque_zero(it), HQ, HV, K, V)
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
    """One program per (sequence, value head): the value role's 4 warps here, plus the pair and
    state warpgroups."""
    dt: gl.constexpr = q.dtype.element_ty
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, V], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    state_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, V], dt)
    # each with a leading dimension of one, for the roles' views (_views)
    do_b = gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem)
    vn_b = gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem)
    h_b = gl.allocate_shared_memory(dt, [1, K, V], state_smem)
    dh_b = gl.allocate_shared_memory(dt, [1, K, V], state_smem)  # D's bf16 copy
    du_b = gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem)  # du = dv2, then the update's operand
    v_b = gl.allocate_shared_memory(dt, [1, CHUNK, V], value_smem)
    q_b = gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem)
    k_b = gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem)
    t_b = gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem)
    dw_b = gl.allocate_shared_memory(dt, [1, CHUNK, K], key_smem)
    pg_b = gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem)
    m_b = gl.allocate_shared_memory(dt, [1, CHUNK, CHUNK], square_smem)  # M, then dT, then X
    row_sums = gl.allocate_shared_memory(gl.float32, [6, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BARS):
        mbarrier.init(bars.index(i), count=_arrivals(i))
    gl.warp_specialize([
        (_value_role, (q, k, v, v_new, h, do, ai, dq, dv, dbeta, dg, g_cum, beta, cu_seqlens, chunk_offsets, T, scale,
                       do_b, vn_b, h_b, dh_b, du_b, v_b, q_b, k_b, t_b, dw_b, pg_b, m_b, row_sums, bars,
                       HQ, HV, K, V, HAS_G, IS_VARLEN)),
        (_pair_role, (dk, g_cum, beta, cu_seqlens, T, do_b, vn_b, h_b, dh_b, du_b, v_b,
                      q_b, k_b, t_b, dw_b, pg_b, m_b, row_sums, bars, HQ, HV, K, V, HAS_G, IS_VARLEN)),
        (_state_role, (q, k, ai, do, dht, dh0, g_cum, cu_seqlens, T, dh_b, do_b, du_b, q_b, k_b, h_b, t_b, row_sums,
                       bars, HQ, HV, K, V, HAS_G,
                       HAS_DHT, STORE_DH0, IS_VARLEN)),
    ], [4, 4], [PAIR_REGS, STATE_REGS])


@gluon.constexpr_function
def _arrivals(index):
    return ARRIVALS[index]


def bwd_sequential(layout, q, k, v, v_new, h, do, ai, g_cum, beta, dht, want_dh0: bool, scale: float,
                   cu_seqlens=None, chunk_offsets=None, num_seqs=None):
    """-> (dq, dk, dv, dbeta fp32, dg fp32 or None, dh0 fp32 or None); dq and dk per value head as
    backward_chunk.bwd_chunk gives them. h, v_new: the state pass's; ai: the forward's T; do in q's
    dtype; dht fp32 or None. Over the layout's sequences, or (cu_seqlens, chunk_offsets, num_seqs
    given) over segments of them, each from its end's state gradient in dht
    (triton/bwd_dhu.segment_end_gradients)."""
    B, T, HQ, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dq, dk, dv, dbeta, dg = gradient_buffers(q, v, g_cum is not None)
    if cu_seqlens is None:
        cu_seqlens, chunk_offsets = (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)
        num_seqs = layout.num_seqs
    dh0 = torch.empty(num_seqs, HV, K, V, device=q.device, dtype=torch.float32) if want_dh0 else None
    launch(gdn_bwd_ws_kernel, (1, num_seqs * HV),
           q, k, v, v_new, h, do, ai, g_cum, beta, dht, dq, dk, dv, dbeta, dg, dh0, cu_seqlens, chunk_offsets, T,
           scale,
           HQ=HQ, HV=HV, K=K, V=V, HAS_G=g_cum is not None, HAS_DHT=dht is not None, STORE_DH0=want_dh0,
           IS_VARLEN=cu_seqlens is not None, num_warps=4, maxnreg=168)
    return dq, dk, dv, dbeta, dg, dh0
