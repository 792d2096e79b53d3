"""The forward's bias on SM90, read straight into FA4's score fragment.

FA4's generic score_mod path (hooks.py) costs, per score element, two fast divisions (it wraps
the indices modulo the lengths), one call of the hook with its own index arithmetic over runtime
strides, and a 2-byte load: the bias forward ran well behind the Triton backend's. Here the
forward kernel is FA4's SM90 class with one method replaced, `apply_score_mod`: each thread walks
its own fragment of the score tile, whose (query, key) coordinates are fixed by the MMA layout,
clamps them into the problem (lanes past the lengths are masked after this step, so any real
entry serves them) and adds bias[b, h, q, k] read from the aux view (hooks.py's layout: 4-d, or
5-d grouped per kv head), whose key stride is declared 1 (`mark_keys_contiguous`) so the key
offset is a plain add. Two neighbouring keys come as one load where the layout keeps every pair
aligned (decided in the kernel), and each tile prefetches the next key tile's bias lines.
Everything else (pipelines, softmax, masks, tile lists) is FA4's.

The class is swapped in only while our bias forward calls FA4 (`direct_bias_kernel`), under a
lock; the score_mod it carries is marked (`direct_bias_score_mod`), so FA4's compile cache keys
this kernel apart from the generic hook's.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from flash_attn.cute import interface as fa_interface
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.utils import AuxData

from . import hooks

with open(__file__, "rb") as _source:
    # with hooks.py's digest: the kernels also trace its pair_pointer
    _SOURCE_DIGEST = hashlib.sha256(_source.read() + hooks.SOURCE_DIGEST.encode()).hexdigest()
SOURCE_DIGEST = _SOURCE_DIGEST  # for the classes built on this one


# "registers": the next key tile's bias read into registers at the end of this tile's bias step
# (with paired loads only), its latency hidden behind that tile's QK^T; the cache levels issue
# prefetch.global for its lines instead.
PREFETCH_LEVELS = ("none", "L2", "L1", "registers")


@dsl_user_op
def _prefetch_line(pointer: cute.Pointer, level: cutlass.Constexpr, *, loc=None, ip=None) -> None:
    """prefetch.global.<level>: the cache line holding pointer, no register written."""
    llvm.inline_asm(None, [pointer.toint(loc=loc, ip=ip).ir_value()], f"prefetch.global.{level} [$0];",
                    "l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@functools.lru_cache(maxsize=None)
def direct_bias_score_mod(bias_slot: int, grouped: bool, prefetch: str = "L2", pairs: bool = False,
                          bias_dtype: str = "BFloat16"):
    """The score_mod FA4 is given for a direct-bias forward. FA4 never calls it (the class below
    replaces the method that would); FA4 reads from it that a score_mod exists (so the scale is
    applied before it and the softmax takes log2(e) alone) and keys its compile cache on its
    __cute_hash__. The bias slot, grouping, prefetch level (PREFETCH_LEVELS), whether paired
    loads are compiled in and the bias's element type (a cutlass type name: the register
    prefetch holds raw values) travel as an attribute for the kernel's trace."""
    fn = hooks.bias_score_mod(bias_slot, grouped, 1)

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return fn(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors)

    if prefetch not in PREFETCH_LEVELS:
        raise ValueError(f"prefetch: expected one of {PREFETCH_LEVELS}, got {prefetch!r}")
    score_mod.direct_bias = (bias_slot, grouped, prefetch, pairs, getattr(cutlass, bias_dtype))
    score_mod.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:direct:{bias_slot}:{grouped}:{prefetch}:{pairs}:{bias_dtype}".encode()).hexdigest()
    return score_mod


def mark_keys_contiguous(view):
    """Declare the aux view's key dim stride 1 to FA4's aux conversion (its __leading_dim__):
    only where it is, which `keys_contiguous` tells."""
    view.__leading_dim__ = view.dim() - 1
    return view


def keys_contiguous(view) -> bool:
    return view.stride(-1) == 1 and view.shape[-1] > 1


class DirectBiasForwardSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward with the bias added from the score fragment's own coordinates."""

    @cute.jit
    def apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                        softmax_scale, seqlen, aux_data: AuxData = AuxData(), fastdiv_mods=None):
        if const_expr(getattr(self.score_mod, "direct_bias", None) is None):
            # a score_mod of someone else's (another thread's FA4 call during the swap)
            FlashAttentionForwardSm90.apply_score_mod(
                self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                seqlen, aux_data, fastdiv_mods)
        else:
            self._add_bias(thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                           softmax_scale, seqlen, aux_data)

    @cute.jit
    def mma_init(self):
        FlashAttentionForwardSm90.mma_init(self)
        direct = getattr(self.score_mod, "direct_bias", None)
        if const_expr(direct is not None and direct[2] == "registers" and direct[3]):
            # before the tile loops, so the buffer lives across their iterations: each thread's
            # share of one score tile, and which (key tile, query tile, head, batch) it holds
            per_thread = self.tile_m * self.tile_n // (self.num_wg_mma * self.num_threads_per_warp_group)
            self._next_bias = cute.make_rmem_tensor(per_thread, direct[4])
            self._next_bias_tile = cute.make_rmem_tensor(4, cutlass.Int32)
            self._next_bias_tile.fill(-1)

    @cute.jit
    def _add_bias(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                  seqlen, aux_data: AuxData):
        bias_slot, grouped, prefetch, pairs, _ = self.score_mod.direct_bias
        bias = aux_data.tensors[bias_slot]
        coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
        coords = cute.domain_offset((m_block * self.tile_m, n_block * self.tile_n), coords)
        frag_coords = thr_mma_qk.partition_C(coords)
        last_q = seqlen.seqlen_q - 1
        last_k = seqlen.seqlen_k - 1
        if const_expr(pairs):
            # Neighbouring keys as one load where every pair is aligned: an even key count (a
            # pair never passes the end), even strides and an aligned start. Known only at run
            # time (the strides and lengths are runtime values), so both loops are compiled and
            # one runs: a new length never compiles anything.
            even = seqlen.seqlen_k % 2 == 0
            for d in cutlass.range_constexpr(cute.rank(bias.layout) - 1):
                stride = bias.stride[d]
                if const_expr(isinstance(stride, int)):
                    # static strides here are the broadcast dims' 0 (masked._pair_view)
                    if const_expr(stride != 0):
                        raise ValueError(f"bias view dim {d}: static stride {stride}, expected 0")
                else:
                    even = even & (stride % 2 == 0)
            alignment = 2 * bias.element_type.width // 8
            even = even & (bias.iterator.toint() % alignment == 0)
            if even:
                if const_expr(prefetch == "registers"):
                    self._add_bias_from_registers(bias, grouped, frag_coords, acc_S, batch_idx,
                                                  head_idx, m_block, n_block, softmax_scale,
                                                  last_q, last_k)
                else:
                    self._add_bias_elements(bias, grouped, 2, frag_coords, acc_S, batch_idx,
                                            head_idx, softmax_scale, last_q, last_k)
            else:
                self._add_bias_elements(bias, grouped, 1, frag_coords, acc_S, batch_idx, head_idx,
                                        softmax_scale, last_q, last_k)
        else:
            self._add_bias_elements(bias, grouped, 1, frag_coords, acc_S, batch_idx, head_idx,
                                    softmax_scale, last_q, last_k)
        if const_expr(prefetch in ("L2", "L1")):
            # The next tile's bias lines (FA4 walks key tiles downwards), so that its loads find
            # them in cache instead of waiting on DRAM after that tile's QK^T. A few fragment
            # elements per thread: the first, middle and last columns of both of its rows (in
            # the MMA accumulator layout), enough to touch every line of the tile's rows.
            n = cute.size(acc_S.shape)
            for i in cutlass.range_constexpr(6):
                j = (0, 2, n // 2, n // 2 + 2, n - 4, n - 2)[i]
                k = cutlass.max(cutlass.min(frag_coords[j][1] - self.tile_n, last_k), 0)
                _prefetch_line(self._bias_at(bias, grouped, batch_idx, head_idx, frag_coords[j][0],
                                             k, last_q), prefetch)

    @cute.jit
    def _add_bias_from_registers(self, bias, grouped: cutlass.Constexpr, frag_coords, acc_S,
                                 batch_idx, head_idx, m_block, n_block, softmax_scale, last_q,
                                 last_k):
        """Paired loads, this tile's values taken from the registers the previous bias step
        filled when it was this tile's turn (FA4 walks key tiles downwards by one), else read
        now; then the next key tile's values read into those registers."""
        tile = self._next_bias_tile
        held = ((tile[0] == n_block) & (tile[1] == m_block) & (tile[2] == head_idx)
                & (tile[3] == batch_idx))
        n = cute.size(acc_S.shape)
        if held:
            values = self._next_bias.load().to(Float32)
            for i in cutlass.range_constexpr(n):
                acc_S[i] = acc_S[i] * softmax_scale + values[i]
        else:
            self._add_bias_elements(bias, grouped, 2, frag_coords, acc_S, batch_idx, head_idx,
                                    softmax_scale, last_q, last_k)
        for i in cutlass.range_constexpr(0, n, 2):
            k = cutlass.max(cutlass.min(frag_coords[i][1] - self.tile_n, last_k - 1), 0)
            values = self._pair_at(bias, grouped, batch_idx, head_idx, frag_coords[i][0], k, last_q,
                                   raw=True)
            self._next_bias[i] = values[0]
            self._next_bias[i + 1] = values[1]
        tile[0] = n_block - 1
        tile[1] = m_block
        tile[2] = head_idx
        tile[3] = batch_idx

    @cute.jit
    def _pair_at(self, bias, grouped: cutlass.Constexpr, batch_idx, head_idx, row, k, last_q,
                 raw: cutlass.Constexpr = False):
        """The two neighbouring bias values at (row, k), k even (one aligned load), as fp32 (in
        the bias's own type with raw)."""
        at = self._bias_at(bias, grouped, batch_idx, head_idx, row, k, last_q)
        aligned = cute.make_ptr(bias.element_type, at.toint(), cute.AddressSpace.gmem,
                                assumed_align=2 * bias.element_type.width // 8)
        values = cute.make_tensor(aligned, cute.make_layout(2)).load()
        if const_expr(raw):
            return values
        return values.to(Float32)

    @cute.jit
    def _bias_at(self, bias, grouped: cutlass.Constexpr, batch_idx, head_idx, row, k, last_q):
        """The bias element's address for fragment row `row` (the query row clamped into the
        problem) and key k."""
        head = head_idx
        if const_expr(self.pack_gqa):
            # packed rows: query (row // G) of query head head_idx * G + row % G
            group = self.qhead_per_kvhead
            head = head_idx * group + row % group
            row = row // group
        return hooks.pair_pointer(bias, grouped, batch_idx, head, cutlass.min(row, last_q), k)

    @cute.jit
    def _add_bias_elements(self, bias, grouped: cutlass.Constexpr, step: cutlass.Constexpr,
                           frag_coords, acc_S, batch_idx, head_idx, softmax_scale, last_q, last_k):
        """acc_S = acc_S * scale + bias at each element's clamped (q, k); step 2: elements i and
        i + 1 of the accumulator fragment are neighbouring keys of one row (the SM90 MMA
        layout), read as one aligned load (the caller checked the alignment)."""
        for i in cutlass.range_constexpr(0, cute.size(acc_S.shape), step):
            # keys below 0 too: under causal with Sq > Sk FA4 runs a key tile at n_block = -1
            # for query tiles that see no key (its loads are zero-filled there)
            k = cutlass.max(cutlass.min(frag_coords[i][1], last_k + 1 - step), 0)
            if const_expr(step == 2):
                values = self._pair_at(bias, grouped, batch_idx, head_idx, frag_coords[i][0], k,
                                       last_q)
                acc_S[i] = acc_S[i] * softmax_scale + values[0]
                acc_S[i + 1] = acc_S[i + 1] * softmax_scale + values[1]
            else:
                at = self._bias_at(bias, grouped, batch_idx, head_idx, frag_coords[i][0], k, last_q)
                value = cute.make_tensor(at, cute.make_layout(1)).load().to(Float32)
                acc_S[i] = acc_S[i] * softmax_scale + value[0]


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def fa4_class_swapped(name: str, replacement):
    """FA4's interface builds `replacement` instead of its class `name` while this is open (it
    looks its kernel classes up by name at each call). The lock serialises our own swaps;
    another thread's FA4 call meeting a swap gets FA4's own methods (our classes defer to them
    for any hook not marked as ours)."""
    with _SWAP_LOCK:
        original = getattr(fa_interface, name)
        setattr(fa_interface, name, replacement)
        try:
            yield
        finally:
            setattr(fa_interface, name, original)


def direct_bias_kernel():
    """The swap for a direct-bias forward."""
    return fa4_class_swapped("FlashAttentionForwardSm90", DirectBiasForwardSm90)


__all__ = ["direct_bias_score_mod", "DirectBiasForwardSm90", "direct_bias_kernel", "fa4_class_swapped",
           "mark_keys_contiguous", "keys_contiguous"]
