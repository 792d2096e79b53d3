"""The backward's sequential pass: the state gradients, chunks from last to first (the public
chunk_gated_delta_rule_bwd_dhu)."""
import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from ..layout import ChunkLayout
from ..segments import segments_of
from .common import (
    CHUNK, chunk_inverse, initial_state, load_last, load_last_row, load_tile, load_vec, seq_args,
    sequence_program, state_ptrs, store_tile
)


@triton.jit(do_not_specialize=["T"])
def gdn_bwd_dhu_kernel(q, k, w, beta, do, dv, g_cum, gk_cum, dht, dh, dh0, dv2, reach, cu_seqlens, chunk_offsets,
                       T, scale,
                       HQ: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr,
                       HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_DHT: tl.constexpr,
                       STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
                       STORE_STATES: tl.constexpr = True, CONSTANT_TERMS: tl.constexpr = True,
                       DHT_IDENTITY: tl.constexpr = False, LOCAL_DV: tl.constexpr = False,
                       W_FROM_T: tl.constexpr = False, USE_REACH: tl.constexpr = False):
    """One program per (V tile, sequence, head), chunks from last to first. D is the gradient of
    the state at the end of the chunk:
        dh[c] = D;  dv2[c] = dv[c] + e^(g_last - g) (k[c] D)
        D = e^(g_last) e^(gk_last) D + scale (q[c] e^g)^T do[c] - w[c]^T dv2[c].
    q and k come already gated by gk (q e^gk, k e^(gk_last - gk): the public convention; the op
    passes those of key_gates.store_gated_qk). BK covers all of K.
    Segments (segments.py) run it with STORE_STATES off (the gradient at the segment's start
    only, into dh0), and for their transition with DHT_IDENTITY (the state starts as the
    identity; V is then K) and CONSTANT_TERMS off (do and dv taken as zero and not read).
    LOCAL_DV (scalar gate or none): dv is not read but formed here, dv = P^T do with
    P = scale (q k^T . e^(g_i - g_j)) on j <= i (the op's local_dv pass folded in).
    W_FROM_T (scalar gate or none): `w` holds T (the chunk's WY inverse, [64, 64] per row block)
    and beta is given; w^T x = (k beta e^g)^T (T^T x), so no w is read (the op's recompute of w
    is not needed).
    USE_REACH (a segment's local pass): a decayed segment (reach[segment, head] >= 0,
    segments.py) runs only its first `reach` chunks."""
    seq, hv, head, bos, seq_len, chunk0, krows, vcols = sequence_program(
        cu_seqlens, chunk_offsets, T, HQ, HV, BK, BV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    if DHT_IDENTITY:
        state = tl.where(krows[:, None] == vcols[None, :], 1.0, 0.0)
    else:
        state = initial_state(dht, seq, hv, HV, K, V, krows, vcols, HAS_DHT)
    dt = q.dtype.element_ty
    num_chunks = tl.cdiv(seq_len, CHUNK)
    if USE_REACH:
        first = tl.load(reach + seq * HV + hv)
        num_chunks = tl.where(first >= 0, first, num_chunks)
    # dv is read one chunk ahead: without a gate the compiler folds the dv add into the MMA's
    # accumulator, and a load feeding an accumulator is not pipelined (its latency then sat in
    # the chain of dependent MMAs every chunk).
    # The per-key decay row at a chunk's end is read one chunk ahead too (a plain load there
    # stalled the first MMA of the chunk).
    last = tl.maximum(num_chunks - 1, 0)  # a length-0 sequence loads nothing
    n_last = tl.minimum(seq_len - last * CHUNK, CHUNK).to(tl.int32)
    READ_DV: tl.constexpr = CONSTANT_TERMS and not LOCAL_DV
    if READ_DV:
        dv_next = load_tile(dv, bos + last * CHUNK, rows, HV, hv, V, vcols, n_last)
    if HAS_GK:
        c_last_next = load_last_row(gk_cum, tl.maximum(bos + last * CHUNK + n_last - 1, 0), HV, hv, K, krows)
    for c_rev in range(0, num_chunks):
        c = num_chunks - 1 - c_rev
        tok0 = bos + c * CHUNK
        n_valid = tl.minimum(seq_len - c * CHUNK, CHUNK).to(tl.int32)
        c_ahead = tl.maximum(c - 1, 0)
        n_ahead = tl.minimum(seq_len - c_ahead * CHUNK, CHUNK).to(tl.int32)
        if READ_DV:
            dvt = dv_next
            dv_next = load_tile(dv, bos + c_ahead * CHUNK, rows, HV, hv, V, vcols, n_ahead)
        if HAS_GK:
            c_last = c_last_next
            c_last_next = load_last_row(gk_cum, bos + c_ahead * CHUNK + n_ahead - 1, HV, hv, K, krows)
        if STORE_STATES:
            ptrs, mask = state_ptrs(dh, chunk0 + c, hv, HV, K, V, krows, vcols)
            tl.store(ptrs, state.to(dh.dtype.element_ty), mask=mask)
        if CONSTANT_TERMS:
            qt = load_tile(q, tok0, rows, HQ, head, K, krows, n_valid)
        kt = load_tile(k, tok0, rows, HQ, head, K, krows, n_valid)
        if W_FROM_T:
            tmat, beta_t = chunk_inverse(w, beta, tok0, rows, hv, HV, n_valid)
            tt = tl.trans(tmat).to(dt)
            if HAS_G:
                kb = (kt * (beta_t * tl.exp(load_vec(g_cum, tok0, rows, HV, hv, n_valid)))[:, None]).to(dt)
            else:
                kb = (kt * beta_t[:, None]).to(dt)
        else:
            wt = load_tile(w, tok0, rows, HV, hv, K, krows, n_valid)
        if CONSTANT_TERMS:
            dot_t = load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid)
        kd = tl.dot(kt, state.to(dt))
        if LOCAL_DV:
            # P^T [j, i] = scale k_j . q_i e^(g_i - g_j) on i >= j (valid i), exponents only there
            keep = (rows[None, :] >= rows[:, None]) & (rows[None, :] < n_valid)
            if HAS_G:
                g_rows = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
                gamma = tl.exp(tl.where(keep, g_rows[None, :] - g_rows[:, None], float("-inf")))
            else:
                gamma = tl.where(keep, 1.0, 0.0)
            pt = tl.dot(kt, tl.trans(qt)) * gamma * scale
            dvt = tl.dot(pt.to(dt), dot_t.to(dt))
        if HAS_G:
            # (q e^g)^T do = q^T (e^g do): the gate goes on do's rows, q stays a plain load
            bt = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            b_last = load_last(g_cum, tok0, HV, hv, n_valid)
            kd = kd * tl.exp(b_last - bt)[:, None]
            if CONSTANT_TERMS:
                dot_t = dot_t * tl.exp(bt)[:, None]
            state = state * tl.exp(b_last)
        if HAS_GK:
            state = state * tl.exp(c_last)[:, None]
        if CONSTANT_TERMS:
            dv2t = dvt.to(tl.float32) + kd
        else:
            dv2t = kd
        if STORE_STATES:
            store_tile(dv2, dv2t, tok0, rows, HV, hv, V, vcols, n_valid)
        if W_FROM_T:
            # T^T dv2 first ([64, 64] x [64, BV]), then the keys' product as with w
            wt = kb
            dv2_for_w = tl.dot(tt, dv2t.to(dt))
        else:
            dv2_for_w = dv2t
        if not CONSTANT_TERMS:  # the transition alone: no q^T do term
            state = tl.dot(tl.trans(wt), (-dv2_for_w).to(dt), acc=state)
        # scale on do's rows too: do then reaches the MMA from registers in every mode, which
        # measured faster than straight from its load when there is no gate
        elif BK > 128:
            # both products accumulate into the state itself: as `state += A - B` three [K, BV]
            # fp32 tiles are live, which spilled at K = 256
            state = tl.dot(tl.trans(qt), (dot_t * scale).to(dt), acc=state)
            state = tl.dot(tl.trans(wt), (-dv2_for_w).to(dt), acc=state)
        else:  # faster up to K = 128
            state += tl.dot(tl.trans(qt), (dot_t * scale).to(dt)) - tl.dot(tl.trans(wt), dv2_for_w.to(dt))
    if STORE_DH0:
        ptrs, mask = state_ptrs(dh0, seq, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state, mask=mask)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def _runner(plan, q, k, w, beta, do, dv, g_cum, gk_cum, dh, dv2, scale: float, local_dv: bool, w_from_t: bool):
    """The launch of gdn_bwd_dhu_kernel over some sequences (the layout's, or segments):
    run(num_seqs, cu_seqlens, chunk_offsets, is_varlen, dht or None, dh0 or None, columns=V,
    reach=None, **flags)."""
    T, HQ, K = q.shape[1:]
    HV, V = do.shape[2], do.shape[3]
    cfg = plan.launch("bwd_dhu")

    def run(num_seqs, cu, offsets, is_varlen, start, end, columns=V, reach=None, **flags):
        launch(gdn_bwd_dhu_kernel, (ceil_div(columns, cfg.block_v), num_seqs * HV),
               q, k, w, beta, do, dv, g_cum, gk_cum, start, dh, end, dv2, reach, cu, offsets, T, scale,
               HQ=HQ, HV=HV, K=K, V=columns, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
               HAS_GK=gk_cum is not None, HAS_DHT=start is not None, STORE_DH0=end is not None,
               IS_VARLEN=is_varlen, **cfg.launch_options(),
               LOCAL_DV=local_dv and flags.get("CONSTANT_TERMS", True), W_FROM_T=w_from_t,
               USE_REACH=reach is not None, **flags)
    return run


def _join_cut(run, plan, layout: ChunkLayout, per_segment: int, dht, forward_transition, reverse_reach, K: int,
              V: int, HV: int, device):
    """The cut's local pass (each segment's start gradient from a zero end; with the forward's
    cut, decayed segments run only their reach, reverse_reach) and, with the transitions (the
    forward's, read transposed, where known, else a pass of their own), the join right to left:
    -> (segment layout, the gradient at each segment's end, dh0 of the sequences)."""
    seg = segments_of(layout.batch, layout.seq_len, layout.cu_seqlens, per_segment, device)
    slots = (seg.num_slots, seg.cu_seqlens, seg.chunk_offsets, True)
    local = torch.empty(seg.num_slots, HV, K, V, device=device, dtype=torch.float32)
    same_cut = forward_transition is not None and per_segment == plan.segment_chunks()
    run(*slots, None, local, STORE_STATES=False, reach=reverse_reach if same_cut else None)
    if same_cut:  # the forward's M, applied transposed by the join
        transition = forward_transition
    else:  # M^T of a pass of its own
        transition = torch.empty(seg.num_slots, HV, K, K, device=device, dtype=torch.float32)
        run(*slots, None, transition, columns=K, STORE_STATES=False, CONSTANT_TERMS=False, DHT_IDENTITY=True)
    ends, dh0 = plan.join(transition, local, seg, dht, reverse=True, transposed=same_cut)
    return seg, ends, dh0


def segment_end_gradients(plan, layout: ChunkLayout, q, k, do, g_cum, inverse: tuple, dht, scale: float,
                          forward_transition: torch.Tensor | None = None, reverse_reach: torch.Tensor | None = None):
    """-> (segment layout, the state gradient at each segment's end [slots, HV, K, V] fp32, dh0 fp32)
    of bwd_dhu cut by the plan, without its per-chunk outputs: for a kernel that then runs each
    segment from its end (gluon/backward_ws.py). Scalar gate or none; inverse = (T, beta): the
    local pass forms the intra-chunk dv and applies w through T itself."""
    K, HV, V = q.shape[3], do.shape[2], do.shape[3]
    ai, beta = inverse
    run = _runner(plan, q, k, ai, beta, do, None, g_cum, None, None, None, scale, local_dv=True, w_from_t=True)
    return _join_cut(run, plan, layout, plan.segment_chunks("bwd_dhu"), dht, forward_transition, reverse_reach, K, V,
                     HV, q.device)


def bwd_dhu(plan, layout: ChunkLayout, q, k, w, do, dv, g_cum, gk_cum, dht, want_dh0: bool, scale: float,
            forward_transition: torch.Tensor | None = None, local_dv_dtype: torch.dtype | None = None,
            inverse: tuple | None = None, reverse_reach: torch.Tensor | None = None):
    """-> (dh [B * NT or slots, HV, K, V] in q's dtype, dh0 or None, dv2 like dv).
    dv None with local_dv_dtype (scalar gate or none): the intra-chunk dv = P^T do is formed
    inside (LOCAL_DV), and dv2 comes in that dtype. w None with inverse = (T, beta) (scalar gate
    or none): w^T is applied as (k beta e^g)^T T^T (W_FROM_T).
    With the plan's chunks_per_segment, segments run side by side as in the forward's state pass,
    joined right to left (segments.py). forward_transition: the forward state pass's segment
    transitions M over the same cut, where known: this pass's are their transposes (the state
    gradient's recursion is the adjoint of the state's), so they are not computed again, and
    reverse_reach (its reach for this pass, segments.py), where given, shortens the decayed
    segments' local pass."""
    K, HV, V = q.shape[3], do.shape[2], do.shape[3]
    dev = q.device
    dh = torch.empty(layout.num_chunk_states, HV, K, V, device=dev, dtype=q.dtype)
    local_dv = dv is None
    if local_dv and (gk_cum is not None or local_dv_dtype is None):
        raise ValueError("bwd_dhu: dv may be left to the kernel (local_dv_dtype given) only without gk")
    dv2 = torch.empty(do.shape, device=dev, dtype=local_dv_dtype) if local_dv else torch.empty_like(dv)
    w_from_t = w is None
    if w_from_t:
        if gk_cum is not None or inverse is None:
            raise ValueError("bwd_dhu: w may be formed from T (inverse given) only without gk")
        w, beta = inverse
    else:
        beta = None
    per_segment = plan.segment_chunks("bwd_dhu")
    run = _runner(plan, q, k, w, beta, do, dv, g_cum, gk_cum, dh, dv2, scale, local_dv, w_from_t)
    if per_segment is None:
        dh0 = torch.empty(layout.num_seqs, HV, K, V, device=dev, dtype=torch.float32) if want_dh0 else None
        cu, offsets = seq_args(layout)
        run(layout.num_seqs, cu, offsets, layout.is_varlen, dht, dh0)
        return dh, dh0, dv2
    seg, ends, dh0 = _join_cut(run, plan, layout, per_segment, dht, forward_transition, reverse_reach, K, V, HV,
                               dev)
    run(seg.num_slots, seg.cu_seqlens, seg.chunk_offsets, True, ends, None)
    return dh, dh0 if want_dh0 else None, dv2
