"""Pieces the fused forward kernels share: the program's sequence, the chunk's tile copies into
a shared-memory ring slot, its gate and beta rows, the fast exponential, the transposed state's
addressing and start, the output's store, and the warp-role kernels' hand-off between
partitions."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

CHUNK = gl.constexpr(64)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def one_warpgroup_accumulator(columns):
    """The register layout of a one-warpgroup MMA's fp32 accumulator, 64 rows by `columns`."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.constexpr_function
def register_a_operand(accumulator):
    """The register layout of a 16-bit A operand of an MMA into `accumulator`."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator, k_width=2)


@gluon.jit
def exp2_ftz(x):
    """2^x on the MUFU unit alone (denormal results flushed to zero)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def sequence_of_program(cu_seqlens, T, HV: gl.constexpr, IS_VARLEN: gl.constexpr, order=None):
    """(sequence x value head, value head, first token (int64), length, chunks) of this program
    (grid axis 1). order (varlen, or None): the sequences in the order their programs run
    (layout.longest_first)."""
    seq_hv = gl.program_id(1)
    seq = seq_hv // HV
    if IS_VARLEN:
        if order is not None:
            seq = gl.load(order + seq)
            seq_hv = seq * HV + seq_hv % HV
        bos = gl.load(cu_seqlens + seq).to(gl.int64)
        seq_len = gl.load(cu_seqlens + seq + 1).to(gl.int64) - bos
    else:
        bos = seq.to(gl.int64) * T
        seq_len = T.to(gl.int64)
    return seq_hv, seq_hv % HV, bos, seq_len, gl.cdiv(seq_len, CHUNK).to(gl.int32)


@gluon.jit
def first_chunk_state(chunk_offsets, seq_hv, T, HV: gl.constexpr, IS_VARLEN: gl.constexpr):
    """Index (int64) of the first per-chunk state of sequence seq_hv // HV in the [chunk states,
    HV, K, V] tensors (h, dh): chunk_offsets for varlen, else the sequence's chunks times its
    index."""
    if IS_VARLEN:
        return gl.load(chunk_offsets + seq_hv // HV).to(gl.int64)
    else:
        return (seq_hv // HV).to(gl.int64) * gl.cdiv(T, CHUNK)


@gluon.jit
def reverse_chunk(step, num_chunks, bos, seq_len):
    """(chunk index, first token, valid rows) of step `step` of a walk over a sequence's chunks
    from last to first (the backward's sequential kernels)."""
    c = num_chunks - 1 - step
    return c, bos + c * CHUNK, gl.minimum(seq_len - c * CHUNK, CHUNK)


@gluon.jit
def copy_chunk_tiles(q, k, v, ai, q_slot, k_slot, v_slot, t_slot, tok0, n_valid, head, hv, v_start,
                     HQ: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     NW: gl.constexpr):
    """cp.async of one chunk's q, k (q/k head `head`), v (value head hv, columns v_start..+BV) and
    T tiles into ring slots by the NW issuing warps; rows from n_valid on are zero-filled."""
    key_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (K // 8), K // 8], [NW, 1], [1, 0])
    value_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BV // 8), BV // 8], [NW, 1], [1, 0])
    square_load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, key_load))
    kcols = gl.arange(0, K, layout=gl.SliceLayout(0, key_load))
    key_mask = (rows < n_valid)[:, None] & (kcols < K)[None, :]
    key_offs = ((tok0 + rows)[:, None] * HQ + head) * K + kcols[None, :]
    async_copy.async_copy_global_to_shared(q_slot, q + key_offs, key_mask)
    async_copy.async_copy_global_to_shared(k_slot, k + key_offs, key_mask)
    vrows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, value_load))
    vcols = v_start + gl.arange(0, BV, layout=gl.SliceLayout(0, value_load))
    value_mask = (vrows < n_valid)[:, None] & (vcols < V)[None, :]
    async_copy.async_copy_global_to_shared(v_slot, v + ((tok0 + vrows)[:, None] * HV + hv) * V + vcols[None, :],
                                           value_mask)
    trows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, square_load))
    tcols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, square_load))
    t_mask = (trows < n_valid)[:, None] & (tcols < CHUNK)[None, :]
    async_copy.async_copy_global_to_shared(t_slot, ai + ((tok0 + trows)[:, None] * HV + hv) * CHUNK + tcols[None, :],
                                           t_mask)


@gluon.jit
def fill_ring_slot(q, k, x, ai, g_cum, beta, q_ring, k_ring, x_ring, t_ring, g_rows, beta_rows, ready, free, step,
                   chunk, bos, seq_len, head, hv, v_start, row_idx, HQ: gl.constexpr, HV: gl.constexpr,
                   K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, HAS_G: gl.constexpr):
    """A load warpgroup's step: once slot step % STAGES is free, cp.async of chunk `chunk`'s q, k
    (q/k head `head`), x (v or do: value head hv, columns v_start..+BV) and T into it, rows past
    the sequence zero-filled, each thread's copies arriving on the slot's ready barrier as they
    land; the chunk's gate cumsums (log2 units) and beta into the slot's rows in fp32 (plain
    loads and stores: beta's 2-byte elements are too small for cp.async), published by one more
    arrival."""
    slot = step % STAGES
    tok0 = bos + chunk * CHUNK
    n_valid = gl.minimum(seq_len - chunk * CHUNK, CHUNK)
    b2, b_beta = gate_rows(g_cum, beta, tok0, n_valid, hv, HV, row_idx, HAS_G)  # in flight through the wait
    mbarrier.wait(free.index(slot), ((step // STAGES) & 1) ^ 1)
    copy_chunk_tiles(q, k, x, ai, q_ring.index(slot), k_ring.index(slot), x_ring.index(slot), t_ring.index(slot),
                     tok0, n_valid, head, hv, v_start, HQ, HV, K, V, BV, 4)
    async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
    g_rows.index(slot).store(b2)
    beta_rows.index(slot).store(b_beta)
    gl.thread_barrier()
    mbarrier.arrive(ready.index(slot))


@gluon.jit
def gate_rows(g_cum, beta, tok0, n_valid, hv, HV: gl.constexpr, idx, HAS_G: gl.constexpr):
    """A chunk's gate cumsums in log2 units and its beta, fp32, at positions idx (zero from
    n_valid on)."""
    valid = idx < n_valid
    b_beta = gl.load(beta + (tok0 + idx) * HV + hv, mask=valid, other=0.0).to(gl.float32)
    if HAS_G:
        b = gl.load(g_cum + (tok0 + idx) * HV + hv, mask=valid, other=0.0) * LOG2E
    else:
        b = gl.zeros_like(b_beta)
    return b, b_beta


@gluon.jit
def last_gate(g_cum, tok0, n_valid, hv, HV: gl.constexpr, HAS_G: gl.constexpr):
    """The gate cumsum at a chunk's last valid row, log2 units (0 for an empty chunk or
    without g)."""
    if HAS_G:
        row = tok0 + gl.maximum(n_valid - 1, 0)
        return gl.load(g_cum + row * HV + hv, mask=n_valid > 0, other=0.0) * LOG2E
    else:
        return 0.0


@gluon.jit
def state_offsets(v_start, V: gl.constexpr, BV: gl.constexpr, K: gl.constexpr, layout: gl.constexpr):
    """Offsets and mask of h^T [BV, K] in a [K, V] state: element (v, k) at k * V + v."""
    sv = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, layout))
    sk = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    return sk[None, :] * V + sv[:, None], (sv < V)[:, None] & (sk < K)[None, :]


@gluon.jit
def store_output(o, out, tok0, n_valid, hv, HV: gl.constexpr, V: gl.constexpr, v_start, BV: gl.constexpr,
                 NW: gl.constexpr):
    """A chunk's o from o^T [BV, 64] (rows from n_valid on not written), stored along V: each
    thread a run of V columns of one token (coalesced)."""
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BV // 8, 32 // (BV // 8)], [1, NW], [0, 1])
    ov = v_start + gl.arange(0, BV, layout=gl.SliceLayout(1, out_layout))
    oc = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, out_layout))
    o_t = gl.convert_layout(out.to(o.dtype.element_ty), out_layout)
    o_offs = ((tok0 + oc) * HV + hv)[None, :] * V + ov[:, None]
    gl.store(o + o_offs, o_t, mask=(oc < n_valid)[None, :] & (ov < V)[:, None])


@gluon.jit
def allocate_ring(dt: gl.constexpr, K: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr):
    """The shared-memory ring of a chunk's q, k [64, K], v [64, BV] and T [64, 64] tiles, STAGES
    slots each, in the swizzled layouts warpgroup MMA reads."""
    key_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, K], dt)
    value_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BV], dt)
    square_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, CHUNK], dt)
    return (gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem),
            gl.allocate_shared_memory(dt, [STAGES, CHUNK, K], key_smem),
            gl.allocate_shared_memory(dt, [STAGES, CHUNK, BV], value_smem),
            gl.allocate_shared_memory(dt, [STAGES, CHUNK, CHUNK], square_smem))


def output_buffers(layout, q, v, store_final: bool, cu_seqlens=None, num_seqs=None):
    """A fused forward's outputs and the sequences it runs over: -> (o [B, T, HV, V] in q's
    dtype, final state fp32 [num_seqs, HV, K, V] or None, cu_seqlens or None, num_seqs). Without
    cu_seqlens, the layout's sequences; with it, others (the segments of a sequence split)."""
    import torch

    if cu_seqlens is None:
        cu_seqlens = layout.cu_seqlens if layout.is_varlen else None
        num_seqs = layout.num_seqs
    B, T, HV, V = v.shape
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    ht = torch.empty(num_seqs, HV, q.shape[3], V, device=q.device, dtype=torch.float32) if store_final else None
    return o, ht, cu_seqlens, num_seqs


@gluon.jit
def start_state(base, seq_hv, v_start, V: gl.constexpr, BV: gl.constexpr, K: gl.constexpr, layout: gl.constexpr,
                GIVEN: gl.constexpr):
    """A chain's starting h^T (or D^T) [BV, K] fp32 in `layout`: from a [.., K, V] state at index
    seq_hv of `base` (h0, dht, a segment's start), or zeros."""
    if GIVEN:
        s_offs, s_mask = state_offsets(v_start, V, BV, K, layout)
        return gl.load(base + seq_hv.to(gl.int64) * K * V + s_offs, mask=s_mask, other=0.0)
    else:
        return gl.zeros([BV, K], gl.float32, layout)


@gluon.jit
def store_state(base, state, seq_hv, v_start, V: gl.constexpr, BV: gl.constexpr, K: gl.constexpr,
                layout: gl.constexpr):
    """A chain's h^T (or D^T) [BV, K] fp32 in `layout` into a [.., K, V] state at index seq_hv of
    `base` (the final state, dh0)."""
    s_offs, s_mask = state_offsets(v_start, V, BV, K, layout)
    gl.store(base + seq_hv.to(gl.int64) * K * V + s_offs, state, mask=s_mask)


@gluon.jit
def forward_ws_barriers(STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr):
    """The warp-role forwards' mbarriers, initialised: (ready[STAGES], READY_ARRIVALS arrivals each
    (the load warpgroup's); free[STAGES], two (the chain and the output warpgroup); h_ready, h_free,
    v_ready, v_free [2], one each (the double-buffered hand-offs of h^T and v_new^T))."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    h_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(free.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(h_ready.index(i), count=1)
        mbarrier.init(h_free.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_free.index(i), count=1)
    return ready, free, h_ready, h_free, v_ready, v_free


@gluon.jit
def hand_off(bufs, value, ready, free, index, phase):
    """One partition's value for another through double-buffered shared memory: wait until
    buffer `index` is free (the reader's arrival of two uses ago), store, make the store visible
    to the async proxy (the reader's warpgroup MMA), then, every warp's part written, arrive on
    the buffer's ready barrier."""
    mbarrier.wait(free.index(index), phase ^ 1)
    bufs.index(index).store(value)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready.index(index))
