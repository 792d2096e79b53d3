"""The forward's sequential pass: the states h[c] at each chunk start and v_new = u - w h[c],
chunk after chunk (also run again by the backward, which keeps no per-chunk state)."""
import torch
import triton
import triton.language as tl

from ....runtime.config import ceil_div
from ....runtime.launch import launch
from ..layout import ChunkLayout
from ..segments import reach_block, reach_of_segment, segments_of
from .common import (
    CHUNK, chunk_inverse, initial_state, load_last, load_last_row, load_tile, load_vec, seq_args,
    sequence_program, state_ptrs, store_tile
)


@triton.jit(do_not_specialize=["T"])
def gdn_fwd_h_kernel(k, w, u, v, beta, ai, g_cum, gk_cum, h0, h, v_new, ht, decay_bound, reach_back, cu_seqlens,
                     chunk_offsets, T,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_H0: tl.constexpr,
                     STORE_HT: tl.constexpr, WU_FROM_T: tl.constexpr, IS_VARLEN: tl.constexpr,
                     STORE_STATES: tl.constexpr = True, CONSTANT_TERMS: tl.constexpr = True,
                     H0_IDENTITY: tl.constexpr = False, USE_REACH: tl.constexpr = False,
                     REACH_BLOCK: tl.constexpr = 1, STORE_REACH_BACK: tl.constexpr = False):
    """One program per (V tile, sequence, head): the states h[c] at each chunk start and
    v_new = u - w h[c], chunk after chunk. BK covers all of K.
    With WU_FROM_T (scalar gate or none) w and u are not read: from the chunk's T,
        v_new = T diag(beta) (v - diag(e^g) k h[c])
    (w = T diag(beta e^g) k, u = T diag(beta) v). That reads T, v and beta where the other form
    reads w and u (the same bytes at K = V) and spares the kernel that writes w and u, but adds a
    dependent product to every chunk's chain: it pays where the GPU is full, not where few
    programs run (launch_table.states_from_inverse).
    With gk, k comes gated by the per-key decay to the chunk's end, k e^(C_last - C), per value
    head (key_gates.store_gated_qk writes it), with H = HV.
    Segments (segments.py) run it with STORE_STATES off (end state only, into ht), and for their
    transition M with H0_IDENTITY (the state starts as the identity; V is then K) and
    CONSTANT_TERMS off (u, or v, taken as zero and not read). USE_REACH (segments): each program
    finds its segment's reach from prepare's decay_bound (segments.reach_of_segment; REACH_BLOCK
    covers a segment's chunks), and a decayed segment runs its local pass from that chunk and its
    transition as zero; STORE_REACH_BACK: the local pass's first V tile also stores the reach of
    the backward's pass into reach_back [segments, HV] (no launch of its own)."""
    seq, hv, head, bos, seq_len, chunk0, krows, vcols = sequence_program(
        cu_seqlens, chunk_offsets, T, H, HV, BK, BV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    if H0_IDENTITY:
        state = tl.where(krows[:, None] == vcols[None, :], 1.0, 0.0)
    else:
        state = initial_state(h0, seq, hv, HV, K, V, krows, vcols, HAS_H0)
    n_chunks = tl.cdiv(seq_len, CHUNK)
    c_first = 0
    if USE_REACH:
        first = reach_of_segment(decay_bound, chunk0, n_chunks, hv, HV, REACH_BLOCK, False)
        if STORE_REACH_BACK:
            if tl.program_id(0) == 0:
                tl.store(reach_back + seq * HV + hv,
                         reach_of_segment(decay_bound, chunk0, n_chunks, hv, HV, REACH_BLOCK, True))
        if H0_IDENTITY:
            state = tl.where(first >= 0, 0.0, state)
            c_first = tl.where(first >= 0, n_chunks, 0)
        else:
            c_first = tl.maximum(first, 0)
    for c in range(c_first, n_chunks):
        tok0 = bos + c * CHUNK
        n_valid = tl.minimum(seq_len - c * CHUNK, CHUNK).to(tl.int32)
        if STORE_STATES:
            ptrs, mask = state_ptrs(h, chunk0 + c, hv, HV, K, V, krows, vcols)
            tl.store(ptrs, state.to(h.dtype.element_ty), mask=mask)
        kt = load_tile(k, tok0, rows, H, head, K, krows, n_valid)
        if HAS_G:
            bt = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
        if WU_FROM_T:
            tmat, beta_t = chunk_inverse(ai, beta, tok0, rows, hv, HV, n_valid)
            kh = tl.dot(kt, state.to(kt.dtype))
            if HAS_G:
                kh = kh * tl.exp(bt)[:, None]
            if CONSTANT_TERMS:
                vt = load_tile(v, tok0, rows, HV, hv, V, vcols, n_valid).to(tl.float32)
                vn = tl.dot(tmat.to(kt.dtype), ((vt - kh) * beta_t[:, None]).to(kt.dtype))
            else:
                vn = tl.dot(tmat.to(kt.dtype), (-kh * beta_t[:, None]).to(kt.dtype))
        else:
            wt = load_tile(w, tok0, rows, HV, hv, K, krows, n_valid)
            if CONSTANT_TERMS:
                vn = load_tile(u, tok0, rows, HV, hv, V, vcols, n_valid).to(tl.float32) - tl.dot(wt, state.to(wt.dtype))
            else:
                vn = -tl.dot(wt, state.to(wt.dtype))
        if STORE_STATES:
            store_tile(v_new, vn, tok0, rows, HV, hv, V, vcols, n_valid)
        if HAS_G:
            b_last = load_last(g_cum, tok0, HV, hv, n_valid)
            vn = vn * tl.exp(b_last - bt)[:, None]
            state = state * tl.exp(b_last)
        if HAS_GK:  # k comes gated (k e^(C_last - C), per value head): only the state decays here
            c_last = load_last_row(gk_cum, tok0 + n_valid - 1, HV, hv, K, krows)
            state = state * tl.exp(c_last)[:, None]
        state += tl.dot(tl.trans(kt), vn.to(kt.dtype))
    if STORE_HT:
        ptrs, mask = state_ptrs(ht, seq, hv, HV, K, V, krows, vcols)
        tl.store(ptrs, state, mask=mask)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def _runner(plan, layout: ChunkLayout, k, v, beta, ai, w, u, g_cum, gk_cum, h, v_new):
    """A launcher of the state pass over some sequences (or segments); `ht` the end states' buffer."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    from_inverse = w is None
    if not from_inverse:
        ai = beta = None  # not read
    cfg = plan.launch("fwd_h_from_t" if from_inverse else "fwd_h")

    def run(num_seqs, cu, offsets, is_varlen, h0, ht, columns=V, decay_bound=None, reach_back=None, **flags):
        launch(gdn_fwd_h_kernel, (ceil_div(columns, cfg.block_v), num_seqs * HV),
               k, w, u, v, beta, ai, g_cum, gk_cum, h0, h, v_new, ht, decay_bound, reach_back,
               cu, offsets, T, H=H, HV=HV, K=K, V=columns, BK=cfg.block_k, BV=cfg.block_v,
               HAS_G=g_cum is not None, HAS_GK=gk_cum is not None, HAS_H0=h0 is not None,
               STORE_HT=ht is not None, WU_FROM_T=from_inverse, IS_VARLEN=is_varlen,
               USE_REACH=decay_bound is not None, STORE_REACH_BACK=reach_back is not None,
               **cfg.launch_options(), **flags)
    return run


def states(plan, layout: ChunkLayout, k, v, beta, ai, w, u, g_cum, gk_cum, initial_state, store_final: bool,
           known: tuple | None = None, decay_bound: torch.Tensor | None = None):
    """States at each chunk start and v_new, from w and u, or (both None) from T (ai), v and beta.
    With gk, k is the gated k of key_gates.store_gated_qk (per value head). -> (h, v_new, final or None,
    segments or None).
    With the plan's chunks_per_segment, every sequence is cut into segments run side by side:
    each segment's end state from zero and its transition (from the identity), the join, then
    every segment again from its true start (segments.py). `segments` = (starts, transition)
    of that cut, fp32 [slots, HV, K, V] and [slots, HV, K, K], and its reach for the backward's
    pass (segments.py; None unless decay_bound is given): the backward passes them back as
    `known` (its recomputation then runs only the last step) and bwd_dhu reuses the transitions
    and the reach.
    decay_bound: prepare's per-chunk transition bounds where the plan drops decayed segments'
    transitions (segments.py), else None."""
    HV, V = v.shape[2], v.shape[3]
    dev = k.device
    h = torch.empty(layout.num_chunk_states, HV, k.shape[3], V, device=dev, dtype=k.dtype)
    v_new = torch.empty_like(v)
    run = _runner(plan, layout, k, v, beta, ai, w, u, g_cum, gk_cum, h, v_new)
    per_segment = plan.segment_chunks()
    if per_segment is None:
        final = torch.empty(layout.num_seqs, HV, k.shape[3], V, device=dev, dtype=torch.float32) \
            if store_final else None
        cu, offsets = seq_args(layout)
        run(layout.num_seqs, cu, offsets, layout.is_varlen, initial_state, final)
        return h, v_new, final, None
    seg = segments_of(layout.batch, layout.seq_len, layout.cu_seqlens, per_segment, dev)
    slots = (seg.num_slots, seg.cu_seqlens, seg.chunk_offsets, True)
    if known is not None:  # the forward's cut, its starts known: the last step only
        run(*slots, known[0], None)
        return h, v_new, None, known
    starts, transition, final, reach_back = _join(plan, seg, run, HV, k.shape[3], V, initial_state, decay_bound)
    run(*slots, starts, None)
    return h, v_new, final if store_final else None, (starts, transition, reach_back)


def segment_starts(plan, layout: ChunkLayout, k, v, beta, ai, g_cum, initial_state, per_segment: int,
                   decay_bound: torch.Tensor | None = None):
    """The cut alone, for a last pass of another kernel (the fused forward): each segment's end
    state and transition from T, joined (decay_bound as for states). -> (segment layout, starts,
    transitions, final, reach for the backward or None)."""
    seg = segments_of(layout.batch, layout.seq_len, layout.cu_seqlens, per_segment, k.device)
    run = _runner(plan, layout, k, v, beta, ai, None, None, g_cum, None, None, None)
    starts, transition, final, reach_back = _join(plan, seg, run, v.shape[2], k.shape[3], v.shape[3],
                                                  initial_state, decay_bound)
    return seg, starts, transition, final, reach_back


def _join(plan, seg, run, HV: int, K: int, V: int, initial_state, decay_bound=None):
    """Each segment's end state from zero (states not stored) and its transition (from the
    identity), joined (plan.join): -> (starts, transitions, final, reach_back). With decay_bound,
    decayed segments run their local pass from their reach and their transition as zero, and
    reach_back is their reach for the backward's pass (segments.py) where bwd_dhu is cut alike,
    else None."""
    slots = (seg.num_slots, seg.cu_seqlens, seg.chunk_offsets, True)
    dev = seg.cu_seqlens.device
    local = torch.empty(seg.num_slots, HV, K, V, device=dev, dtype=torch.float32)
    transition = torch.empty(seg.num_slots, HV, K, K, device=dev, dtype=torch.float32)
    # the backward's reach serves only a bwd_dhu cut like this pass
    dhu_alike = plan.dhu_chunks_per_segment.value == seg.chunks_per_segment
    reach_back = None
    reach = {}
    if decay_bound is not None:
        reach = dict(decay_bound=decay_bound, REACH_BLOCK=reach_block(seg))
        if dhu_alike:
            reach_back = torch.empty(seg.num_slots, HV, device=dev, dtype=torch.int32)
    run(*slots, None, local, STORE_STATES=False, reach_back=reach_back, **reach)
    run(*slots, None, transition, columns=K, STORE_STATES=False, CONSTANT_TERMS=False, H0_IDENTITY=True, **reach)
    starts, final = plan.join(transition, local, seg, initial_state)
    return starts, transition, final, reach_back
