"""The forward's bias on SM90, read straight into FA4's score fragment.

FA4's generic score_mod path (hooks.py) costs, per score element, two fast divisions (it wraps
the indices modulo the lengths), one call of the hook with its own index arithmetic over runtime
strides, and a 2-byte load: the bias forward ran well behind the Triton backend's. Here the
forward kernel is FA4's SM90 class with one method replaced, `apply_score_mod`: each thread walks
its own fragment of the score tile, whose (query, key) coordinates are fixed by the MMA layout,
clamps them into the problem (lanes past the lengths are masked after this step, so any real
entry serves them) and adds bias[b, h, q, k] read from the aux view (hooks.py's layout: 4-d, or
5-d grouped per kv head), whose key stride is declared 1 (`mark_keys_contiguous`) so the key
offset is a plain add. Everything else (pipelines, softmax, masks, tile lists) is FA4's.

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

from flash_attn.cute import interface as fa_interface
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.utils import AuxData

from . import hooks

with open(__file__, "rb") as _source:
    _SOURCE_DIGEST = hashlib.sha256(_source.read()).hexdigest()


@functools.lru_cache(maxsize=None)
def direct_bias_score_mod(bias_slot: int, grouped: bool):
    """The score_mod FA4 is given for a direct-bias forward. FA4 never calls it (the class below
    replaces the method that would); FA4 reads from it that a score_mod exists (so the scale is
    applied before it and the softmax takes log2(e) alone) and keys its compile cache on its
    __cute_hash__. The bias slot and grouping travel as attributes for the kernel's trace."""
    fn = hooks.bias_score_mod(bias_slot, grouped, 1)

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return fn(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors)

    score_mod.direct_bias = (bias_slot, grouped)
    score_mod.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:direct:{bias_slot}:{grouped}".encode()).hexdigest()
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
    def _add_bias(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                  seqlen, aux_data: AuxData):
        bias_slot, grouped = self.score_mod.direct_bias
        bias = aux_data.tensors[bias_slot]
        coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
        coords = cute.domain_offset((m_block * self.tile_m, n_block * self.tile_n), coords)
        frag_coords = thr_mma_qk.partition_C(coords)
        last_q = seqlen.seqlen_q - 1
        last_k = seqlen.seqlen_k - 1
        group = self.qhead_per_kvhead
        for i in cutlass.range(cute.size(acc_S.shape), unroll_full=True):
            row = frag_coords[i][0]
            head = head_idx
            if const_expr(self.pack_gqa):
                # packed rows: query (row // G) of query head head_idx * G + row % G
                head = head_idx * group + row % group
                row = row // group
            q = cutlass.min(row, last_q)
            k = cutlass.min(frag_coords[i][1], last_k)
            cell = cute.make_rmem_tensor(1, bias.element_type)
            if const_expr(grouped):
                cell[0] = bias[batch_idx, head // bias.shape[2], 0, q, k]
            else:
                cell[0] = bias[batch_idx, head, q, k]
            acc_S[i] = acc_S[i] * softmax_scale + cell.load().to(Float32)[0]


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def direct_bias_kernel():
    """FA4's interface builds DirectBiasForwardSm90 instead of its own SM90 forward class while
    this is open (it looks the class up by name at each call). The lock serialises our own swaps;
    another thread's FA4 call meeting the swap gets FA4's own method (the class defers to it for
    any score_mod not marked here)."""
    with _SWAP_LOCK:
        original = fa_interface.FlashAttentionForwardSm90
        fa_interface.FlashAttentionForwardSm90 = DirectBiasForwardSm90
        try:
            yield
        finally:
            fa_interface.FlashAttentionForwardSm90 = original


__all__ = ["direct_bias_score_mod", "DirectBiasForwardSm90", "direct_bias_kernel",
           "mark_keys_contiguous", "keys_contiguous"]
