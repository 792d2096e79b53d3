"""Shared pieces of the gated delta rule's Triton kernels: addressing of chunks, sequences,
tiles and states; the gate algebra used by several passes; the launchers' common arguments.

Chunks are CHUNK = 64 tokens, cut into four SUB = 16-row blocks where a pass works blockwise.
Inside a chunk the gates are used as chunk-local cumulative sums; with the per-key gate `gk` the
total log decay of key channel k at row i is B_i[k] = g_cum_i + gk_cum_i[k].

Gate factorisation with gk: e^(B_i - B_j) = e^(B_i - r) e^(r - B_j). Between 16-row blocks I > J,
r is B at the first row of block I, so both factors are <= 1. Inside a diagonal block r is its
middle row, so factors stay below e^(8 |gk|): finite while the key decay per token is above about
e^-10. A diagonal block's K tile whose factors would pass e^MAX_FACTOR_EXPONENT (Kimi Delta
Attention with a strong decay) takes its pairs one key row at a time instead, each exponent
B_i - B_j <= 0 (factors_fit decides, per program and K tile; ordinary gates never get there).

Varlen: programs of chunk-parallel kernels are chunk slots; a slot maps to (sequence, chunk) through
`chunk_map` (built on the device, no host sync); unused slots exit at once. Kernels with several
programs per chunk (K tiles, 16-row blocks) put them side by side on grid axis 0, so that they
share the chunk's tiles in L2 (chunk_part_program). Absent tensors are passed as None: their
kernels read them only under the flag that says they are there.
"""
import torch
import triton
import triton.language as tl

from .. import layout
from ..layout import ChunkLayout

# (Kernel code keeps tensors on the left of these: in Triton's interpreter `constexpr + tensor`
# wraps the tensor in a constexpr.)
CHUNK = tl.constexpr(layout.CHUNK)
SUB = tl.constexpr(layout.SUB_ROWS)
BLOCKS = tl.constexpr(layout.BLOCKS_PER_CHUNK)


def pair_gradient_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of the stored pair-product gradients dP and dA (with gk): the whole-chunk
    pair-gradient kernel multiplies them in bf16 for bf16 inputs, so bf16 storage rounds them no
    further there; the blockwise kernel (strong decays) multiplies in fp32 and so meets them
    rounded to bf16 (errors against fp64 within the tests' bounds). fp16 and fp32 inputs
    multiply in fp32 (fp16's range is too short for the decay factors): fp32 storage."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


def chunk_args(layout: ChunkLayout) -> tuple:
    """(chunk_map, cu_seqlens) of a chunk-parallel launch; None, None for equal lengths."""
    return (layout.chunk_map, layout.cu_seqlens) if layout.is_varlen else (None, None)


def seq_args(layout: ChunkLayout) -> tuple:
    """(cu_seqlens, chunk_offsets) of a sequential launch; None, None for equal lengths."""
    return (layout.cu_seqlens, layout.chunk_offsets) if layout.is_varlen else (None, None)


@triton.jit
def chunk_of_slot(slot, batch, chunk_map, cu_seqlens, T, IS_VARLEN: tl.constexpr):
    """-> (first token (int64), valid rows, global chunk index) of a chunk slot. An unused varlen
    slot gets 0 valid rows, so every load and store of its program is masked off."""
    if IS_VARLEN:
        seq = tl.load(chunk_map + 2 * slot)
        local = tl.load(chunk_map + 2 * slot + 1)
        used = seq >= 0
        seq = tl.where(used, seq, 0)
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
        tok0 = bos + local.to(tl.int64) * CHUNK
        n_valid = tl.where(used, tl.minimum(eos - tok0, CHUNK), 0).to(tl.int32)
        return tok0, n_valid, slot.to(tl.int64)
    else:
        num_chunks = tl.cdiv(T, CHUNK)
        tok0 = batch.to(tl.int64) * T + slot.to(tl.int64) * CHUNK
        n_valid = tl.minimum(T - slot * CHUNK, CHUNK)
        return tok0, n_valid, batch.to(tl.int64) * num_chunks + slot


@triton.jit
def chunk_program(chunk_map, cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A chunk-parallel program's (value head, q/k head, first token, valid rows, global chunk)
    from its grid position (chunk slot, batch x value head)."""
    hv, head, tok0, n_valid, chunk, _ = chunk_part_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN, 1)
    return hv, head, tok0, n_valid, chunk


@triton.jit
def chunk_part_program(chunk_map, cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr,
                        IS_VARLEN: tl.constexpr, PARTS: tl.constexpr):
    """The same for kernels with PARTS programs per chunk (K tiles, 16-row blocks), plus the part:
    grid axis 0 is chunk slot * PARTS + part, so that a chunk's parts, which read the same tiles,
    run side by side and share them in L2 (as a slower grid axis the tiles came from DRAM again
    for each part)."""
    pid = tl.program_id(0)
    slot = pid // PARTS
    bhv = tl.program_id(1)
    hv = bhv % HV
    tok0, n_valid, chunk = chunk_of_slot(slot, bhv // HV, chunk_map, cu_seqlens, T, IS_VARLEN)
    return hv, hv // (HV // H), tok0, n_valid, chunk, pid % PARTS


@triton.jit
def seq_bounds(seq, cu_seqlens, chunk_offsets, T, IS_VARLEN: tl.constexpr):
    """-> (first token, length, first global chunk) of sequence `seq` (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + seq).to(tl.int64)
        eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
        chunk0 = tl.load(chunk_offsets + seq).to(tl.int64)
        return bos, eos - bos, chunk0
    else:
        return seq.to(tl.int64) * T, T.to(tl.int64), seq.to(tl.int64) * tl.cdiv(T, CHUNK)


@triton.jit
def sequence_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, HV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """A sequential pass's (sequence, value head, q/k head, first token, length, first global
    chunk, K rows, V columns) from its grid position (V tile, sequence x value head)."""
    v_tile = tl.program_id(0)
    seq_hv = tl.program_id(1)
    seq = seq_hv // HV
    hv = seq_hv % HV
    bos, seq_len, chunk0 = seq_bounds(seq, cu_seqlens, chunk_offsets, T, IS_VARLEN)
    return (seq, hv, hv // (HV // H), bos, seq_len, chunk0, tl.arange(0, BK),
            v_tile * BV + tl.arange(0, BV))


@triton.jit
def tile_ptrs(base, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    """Pointers and mask of a [rows, cols] tile of a [tokens, n_heads, D] tensor."""
    offs = ((tok0 + rows)[:, None] * n_heads + head) * D + cols[None, :]
    mask = (rows < n_valid)[:, None] & (cols < D)[None, :]
    return base + offs, mask


@triton.jit
def load_tile(base, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    ptrs, mask = tile_ptrs(base, tok0, rows, n_heads, head, D, cols, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def store_tile(base, value, tok0, rows, n_heads, head, D: tl.constexpr, cols, n_valid):
    ptrs, mask = tile_ptrs(base, tok0, rows, n_heads, head, D, cols, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def vec_ptrs(base, tok0, rows, n_heads, head, n_valid):
    return base + (tok0 + rows) * n_heads + head, rows < n_valid


@triton.jit
def load_vec(base, tok0, rows, n_heads, head, n_valid):
    ptrs, mask = vec_ptrs(base, tok0, rows, n_heads, head, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_vec(base, value, tok0, rows, n_heads, head, n_valid):
    ptrs, mask = vec_ptrs(base, tok0, rows, n_heads, head, n_valid)
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def state_ptrs(base, index, hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, krows, vcols):
    """Pointers and mask of a [K, V] state tile at state `index` (chunk or sequence), head hv."""
    offs = ((index * HV + hv) * K + krows[:, None]).to(tl.int64) * V + vcols[None, :]
    return base + offs, (krows < K)[:, None] & (vcols < V)[None, :]


@triton.jit
def initial_state(base, seq, hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, krows, vcols,
                   GIVEN: tl.constexpr):
    """A sequential pass's starting [BK, BV] fp32 state: from `base` (h0 or dht) or zeros."""
    if GIVEN:
        ptrs, mask = state_ptrs(base, seq, hv, HV, K, V, krows, vcols)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        rows: tl.constexpr = krows.shape[0]
        cols: tl.constexpr = vcols.shape[0]
        return tl.zeros([rows, cols], dtype=tl.float32)


@triton.jit
def square_ptrs(base, tok0, rows, HV: tl.constexpr, hv, cols, n_valid):
    """A [rows, cols] tile of a per-chunk [64, 64] matrix stored as [tokens, HV, 64]."""
    offs = ((tok0 + rows)[:, None] * HV + hv) * CHUNK + cols[None, :]
    return base + offs, (rows < n_valid)[:, None] & (cols < CHUNK)[None, :]


@triton.jit
def load_last(base, tok0, n_heads, head, n_valid):
    """The scalar at the chunk's last valid row of a [tokens, n_heads] tensor."""
    return tl.load(base + (tok0 + n_valid - 1) * n_heads + head).to(tl.float32)


@triton.jit
def load_last_row(base, tok0, n_heads, head, D: tl.constexpr, cols):
    """Row n_valid - 1 (pass tok0 + n_valid - 1 as tok0) of a [tokens, n_heads, D] tensor."""
    return tl.load(base + (tok0 * n_heads + head) * D + cols, mask=cols < D, other=0.0).to(tl.float32)


@triton.jit
def last_row_of(x, n_valid):
    """Row n_valid - 1 of a [64, N] tile."""
    return tl.sum(tl.where((tl.arange(0, CHUNK) == n_valid - 1)[:, None], x, 0.0), axis=0)


@triton.jit
def scalar_gamma(bi, bj, INCLUSIVE: tl.constexpr, valid_i):
    """e^(b_i - b_j) on the (strictly or inclusively) lower triangle of a square block where row i
    is valid (valid_i), else 0. Rows past the chunk's end load b = 0: their exponent -b_j would
    overflow once the chunk's decay passes e^-88, and inf times their zero products is NaN."""
    n: tl.constexpr = bi.shape[0]
    idx = tl.arange(0, n)
    if INCLUSIVE:
        keep = idx[:, None] >= idx[None, :]
    else:
        keep = idx[:, None] > idx[None, :]
    return tl.exp(tl.where(keep & valid_i[:, None], bi[:, None] - bj[None, :], float("-inf")))


@triton.jit
def chunk_inverse(ai, beta, tok0, rows, hv, HV: tl.constexpr, n_valid):
    """The chunk's stored T = (I + A)^-1 ([64, 64], zero above the diagonal) and its beta."""
    t_ptrs, t_mask = square_ptrs(ai, tok0, rows, HV, hv, rows, n_valid)
    return (tl.load(t_ptrs, mask=t_mask, other=0.0).to(tl.float32),
            load_vec(beta, tok0, rows, HV, hv, n_valid))


@triton.jit
def total_gate(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """B of a [64, BK] tile ([64, 1] without gk) and its value at the last valid row."""
    if HAS_G:
        bt = load_vec(g_cum, tok0, rows, HV, hv, n_valid)[:, None]
    else:
        bt = tl.zeros([CHUNK, 1], dtype=tl.float32)
    if HAS_GK:
        bt = bt + load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid)
    return bt, last_row_of(bt, n_valid)


@triton.jit
def reverse_cumsum(x):
    """sum over s >= i of x[s], down a chunk's rows (axis 0)."""
    return tl.sum(x, axis=0) - tl.cumsum(x, axis=0) + x


@triton.jit
def key_gate_rows(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                   HAS_G: tl.constexpr):
    """B (total per-key log decay: g_cum + gk_cum) of a [rows, BK] tile."""
    gate = load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid)
    if HAS_G:
        gate += load_vec(g_cum, tok0, rows, HV, hv, n_valid)[:, None]
    return gate


@triton.jit
def reference_gate(g_cum, gk_cum, tok0, bi, bj, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                    HAS_G: tl.constexpr):
    """B at the reference row of block pair (I, J): the first row of block I below the diagonal,
    its middle row on it (at most the last valid row: rows past it carry no data)."""
    row = tl.maximum(tl.minimum(tl.where(bi == bj, bi * SUB + SUB // 2, bi * SUB), n_valid - 1), 0)
    ref = load_last_row(gk_cum, tok0 + row, HV, hv, K, cols)
    if HAS_G:
        ref += tl.load(g_cum + (tok0 + row) * HV + hv)
    return ref


# The largest exponent a factor of the gate factorisation may have: below fp32's e^88.7, so that
# no factor is infinite (a kept product of two, e^(B_i - B_j), is <= 1).
MAX_FACTOR_EXPONENT = tl.constexpr(80.0)


@triton.jit
def factors_fit(left_exponent, valid_left, right_exponent, valid_right):
    """Whether the factors e^left_exponent and e^right_exponent ([SUB, BK] tiles) stay below
    e^MAX_FACTOR_EXPONENT on their valid rows."""
    worst_left = tl.max(tl.max(tl.where(valid_left[:, None], left_exponent, float("-inf")), axis=1), axis=0)
    worst_right = tl.max(tl.max(tl.where(valid_right[:, None], right_exponent, float("-inf")), axis=1), axis=0)
    return tl.maximum(worst_left, worst_right) <= MAX_FACTOR_EXPONENT


@triton.jit
def row_of(x, sub, r):
    """Row r of a [SUB, N] tile, as an [N] vector."""
    return tl.sum(tl.where((sub == r)[:, None], x, 0.0), axis=0)


@triton.jit
def column_of(x, sub, c):
    """Column c of an [N, SUB] tile, as an [N] vector."""
    return tl.sum(tl.where((sub == c)[None, :], x, 0.0), axis=1)


@triton.jit
def decay_factor(exponent, valid_rows):
    """e^exponent on valid rows, exactly 0 on rows past the chunk's end."""
    return tl.exp(tl.where(valid_rows[:, None], exponent, float("-inf")))


@triton.jit
def load_square_block(base, tok0, I: tl.constexpr, J: tl.constexpr, HV: tl.constexpr, hv, n_valid):
    sub = tl.arange(0, SUB)
    ptrs, mask = square_ptrs(base, tok0, sub + I * SUB, HV, hv, sub + J * SUB, n_valid)
    return tl.load(ptrs, mask=mask, other=0.0)
