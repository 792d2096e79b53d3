"""The @cute.jit callables that FA4's SM90 kernels call per score element: our bias (score_mod),
its gradient (score_mod_bwd) and our keep-mask with bottom-right causal (mask_mod).

FA4 keys its compile cache on a callable's hash (its source and captured values, or a
__cute_hash__ attribute), so every callable here comes from a factory memoised on a few ints and
flags, and carries a __cute_hash__ of this file's text and those arguments: one function object,
and one compilation, per feature set, and an edit to any helper here changes every key (FA4's
optional on-disk cache can then not serve a stale kernel). None captures a tensor; the tensors arrive
each call as FA4's aux tensors, whose sizes and non-zero strides are runtime values, so a new
length compiles nothing.

The aux tensors (masked.py builds them) are views of the user's mask and bias in the problem's
full [B, H, Sq, Sk] shape, each broadcast dim given stride 0:
- 4-d [B, H, Sq, Sk] when the tensor's head dim is H or 1 (1 becomes stride 0);
- 5-d [B, Hk, G, Sq, Sk] with stride 0 along G when it holds one head per kv head (GQA): query
  head h reads head h // G, G being the view's (runtime) size along dim 2.
The dbias buffer has the same layout as the bias it belongs to.

Vector width: with aux tensors FA4 calls score_mod and score_mod_bwd one element at a time
(vec_size 1, unless a callable sets __vec_size__, which none here does) and mask_mod always so;
the hooks read element [0] of each index vector accordingly.

Index ranges: FA4 wraps q and kv indices modulo the lengths before a score_mod and before a
mask_mod on blocks that it masks for length, but a mask_mod on an interior key block also sees
query rows past Sq (the last query tile's padding rows): the mask's index is clamped there.

GQA in FA4 4.0.0b36's SM90 backward (`fold`): its apply_score_mod / apply_score_mod_bwd
(flash_bwd_sm90.py) pass `qhead_per_kvhead=self.qhead_per_kvhead` to softmax.py's
apply_score_mod_inner / apply_score_mod_bwd_inner, which then decode the index as if the backward
packed GQA heads into rows (it does not: interface.py forces pack_gqa=False for the backward, and
its head_idx is already the query head). A score_mod there sees head h*G + q % G and query
(q // G) mod Sq instead of (h, q); the mask_mod path (mask.py, qhead_per_kvhead_packgqa=1) and the
forward (which passes G only with pack_gqa) are right. With fold = G the bias hooks undo that:
h = h' // G, q = q' * G + h' % G, exact for every real row (q < Sq implies q // G < Sq), clamped
to Sq - 1 for the last tile's padding rows (whose dS is 0).
"""
from __future__ import annotations

import functools
import hashlib

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flash_attn.cute import utils as fa_utils


with open(__file__, "rb") as _source:
    SOURCE_DIGEST = hashlib.sha256(_source.read()).hexdigest()


def _keyed(fn, *args):
    """fn with the compile-cache key of this file's text, the factory and its arguments."""
    fn.__cute_hash__ = hashlib.sha256(f"{SOURCE_DIGEST}:{fn.__name__}:{args!r}".encode()).hexdigest()
    return fn


def _pair_element(t, grouped: cutlass.Constexpr, b, h, q, kv):
    """The element of a 4-d (h read directly) or 5-d grouped (h // G) aux view."""
    if cutlass.const_expr(grouped):
        return t[b, h // t.shape[2], 0, q, kv]
    return t[b, h, q, kv]


def _unfold(h, q, fold: cutlass.Constexpr, seqlen_info):
    """(head, query) from the indices FA4 b36's SM90 backward hands a score_mod under GQA (see
    the module notes); unchanged for fold 1."""
    if cutlass.const_expr(fold > 1):
        q_real = cutlass.min(q * fold + h % fold, seqlen_info.seqlen_q - 1)
        return h // fold, q_real
    return h, q


def pair_pointer(t, grouped: cutlass.Constexpr, b, h, q, kv):
    """The address of element (b, h, q, kv) of a 4-d or 5-d grouped (h // G) aux view."""
    if cutlass.const_expr(grouped):
        return fa_utils.elem_pointer(t, (b, h // t.shape[2], 0, q, kv))
    return fa_utils.elem_pointer(t, (b, h, q, kv))


@functools.lru_cache(maxsize=None)
def bias_score_mod(bias_slot: int, grouped: bool, fold: int):
    """score -> score + bias[b, h, q, kv] (FA4 hands the already scaled score). fold: 1 in the
    forward, the GQA group size in the backward where FA4 mis-packs the indices (_unfold)."""

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        bias = aux_tensors[bias_slot]
        head, q = _unfold(h[0], q_idx[0], fold, seqlen_info)
        value = cute.make_rmem_tensor(1, bias.element_type)
        value[0] = _pair_element(bias, grouped, b[0], head, q, kv_idx[0])
        return score + value.load().to(Float32)

    return _keyed(score_mod, bias_slot, grouped, fold)


@functools.lru_cache(maxsize=None)
def bias_score_mod_bwd(dbias_slot: int, grouped: bool, atomic: bool, fold: int):
    """dS passes through unchanged (d(score + bias)/d score = 1) and is dbias: stored in the
    bias's dtype where every entry has one writer, else added into an fp32 buffer.

    Only non-zero dS is written: FA4 also calls this for lanes past the lengths, with indices
    wrapped onto real entries and dS exactly 0 there (their scores are masked), and the buffer
    starts zeroed, so skipping zeros loses nothing and never overwrites a real entry.
    fold: as bias_score_mod's (the GQA group size under FA4 b36's SM90 backward)."""

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        dbias = aux_tensors[dbias_slot]
        g = grad[0]
        if g != Float32(0.0):
            head, q = _unfold(h[0], q_idx[0], fold, seqlen_info)
            if cutlass.const_expr(atomic):
                fa_utils.atomic_add_fp32(
                    g, pair_pointer(dbias, grouped, b[0], head, q, kv_idx[0]))
            else:
                cell = cute.make_rmem_tensor(1, Float32)
                cell[0] = g
                stored = cell.load().to(dbias.element_type)
                if cutlass.const_expr(grouped):
                    dbias[b[0], head // dbias.shape[2], 0, q, kv_idx[0]] = stored[0]
                else:
                    dbias[b[0], head, q, kv_idx[0]] = stored[0]
        return grad

    return _keyed(score_mod_bwd, dbias_slot, grouped, atomic, fold)


@functools.lru_cache(maxsize=None)
def passthrough_score_mod_bwd():
    """The backward of the bias when no dbias is wanted: FA4 needs one beside a score_mod."""

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return _keyed(score_mod_bwd, "passthrough")


@functools.lru_cache(maxsize=None)
def keep_mask_mod(mask_slot: int, grouped: bool, causal: bool):
    """True where the keep-mask (uint8 view of the bool mask) keeps (q, kv) and, with causal, the
    key is visible: kv <= q + Sk - Sq (FA4 runs with causal off once a mask_mod is given)."""

    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        keep = aux_tensors[mask_slot]
        q = q_idx[0]
        kv = kv_idx[0]
        q_read = cutlass.min(q, seqlen_info.seqlen_q - 1)
        kv_read = cutlass.min(kv, seqlen_info.seqlen_k - 1)
        cell = cute.make_rmem_tensor(1, keep.element_type)
        cell[0] = _pair_element(keep, grouped, b[0], h[0], q_read, kv_read)
        kept = cell.load() != cutlass.Uint8(0)
        if cutlass.const_expr(causal):
            visible = kv_idx <= q_idx + (seqlen_info.seqlen_k - seqlen_info.seqlen_q)
            kept = kept & visible
        return kept

    return _keyed(mask_mod, mask_slot, grouped, causal)


__all__ = ["bias_score_mod", "bias_score_mod_bwd", "passthrough_score_mod_bwd", "keep_mask_mod"]
