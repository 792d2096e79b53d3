"""The backward's dbias on SM90 stored by TMA from the dS tile FA4 already keeps in shared memory.

backward_bias.py writes dbias from each thread's dS fragment, 2 bytes per store; with FA4's
SdP_swapAB (the scores computed transposed) a thread's neighbouring elements are neighbouring
queries, so every store lands in another row. But FA4's SM90 backward writes each round's dS
tile into shared memory anyway (sdS, in q's dtype, queries x keys with keys contiguous, for the
dQ and dK GEMMs), and with one dbias writer per entry that tile is exactly dbias (the gradient of
the scaled score plus bias, not multiplied by the softmax scale). So after FA4's own fence and
barrier that publish sdS to the async proxy, the first consumer warp stores the tile to dbias
with one TMA store; before the stage is written again two rounds later, the same warp waits for
that store's read of shared memory (in the next round's score hook, which precedes the barrier
guarding the stage's next write). Out-of-range rows and keys are clipped by TMA; tiles no round
visits keep the zeros the buffer starts with.

Everything else is backward_bias.py's (the bias re-added at the fragments' coordinates) and
FA4's. Serves: dbias "store" in q's dtype, no mask, fixed lengths, head dims where FA4 double
buffers dS (masked.TMA_DBIAS_HEAD_DIMS), keys a multiple of 8 (`forward_bias_tma.tma_ready`).
"""
# No `from __future__ import annotations`: the DSL reads the annotations as objects.
import functools
import hashlib
import inspect

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils

from . import backward_bias
from .forward_bias import fa4_class_swapped

with open(__file__, "rb") as _source:
    # with backward_bias.py's (and through it hooks.py's): the class builds on both
    _SOURCE_DIGEST = hashlib.sha256(_source.read() + backward_bias.SOURCE_DIGEST.encode()).hexdigest()

# The consumer warp that issues the stores: the first of warpgroup 0, which FA4 also uses for its
# dK/dV stores (and whose outstanding bulk stores it waits for before the kernel ends).
STORE_WARP = 4


@functools.lru_cache(maxsize=None)
def store_point_matches_fa4() -> bool:
    """The order this store relies on in FA4's backward round (4.0.0b36): the score gradient
    hook, then the fence and barrier publishing dS, then the dQ GEMM that our store precedes;
    and warp 4's wait for its bulk stores before the kernel ends. Read from FA4's source, so that
    a changed round turns this path off instead of racing."""
    round_src = inspect.getsource(FlashAttentionBackwardSm90.mma_one_m_block)
    mma_src = inspect.getsource(FlashAttentionBackwardSm90.mma)
    # the publishing fence and barrier at the round's indentation (not the conditional pair
    # FA4 runs before writing dS when it single-buffers it)
    marks = ["score_mod_bwd_fn(acc_dP", "copy_dS_r2s(",
             "        cute.arch.fence_view_async_shared()\n        PdS_barrier.arrive_and_wait()",
             "mma_dsk_fn(A_idx=smem_idx_PdS"]
    where = [round_src.find(mark) for mark in marks]
    return (all(i >= 0 for i in where) and where == sorted(where)
            and "cp_async_bulk_wait_group(0, read=True)" in mma_src)


@functools.lru_cache(maxsize=None)
def tma_dbias_score_mod_bwd(tma_slot: int):
    """The score_mod_bwd FA4 is given for a TMA-stored dbias (never called: the class below
    replaces the method that would); tma_slot: the aux slot of the dbias's TMA view."""
    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    score_mod_bwd.tma_dbias = (tma_slot,)
    score_mod_bwd.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:tma-dbias:{tma_slot}".encode()).hexdigest()
    return score_mod_bwd


class TmaDbiasBackwardSm90(backward_bias.DirectBiasBackwardSm90):
    """FA4's SM90 backward with dbias stored by TMA from its shared dS tile (module docstring)."""

    def _tma_slot(self):
        spec = getattr(self.score_mod_bwd, "tma_dbias", None)
        return None if spec is None else spec[0]

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, softmax_scale: Float32,
                 mCuSeqlensQ=None, mCuSeqlensK=None, mSeqUsedQ=None, mSeqUsedK=None,
                 window_size_left=None, window_size_right=None, mdQ_semaphore=None,
                 mdK_semaphore=None, mdV_semaphore=None, aux_data: AuxData = AuxData(),
                 blocksparse_tensors=None, mCuTotalMBlocks=None, stream: cuda.CUstream = None):
        slot = self._tma_slot()
        if const_expr(slot is not None):
            # the dS tile's shared layout, as FA4's __call__ is about to set it up
            self.num_threads_per_warp_group = 128
            self._setup_attributes()
            dbias = layout_utils.select(assume_tensor_aligned(aux_data.tensors[slot]), [2, 3, 1, 0])
            atom, tma_dbias = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), dbias, cute.select(self.sPdS_layout, mode=[0, 1]),
                (self.tile_m, self.tile_n))
            aux_data = AuxData((*aux_data.tensors, atom, tma_dbias), aux_data.scalars)
        FlashAttentionBackwardSm90.__call__(
            self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale, mCuSeqlensQ,
            mCuSeqlensK, mSeqUsedQ, mSeqUsedK, window_size_left, window_size_right, mdQ_semaphore,
            mdK_semaphore, mdV_semaphore, aux_data, blocksparse_tensors, mCuTotalMBlocks, stream)

    @cute.jit
    def mma(self, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, mdK, mdV,
            mdK_semaphore, mdV_semaphore, mdQaccum, sQ, sK, sV, sdO, sP, sdS, sLSE, sdPsum,
            sdQaccum, pipeline_Q, pipeline_dO, tidx, tma_atom_dK, tma_atom_dV,
            r2s_tiled_copy_dQaccum, softmax_scale_log2, softmax_scale, block_info, SeqlenInfoCls,
            AttentionMaskCls, TileSchedulerCls, aux_data=AuxData(), fastdiv_mods=(None, None),
            blocksparse_tensors=None, qhead_per_kvhead_divmod=None, is_dQ_wg=True):
        if const_expr(self._tma_slot() is not None):
            # kept for this trace's rounds (mma_one_m_block and the score hook)
            self._dbias_store = (sdS, aux_data.tensors[-2], aux_data.tensors[-1])
        FlashAttentionBackwardSm90.mma(
            self, tiled_mma_SdP, tiled_mma_dK, tiled_mma_dV, tiled_mma_dQ, mdK, mdV,
            mdK_semaphore, mdV_semaphore, mdQaccum, sQ, sK, sV, sdO, sP, sdS, sLSE, sdPsum,
            sdQaccum, pipeline_Q, pipeline_dO, tidx, tma_atom_dK, tma_atom_dV,
            r2s_tiled_copy_dQaccum, softmax_scale_log2, softmax_scale, block_info, SeqlenInfoCls,
            AttentionMaskCls, TileSchedulerCls, aux_data, fastdiv_mods, blocksparse_tensors,
            qhead_per_kvhead_divmod, is_dQ_wg=is_dQ_wg)

    @cute.jit
    def mma_one_m_block(self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx,
                        mma_qk_fn, mma_dov_fn, mma_pdo_fn, mma_dsq_fn, mma_dsk_fn, copy_P_r2s,
                        copy_dS_r2s, pipeline_Q, pipeline_dO, tLSEsLSE, tLSEsdPsum, tdQsdQaccum,
                        softmax_scale_log2, PdS_barrier, is_dQ_wg=True, mask_fn=None,
                        score_mod_fn=None, score_mod_bwd_fn=None, dKV_accumulate=True):
        if const_expr(self._tma_slot() is not None and is_dQ_wg):
            # FA4 calls the dQ GEMM right after the fence and barrier that publish this round's
            # dS tile: the store goes out just before it
            mma_dsk_fn = functools.partial(self._store_dbias_then, mma_dsk_fn, m_block)
        return FlashAttentionBackwardSm90.mma_one_m_block(
            self, m_block, consumer_state_Q, consumer_state_dO, warp_group_idx, mma_qk_fn,
            mma_dov_fn, mma_pdo_fn, mma_dsq_fn, mma_dsk_fn, copy_P_r2s, copy_dS_r2s, pipeline_Q,
            pipeline_dO, tLSEsLSE, tLSEsdPsum, tdQsdQaccum, softmax_scale_log2, PdS_barrier,
            is_dQ_wg=is_dQ_wg, mask_fn=mask_fn, score_mod_fn=score_mod_fn,
            score_mod_bwd_fn=score_mod_bwd_fn, dKV_accumulate=dKV_accumulate)

    @cute.jit
    def _store_dbias_then(self, mma_dsk_fn, m_block, A_idx, wg_wait):
        sdS, atom, tma_dbias = self._dbias_store
        batch_idx, head_idx, n_block = self._dbias_tile
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
            rows = cute.local_tile(tma_dbias[None, None, head_idx, batch_idx],
                                   (self.tile_m, self.tile_n), (None, n_block))
            store, _, _ = copy_utils.tma_get_copy_fn(atom, 0, cute.make_layout(1), sdS, rows)
            store(src_idx=A_idx, dst_idx=m_block)
            cute.arch.cp_async_bulk_commit_group()
        return mma_dsk_fn(A_idx=A_idx, wg_wait=wg_wait)

    @cute.jit
    def apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx,
                            m_block, n_block, softmax_scale, seqlen_info,
                            aux_data: AuxData = AuxData(), fastdiv_mods=(None, None)):
        if const_expr(self._tma_slot() is None):
            backward_bias.DirectBiasBackwardSm90.apply_score_mod_bwd(
                self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx, m_block,
                n_block, softmax_scale, seqlen_info, aux_data, fastdiv_mods)
        else:
            # the tile this round stores (read by _store_dbias_then later in the round)
            self._dbias_tile = (batch_idx, head_idx, n_block)
            # the previous round's store has read its stage before anyone passes this round's
            # barrier, after which the round after next writes that stage again
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP:
                cute.arch.cp_async_bulk_wait_group(0, read=True)


# The overrides take FA4's arguments as they are: the same annotations (the DSL reads them).
for _name in ("__call__", "mma", "mma_one_m_block"):
    getattr(TmaDbiasBackwardSm90, _name).__wrapped__.__annotations__ = dict(
        getattr(FlashAttentionBackwardSm90, _name).__wrapped__.__annotations__)


def tma_dbias_backward_kernel():
    """The swap for a TMA-stored dbias backward."""
    return fa4_class_swapped("FlashAttentionBackwardSm90", TmaDbiasBackwardSm90)


__all__ = ["store_point_matches_fa4", "tma_dbias_score_mod_bwd", "TmaDbiasBackwardSm90", "tma_dbias_backward_kernel"]
