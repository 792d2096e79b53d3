"""The backward's bias and dbias on SM90, read from and written to FA4's score fragments directly.

The backward counterpart of forward_bias.py: FA4's SM90 backward class with its two score hooks'
methods replaced. `apply_score_mod` re-adds the bias to the recomputed scores from each thread's
fragment coordinates (clamped into the problem, like the forward); `apply_score_mod_bwd` writes
dS, the gradient of the scaled score, into dbias at those coordinates, only where they lie inside
the problem: a plain store in the bias's dtype where each entry has one writer ("store"), an fp32
atomic add where batches or query heads share it ("atomic", zeros skipped), nothing without dbias
("none"). The coordinates come from the MMA partition of FA4's score tile, (key, query) when the
backward computes S transposed (SdP_swapAB), so no index needs FA4's GQA decoding (hooks.py's
`_unfold` is for the generic path only).

A bias broadcast along queries ([B|1, H|Hk|1, 1, Sk], "sum_queries") is read once per key of a
thread's fragment before each round (outside FA4's MMA window: read in the score hook, its loads
made ptxas serialise the kernel's MMAs) and added down each key column. Each CTA of FA4's backward
owns one key tile and walks every query tile, so dbias for its keys is summed in registers across
the rounds (each thread its own keys' columns, over its queries inside the problem) and written
once per tile in the epilogue, after a reduction over the four lanes that share a key row of the
transposed score tile: a store where each (batch, head) has its own bias row, fp32 atomics (one
per key and CTA) where it is shared. Needs SdP_swapAB (keys are the rows of the score tile, each
owned by one quad of one warp): head dims 64, 96 and 128 (masked.SUM_QUERIES_HEAD_DIMS).
"""
from __future__ import annotations

import functools
import hashlib

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from flash_attn.cute import utils as fa_utils
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.utils import AuxData
from quack import layout_utils

from . import hooks
from .forward_bias import fa4_class_swapped

with open(__file__, "rb") as _source:
    # with hooks.py's digest: the kernels also trace its pair_pointer
    _SOURCE_DIGEST = hashlib.sha256(_source.read() + hooks.SOURCE_DIGEST.encode()).hexdigest()
SOURCE_DIGEST = _SOURCE_DIGEST  # for the classes built on this one

DBIAS_MODES = ("none", "store", "atomic")


def _bound_keywords(fn) -> dict:
    """The keyword arguments bound into a (nested) functools.partial, at trace time: FA4 binds
    the round's batch, head, key tile and lengths into its score hooks."""
    bound = {}
    while isinstance(fn, functools.partial):
        bound = {**fn.keywords, **bound}
        fn = fn.func
    return bound


@functools.lru_cache(maxsize=None)
def direct_dbias_score_mod_bwd(dbias_slot: int, grouped: bool, mode: str, sum_queries: bool = False):
    """The score_mod_bwd FA4 is given beside a direct bias in the backward (never called: the
    class below replaces the method that would); marked with the dbias slot, grouping and mode,
    and whether the bias is broadcast along queries at a head dim where the scores are
    transposed (masked.SUM_QUERIES_HEAD_DIMS): then it is read per key, and dbias, if any, summed
    over queries."""
    if mode not in DBIAS_MODES:
        raise ValueError(f"mode: expected one of {DBIAS_MODES}, got {mode!r}")

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    score_mod_bwd.direct_dbias = (dbias_slot, grouped, mode, sum_queries)
    score_mod_bwd.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:direct-dbias:{dbias_slot}:{grouped}:{mode}:{sum_queries}".encode()).hexdigest()
    return score_mod_bwd


class DirectBiasBackwardSm90(FlashAttentionBackwardSm90):
    """FA4's SM90 backward with the bias and dbias at the score fragments' own coordinates."""

    @cute.jit
    def _score_coords(self, thr_mma_SdP, m_block, n_block):
        """The score fragment's coordinates, (key, query) under SdP_swapAB, else (query, key)."""
        if const_expr(self.SdP_swapAB):
            coords = cute.make_identity_tensor((self.tile_n, self.tile_m))
            coords = cute.domain_offset((n_block * self.tile_n, m_block * self.tile_m), coords)
        else:
            coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
            coords = cute.domain_offset((m_block * self.tile_m, n_block * self.tile_n), coords)
        return thr_mma_SdP.partition_C(coords)

    def _query_key(self, coord):
        if const_expr(self.SdP_swapAB):
            return coord[1], coord[0]
        return coord[0], coord[1]

    def _sums_queries(self):
        spec = getattr(self.score_mod_bwd, "direct_dbias", None)
        return spec is not None and spec[2] != "none" and spec[3]

    def _reads_key_bias(self):
        """The bias is read per key, before each round (a bias broadcast along queries)."""
        spec = getattr(self.score_mod_bwd, "direct_dbias", None)
        return spec is not None and spec[3] and getattr(self.score_mod, "direct_bias", None) is not None

    @cute.jit
    def mma(self, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, mdK, mdV,
            mdK_semaphore, mdV_semaphore, mdQaccum, sQ, sK, sV, sdO, sP, sdS, sLSE, sdPsum,
            sdQaccum, pipeline_Q, pipeline_dO, tidx, tma_atom_dK, tma_atom_dV,
            r2s_tiled_copy_dQaccum, softmax_scale_log2, softmax_scale, block_info, SeqlenInfoCls,
            AttentionMaskCls, TileSchedulerCls, aux_data=AuxData(), fastdiv_mods=(None, None),
            blocksparse_tensors=None, qhead_per_kvhead_divmod=None, is_dQ_wg=True):
        self._mma_setup(tiled_mma_SdP, sdS, pipeline_dO, tidx, block_info, aux_data)
        FlashAttentionBackwardSm90.mma(
            self, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, mdK, mdV,
            mdK_semaphore, mdV_semaphore, mdQaccum, sQ, sK, sV, sdO, sP, sdS, sLSE, sdPsum,
            sdQaccum, pipeline_Q, pipeline_dO, tidx, tma_atom_dK, tma_atom_dV,
            r2s_tiled_copy_dQaccum, softmax_scale_log2, softmax_scale, block_info, SeqlenInfoCls,
            AttentionMaskCls, TileSchedulerCls, aux_data, fastdiv_mods, blocksparse_tensors,
            qhead_per_kvhead_divmod, is_dQ_wg=is_dQ_wg)

    @cute.jit
    def _mma_setup(self, tiled_mma_SdP, sdS, pipeline_dO, tidx, block_info, aux_data):
        """What the consumer warpgroups set up before FA4's round loop (subclasses add theirs)."""
        if const_expr(self._sums_queries() or self._reads_key_bias()):
            self._score_thr_mma = tiled_mma_SdP.get_slice(tidx)
            self._aux_tensors = aux_data.tensors
            columns = cute.size(self._key_columns(0), mode=[1])
        if const_expr(self._sums_queries()):
            # the dbias of this thread's keys (SdP_swapAB: masked.SUM_QUERIES_HEAD_DIMS), summed
            # over every round of a tile in registers that live across FA4's round loop; columns
            # of the (query, key) view of its score fragment
            self._key_sums = cute.make_rmem_tensor(columns, Float32)
            self._key_sums.fill(0.0)
        if const_expr(self._reads_key_bias()):
            # the bias of those keys, for the round about to run
            self._key_bias = cute.make_rmem_tensor(columns, Float32)

    @cute.jit
    def mma_one_m_block(self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx,
                        mma_qk_fn, mma_dov_fn, mma_pdo_fn, mma_dsq_fn, mma_dsk_fn, copy_P_r2s,
                        copy_dS_r2s, pipeline_Q, pipeline_dO, tLSEsLSE, tLSEsdPsum, tdQsdQaccum,
                        softmax_scale_log2, PdS_barrier, is_dQ_wg=True, mask_fn=None,
                        score_mod_fn=None, score_mod_bwd_fn=None, dKV_accumulate=True):
        """FA4's round, after what this class and its subclasses do before it (_prepare_round)
        and with their wrapper around the round's dQ GEMM (_wrap_dq_gemm)."""
        self._prepare_round(m_block, consumer_state_Q, _bound_keywords(score_mod_fn))
        return FlashAttentionBackwardSm90.mma_one_m_block(
            self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx, mma_qk_fn,
            mma_dov_fn, mma_pdo_fn, mma_dsq_fn, self._wrap_dq_gemm(mma_dsk_fn, m_block, is_dQ_wg),
            copy_P_r2s, copy_dS_r2s, pipeline_Q, pipeline_dO, tLSEsLSE, tLSEsdPsum, tdQsdQaccum,
            softmax_scale_log2, PdS_barrier, is_dQ_wg=is_dQ_wg, mask_fn=mask_fn,
            score_mod_fn=score_mod_fn, score_mod_bwd_fn=score_mod_bwd_fn,
            dKV_accumulate=dKV_accumulate)

    @cute.jit
    def _prepare_round(self, m_block, consumer_state_Q, bound):
        """Before FA4's round; bound: the batch, head, key tile and lengths FA4 binds into its
        score hooks."""
        if const_expr(self._reads_key_bias()):
            # a bias broadcast along queries, read here, before the round's score and dP MMAs
            # are issued: read in the score hook (per element, or per key), its loads' address
            # arithmetic left ptxas short of registers for the MMAs in flight there, and it
            # serialised every warpgroup MMA of the kernel (C7512)
            bias_slot, grouped = self.score_mod.direct_bias[:2]
            bias = self._aux_tensors[bias_slot]
            last_k = bound["seqlen_info"].seqlen_k - 1
            keys = self._key_columns(bound["n_block"])
            for c in cutlass.range_constexpr(cute.size(self._key_bias.shape)):
                _, k = self._query_key(keys[0, c])
                # clamped into the problem (lanes past it are masked after the score hook)
                at = hooks.pair_pointer(bias, grouped, bound["batch_idx"], bound["head_idx"], 0,
                                        cutlass.max(cutlass.min(k, last_k), 0))
                self._key_bias[c] = cute.make_tensor(at, cute.make_layout(1)).load().to(Float32)[0]

    def _wrap_dq_gemm(self, mma_dsk_fn, m_block, is_dQ_wg):
        """The round's dQ GEMM as FA4 is to call it (trace time; subclasses put work before it)."""
        return mma_dsk_fn

    @cute.jit
    def _key_columns(self, n_block):
        """The coordinates of this thread's score fragment of key tile n_block, as (query, key)
        rows and columns (query tile 0: only the keys are read)."""
        return layout_utils.reshape_acc_to_mn(self._score_coords(self._score_thr_mma, 0, n_block),
                                              transpose=self.SdP_swapAB)

    @cute.jit
    def epilogue_dKV(self, acc_dV, mdV, sV, acc_dK, mdK, sK, seqlen, tma_atom_dK, tma_atom_dV,
                     tiled_mma_dK, tiled_mma_dV, tidx, n_block, head_idx, batch_idx,
                     qhead_per_kvhead_divmod=None, mdK_semaphore=None, mdV_semaphore=None):
        if const_expr(self._sums_queries()):
            self._write_key_sums(seqlen, n_block, head_idx, batch_idx)
        FlashAttentionBackwardSm90.epilogue_dKV(
            self, acc_dV, mdV, sV, acc_dK, mdK, sK, seqlen, tma_atom_dK, tma_atom_dV,
            tiled_mma_dK, tiled_mma_dV, tidx, n_block, head_idx, batch_idx,
            qhead_per_kvhead_divmod, mdK_semaphore, mdV_semaphore)

    @cute.jit
    def _write_key_sums(self, seqlen, n_block, head_idx, batch_idx):
        """The tile's per-key dbias: the four lanes sharing a key row add their sums, the first
        writes it; the sums restart for the next tile."""
        dbias_slot, grouped, mode, _ = self.score_mod_bwd.direct_dbias
        dbias = self._aux_tensors[dbias_slot]
        coords = self._key_columns(n_block)
        first_of_quad = cute.arch.lane_idx() % 4 == 0
        for c in cutlass.range_constexpr(cute.size(self._key_sums.shape)):
            total = self._key_sums[c]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            _, k = self._query_key(coords[0, c])
            if first_of_quad & (k < seqlen.seqlen_k):
                at = hooks.pair_pointer(dbias, grouped, batch_idx, head_idx, 0, k)
                if const_expr(mode == "atomic"):
                    fa_utils.atomic_add_fp32(total, at)
                else:
                    cell = cute.make_rmem_tensor(1, Float32)
                    cell[0] = total
                    cute.make_tensor(at, cute.make_layout(1)).store(cell.load().to(dbias.element_type))
            self._key_sums[c] = Float32(0.0)

    @cute.jit
    def apply_score_mod(self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block,
                        softmax_scale, seqlen_info, aux_data: AuxData = AuxData(),
                        fastdiv_mods=(None, None)):
        if const_expr(getattr(self.score_mod, "direct_bias", None) is None):
            FlashAttentionBackwardSm90.apply_score_mod(
                self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block, softmax_scale,
                seqlen_info, aux_data, fastdiv_mods)
        elif const_expr(self._reads_key_bias()):
            # a bias broadcast along queries: this round's key values, loaded before the round
            # (mma_one_m_block), added down each key column of the fragment
            scores = layout_utils.reshape_acc_to_mn(acc_S, transpose=self.SdP_swapAB)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
                    scores[r, c] = scores[r, c] * softmax_scale + self._key_bias[c]
        else:
            bias_slot, grouped = self.score_mod.direct_bias[:2]
            bias = aux_data.tensors[bias_slot]
            coords = self._score_coords(thr_mma_SdP, m_block, n_block)
            last_q = seqlen_info.seqlen_q - 1
            last_k = seqlen_info.seqlen_k - 1
            for i in cutlass.range_constexpr(cute.size(acc_S.shape)):
                q, k = self._query_key(coords[i])
                # clamped into the problem at both ends (a tile may start before key 0, as in
                # the forward); such lanes are masked after this step
                at = hooks.pair_pointer(bias, grouped, batch_idx, head_idx,
                                        cutlass.max(cutlass.min(q, last_q), 0),
                                        cutlass.max(cutlass.min(k, last_k), 0))
                value = cute.make_tensor(at, cute.make_layout(1)).load().to(Float32)
                acc_S[i] = acc_S[i] * softmax_scale + value[0]

    @cute.jit
    def apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx,
                            m_block, n_block, softmax_scale, seqlen_info,
                            aux_data: AuxData = AuxData(), fastdiv_mods=(None, None)):
        if const_expr(getattr(self.score_mod_bwd, "direct_dbias", None) is None):
            FlashAttentionBackwardSm90.apply_score_mod_bwd(
                self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx, m_block,
                n_block, softmax_scale, seqlen_info, aux_data, fastdiv_mods)
        else:
            dbias_slot, grouped, mode, sum_queries = self.score_mod_bwd.direct_dbias
            if const_expr(mode != "none" and sum_queries):
                # the share of this round in the per-key sums (queries inside the problem only)
                grads = layout_utils.reshape_acc_to_mn(grad_tensor, transpose=self.SdP_swapAB)
                coords = layout_utils.reshape_acc_to_mn(
                    self._score_coords(thr_mma_SdP, m_block, n_block), transpose=self.SdP_swapAB)
                for c in cutlass.range_constexpr(cute.size(grads, mode=[1])):
                    column = Float32(0.0)
                    for r in cutlass.range_constexpr(cute.size(grads, mode=[0])):
                        q, _ = self._query_key(coords[r, c])
                        column += cutlass.select_(q < seqlen_info.seqlen_q, grads[r, c], Float32(0.0))
                    self._key_sums[c] += column
            elif const_expr(mode != "none"):
                dbias = aux_data.tensors[dbias_slot]
                coords = self._score_coords(thr_mma_SdP, m_block, n_block)
                for i in cutlass.range_constexpr(cute.size(grad_tensor.shape)):
                    q, k = self._query_key(coords[i])
                    if (q >= 0) & (k >= 0) & (q < seqlen_info.seqlen_q) & (k < seqlen_info.seqlen_k):
                        at = hooks.pair_pointer(dbias, grouped, batch_idx, head_idx, q, k)
                        g = grad_tensor[i]
                        if const_expr(mode == "atomic"):
                            if g != Float32(0.0):
                                fa_utils.atomic_add_fp32(g, at)
                        else:
                            cell = cute.make_rmem_tensor(1, Float32)
                            cell[0] = g
                            cute.make_tensor(at, cute.make_layout(1)).store(cell.load().to(dbias.element_type))


# The overrides take FA4's arguments as they are: the same annotations (the DSL reads them).
for _name in ("mma", "epilogue_dKV", "mma_one_m_block"):
    getattr(DirectBiasBackwardSm90, _name).__wrapped__.__annotations__ = dict(
        getattr(FlashAttentionBackwardSm90, _name).__wrapped__.__annotations__)


def direct_bias_backward_kernel():
    """The swap for a direct-bias backward."""
    return fa4_class_swapped("FlashAttentionBackwardSm90", DirectBiasBackwardSm90)


__all__ = ["direct_dbias_score_mod_bwd", "DirectBiasBackwardSm90", "direct_bias_backward_kernel"]
