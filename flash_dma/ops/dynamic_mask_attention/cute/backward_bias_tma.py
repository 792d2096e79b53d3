"""The backward's bias read and dbias store on SM90 by TMA, through the dS tile FA4 keeps in
shared memory.

backward_bias.py reads the bias and writes dbias from each thread's score fragment, 2 bytes at
a time; with FA4's SdP_swapAB (the scores computed transposed) a thread's neighbouring elements
are neighbouring queries, so every access lands in another row. FA4's SM90 backward writes each
round's dS tile into shared memory anyway (sdS: two stages at the head dims served here, in q's
dtype, queries x keys with keys contiguous, read by the dQ GEMM), and that buffer serves both:

- dbias: with one dbias writer per entry the tile is exactly dbias (the gradient of the scaled
  score plus bias, not multiplied by the softmax scale). After FA4's own fence and barrier that
  publish it, the first consumer warp stores it with one TMA store; the same warp waits for the
  store's read of shared memory in the next round's score hook, which precedes the barrier
  guarding the stage's next write. Out-of-range rows and keys are clipped by TMA; tiles
  no round visits keep the zeros the buffer starts with.
- the bias: round r's bias tile is loaded by TMA into the stage round r's dS will be written to.
  That stage is free from the barrier publishing round r-1's dS (the other stage) on: the first
  consumer warp issues round r+1's load right after round r's barrier (round 0's at its start),
  each on its own mbarrier, one per stage, kept in the padding FA4's shared storage leaves after
  its dO mbarriers (checked at trace time from the struct's offsets); the consumers wait on it
  (phase as FA4's Q pipeline's, which takes the same stages in the same order) before each reads
  its fragment's share with a transposing ldmatrix (the mirror of FA4's transposing stmatrix of
  dS) and adds it as backward_bias.py does. Out-of-range entries arrive as zeros (masked after
  this step). The loads assume FA4's dense round loop and the order inside a round, checked
  against FA4's source (`round_matches_fa4`).

Serves: no mask, fixed lengths, head dims where FA4 double-buffers dS
(masked.TMA_DBIAS_HEAD_DIMS); the bias in q's dtype with full query and key dims (any batch and
head broadcast) and `tma_operands.tma_ready`; dbias "store" in q's dtype, keys a multiple of 8.
Either part may run without the other.
"""
# No `from __future__ import annotations`: the DSL reads the annotations as objects.
import dataclasses
import functools
import hashlib
import inspect
from types import SimpleNamespace
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
from flash_attn.cute.named_barrier import NamedBarrierBwd
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils

from . import backward_bias, forward_bias_tma
from .forward_bias import fa4_class_swapped
from .forward_bias_tma import bias_head_and_batch

with open(__file__, "rb") as _source:
    # with backward_bias.py's (and through it hooks.py's): the class builds on both; and
    # forward_bias_tma.py's, whose bias_head_and_batch it traces
    _SOURCE_DIGEST = hashlib.sha256(_source.read() + backward_bias.SOURCE_DIGEST.encode()
                                    + forward_bias_tma.SOURCE_DIGEST.encode()).hexdigest()

# The consumer warp that issues the TMA loads and stores: the first of warpgroup 0, which FA4
# also uses for its dK/dV stores (and whose outstanding bulk stores it waits for before the
# kernel ends). Warpgroup 0 always computes dQ, the GEMM our wrapper precedes.
TMA_WARP = 4
HEAD_MODES = ("each", "kv", "shared")
BIAS_STAGES = 2  # FA4's dS stages, which the bias tiles borrow
# The named barrier after the consumers' initialisation of the bias mbarriers: the first id FA4's
# SM90 backward leaves free.
BIAS_INIT_BARRIER = max(NamedBarrierBwd) + 1
assert BIAS_INIT_BARRIER < 16, "no free named barrier"


@dataclasses.dataclass(frozen=True)
class TmaBackwardSpec:
    """What the kernel takes by TMA. bias: (aux slot of the bias's TMA view, batch broadcast,
    head mode: "each" query head, per "kv" head or "shared"), or None to read it per element;
    dbias_slot: aux slot of dbias's TMA view, or None to write it per element."""
    bias: Optional[tuple] = None
    dbias_slot: Optional[int] = None

    def __post_init__(self):
        if self.bias is None and self.dbias_slot is None:
            raise ValueError("TmaBackwardSpec: expected a bias or a dbias slot")
        if self.bias is not None and self.bias[2] not in HEAD_MODES:
            raise ValueError(f"bias head mode: expected one of {HEAD_MODES}, got {self.bias[2]!r}")


@functools.lru_cache(maxsize=None)
def round_matches_fa4() -> bool:
    """The order both parts rely on in FA4's backward (4.0.0b36): the dense loop takes rounds
    m_block_min .. m_block_max - 1, each advancing the Q pipeline's state once; in a round, the
    Q wait, then the score hook, the score-gradient hook, the dS write, the fence and barrier
    publishing dS, then the dQ GEMM that our TMA issue precedes; warp 4 waits for its bulk
    stores before the kernel ends. Read from FA4's source, so that a change turns this path off
    instead of racing or deadlocking."""
    round_src = inspect.getsource(FlashAttentionBackwardSm90.mma_one_m_block)
    mma_src = inspect.getsource(FlashAttentionBackwardSm90.mma)
    # the publishing fence and barrier at the round's indentation (not the conditional pair
    # FA4 runs before writing dS when it single-buffers it)
    marks = ["pipeline_Q.consumer_wait(", "score_mod_fn(acc_S", "score_mod_bwd_fn(acc_dP",
             "copy_dS_r2s(",
             "        cute.arch.fence_view_async_shared()\n        PdS_barrier.arrive_and_wait()",
             "mma_dsk_fn(A_idx=smem_idx_PdS"]
    where = [round_src.find(mark) for mark in marks]
    return (all(i >= 0 for i in where) and where == sorted(where)
            and "smem_idx_PdS = smem_idx_Q if" in round_src
            and "for m_block in cutlass.range(m_block_min, m_block_max, unroll=1)" in mma_src
            and "consumer_state_Q.advance()" in round_src
            and "cp_async_bulk_wait_group(0, read=True)" in mma_src)


@functools.lru_cache(maxsize=None)
def tma_score_mod_bwd(spec: TmaBackwardSpec, direct_dbias: tuple):
    """The score_mod_bwd FA4 is given for a TMA backward (never called: the class below
    replaces the methods that would). direct_dbias: backward_bias's (slot, grouped, mode) for a
    dbias written per element (mode "none" without dbias), used where spec.dbias_slot is None."""
    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    score_mod_bwd.tma_backward = spec
    score_mod_bwd.direct_dbias = direct_dbias
    score_mod_bwd.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:tma-backward:{spec}:{direct_dbias}".encode()).hexdigest()
    return score_mod_bwd


def _is_tma_warp():
    return cute.arch.make_warp_uniform(cute.arch.warp_idx()) == TMA_WARP


class TmaBiasBackwardSm90(backward_bias.DirectBiasBackwardSm90):
    """FA4's SM90 backward with the bias loaded and/or dbias stored by TMA through its shared dS
    tile (module docstring)."""

    def _spec(self):
        return getattr(self.score_mod_bwd, "tma_backward", None)

    def _takes_bias(self):
        return self._spec() is not None and self._spec().bias is not None

    def _stores_dbias(self):
        return self._spec() is not None and self._spec().dbias_slot is not None

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mdPsum: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, softmax_scale: Float32,
                 mCuSeqlensQ=None, mCuSeqlensK=None, mSeqUsedQ=None, mSeqUsedK=None,
                 window_size_left=None, window_size_right=None, mdQ_semaphore=None,
                 mdK_semaphore=None, mdV_semaphore=None, aux_data: AuxData = AuxData(),
                 blocksparse_tensors=None, mCuTotalMBlocks=None, stream: cuda.CUstream = None):
        spec = self._spec()
        if const_expr(spec is not None):
            # the dS tile's shared layout, as FA4's __call__ is about to set it up
            self.num_threads_per_warp_group = 128
            self._setup_attributes()
            assert self.PdS_stage == 2 and self.Q_stage == self.dO_stage == 2 and self.SdP_swapAB, \
                "the TMA backward needs FA4's double-buffered dS with transposed scores"
            one_stage = cute.select(self.sPdS_layout, mode=[0, 1])
            tile = (self.tile_m, self.tile_n)
            extra = []
            if const_expr(spec.bias is not None):
                # (Sq, Sk, Hb, Bb): FA4's mode order for its own tensors
                bias = layout_utils.select(assume_tensor_aligned(aux_data.tensors[spec.bias[0]]), [2, 3, 1, 0])
                extra += list(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), bias,
                                                          one_stage, tile))
                self.bias_tx_bytes = cute.size_in_bytes(bias.element_type, one_stage)
            if const_expr(spec.dbias_slot is not None):
                dbias = layout_utils.select(assume_tensor_aligned(aux_data.tensors[spec.dbias_slot]), [2, 3, 1, 0])
                extra += list(cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), dbias,
                                                          one_stage, tile))
            aux_data = AuxData((*aux_data.tensors, *extra), aux_data.scalars)
        FlashAttentionBackwardSm90.__call__(
            self, mQ, mK, mV, mdO, mLSE, mdPsum, mdQaccum, mdK, mdV, softmax_scale, mCuSeqlensQ,
            mCuSeqlensK, mSeqUsedQ, mSeqUsedK, window_size_left, window_size_right, mdQ_semaphore,
            mdK_semaphore, mdV_semaphore, aux_data, blocksparse_tensors, mCuTotalMBlocks, stream)

    def _get_shared_storage_cls(self):
        storage = FlashAttentionBackwardSm90._get_shared_storage_cls(self)
        if self._takes_bias():
            # the bias mbarriers go right after FA4's dO mbarriers, in the padding before sLSE
            offsets = storage._offsets
            dO_barriers_end = offsets["mbar_ptr_dO"] + 2 * self.dO_stage * 8
            assert list(offsets).index("sLSE") == list(offsets).index("mbar_ptr_dO") + 1 and \
                offsets["sLSE"] - dO_barriers_end >= BIAS_STAGES * 8, \
                "FA4's shared storage leaves no room for the bias mbarriers"
        return storage

    @cute.jit
    def _mma_setup(self, tiled_mma_SdP, sdS, pipeline_dO, tidx, block_info, aux_data):
        backward_bias.DirectBiasBackwardSm90._mma_setup(self, tiled_mma_SdP, sdS, pipeline_dO, tidx,
                                                       block_info, aux_data)
        if const_expr(self._spec() is not None):
            # kept for this trace's rounds (mma_one_m_block and the score hooks)
            tensors = aux_data.tensors
            self._tma = SimpleNamespace(sdS=sdS, block_info=block_info)
            if const_expr(self._stores_dbias()):
                self._tma.dbias_atom, self._tma.dbias = tensors[-2], tensors[-1]
            if const_expr(self._takes_bias()):
                first = -4 if const_expr(self._stores_dbias()) else -2
                self._tma.bias_atom, self._tma.bias = tensors[first], tensors[first + 1]
                # the transposing ldmatrix mirror of FA4's dS store, over the (key, query) view
                _, self._tma.bias_copy, self._tma.bias_smem = copy_utils.get_smem_load_C(
                    tiled_mma_SdP, layout_utils.transpose_view(sdS), tidx, transpose=True,
                    position_independent=True)
                # one mbarrier per stage after FA4's dO mbarriers (_get_shared_storage_cls)
                self._tma.bias_full = pipeline_dO.sync_object_full.get_barrier(0) + 2 * self.dO_stage
                if tidx == 0:
                    for stage in cutlass.range_constexpr(BIAS_STAGES):
                        cute.arch.mbarrier_init(self._tma.bias_full + stage, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.barrier(barrier_id=int(BIAS_INIT_BARRIER),
                                  number_of_threads=self.num_mma_threads)

    @cute.jit
    def _prepare_round(self, m_block, consumer_state_Q, bound):
        backward_bias.DirectBiasBackwardSm90._prepare_round(self, m_block, consumer_state_Q, bound)
        if const_expr(self._spec() is not None):
            batch_idx, head_idx, n_block = bound["batch_idx"], bound["head_idx"], bound["n_block"]
            # this round's stage of Q, dO and dS (one index: FA4's stages are equal here)
            stage = consumer_state_Q.index
            self._round = SimpleNamespace(stage=stage, phase=consumer_state_Q.phase, m_block_max=None)
            if const_expr(self._stores_dbias()):
                rows = cute.local_tile(self._tma.dbias[None, None, head_idx, batch_idx],
                                       (self.tile_m, self.tile_n), (None, n_block))
                self._round.store, _, _ = copy_utils.tma_get_copy_fn(
                    self._tma.dbias_atom, 0, cute.make_layout(1), self._tma.sdS, rows)
            if const_expr(self._takes_bias()):
                _, batch_broadcast, head_mode = self._spec().bias
                head, batch = bias_head_and_batch(head_mode, batch_broadcast, head_idx, batch_idx,
                                                  self.qhead_per_kvhead)
                rows = cute.local_tile(self._tma.bias[None, None, head, batch],
                                       (self.tile_m, self.tile_n), (None, n_block))
                self._round.load, _, _ = copy_utils.tma_get_copy_fn(
                    self._tma.bias_atom, 0, cute.make_layout(1), rows, self._tma.sdS)
                m_block_min, self._round.m_block_max = self._tma.block_info.get_m_block_min_max(
                    bound["seqlen_info"], n_block)
                if _is_tma_warp():
                    if m_block == m_block_min:
                        # the tile's first round loads its own bias; later rounds get theirs
                        # from the round before (_issue_tma_then)
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        self._load_bias(m_block, stage)

    def _wrap_dq_gemm(self, mma_dsk_fn, m_block, is_dQ_wg):
        if self._spec() is not None and is_dQ_wg:
            # FA4 calls the dQ GEMM right after the fence and barrier that publish this round's
            # dS tile: our TMA goes out just before it
            return functools.partial(self._issue_tma_then, mma_dsk_fn, m_block, self._round.m_block_max)
        return mma_dsk_fn

    @cute.jit
    def _issue_tma_then(self, mma_dsk_fn, m_block, m_block_max, A_idx, wg_wait):
        if _is_tma_warp():
            if const_expr(self._stores_dbias()):
                self._round.store(src_idx=A_idx, dst_idx=m_block)
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(self._takes_bias()):
                # the next round's bias into the other stage: its last readers (the previous
                # round's dQ GEMM and dbias store, the bias ldmatrix before that round's dS
                # write) are all behind the barrier just passed
                if m_block + 1 < m_block_max:
                    self._load_bias(m_block + 1, 1 - A_idx)
        return mma_dsk_fn(A_idx=A_idx, wg_wait=wg_wait)

    @cute.jit
    def _load_bias(self, m_block, stage):
        """The TMA warp: bias tile (m_block, this tile's keys) into dS stage `stage`."""
        barrier = self._tma.bias_full + stage
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, self.bias_tx_bytes)
        self._round.load(src_idx=m_block, dst_idx=stage, tma_bar_ptr=barrier)

    @cute.jit
    def apply_score_mod(self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block,
                        softmax_scale, seqlen_info, aux_data: AuxData = AuxData(),
                        fastdiv_mods=(None, None)):
        if const_expr(self._stores_dbias()):
            if _is_tma_warp():
                # the previous round's dbias store has read its stage before anyone passes this
                # round's barrier, after which that stage takes the next bias or dS. Waited for
                # here, not in the score-gradient hook: there ptxas serialised every warpgroup
                # MMA of the kernel (C7512)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(not self._takes_bias()):
            backward_bias.DirectBiasBackwardSm90.apply_score_mod(
                self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block, softmax_scale,
                seqlen_info, aux_data, fastdiv_mods)
        else:
            cute.arch.mbarrier_wait(self._tma.bias_full + self._round.stage, self._round.phase)
            values = cute.make_rmem_tensor_like(acc_S, self.dtype)
            cute.copy(self._tma.bias_copy, self._tma.bias_smem[None, None, None, self._round.stage],
                      self._tma.bias_copy.retile(values))
            forward_bias_tma.add_bias_fragment(acc_S, values, softmax_scale)

    @cute.jit
    def apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx,
                            m_block, n_block, softmax_scale, seqlen_info,
                            aux_data: AuxData = AuxData(), fastdiv_mods=(None, None)):
        # with dbias stored by TMA from the dS tile, nothing here: a bias's score gradient is
        # the identity, and the store waits in the score hook (apply_score_mod)
        if const_expr(not self._stores_dbias()):
            backward_bias.DirectBiasBackwardSm90.apply_score_mod_bwd(
                self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx, m_block,
                n_block, softmax_scale, seqlen_info, aux_data, fastdiv_mods)


# The overrides take FA4's arguments as they are: the same annotations (the DSL reads them).
for _name in ("__call__",):
    getattr(TmaBiasBackwardSm90, _name).__wrapped__.__annotations__ = dict(
        getattr(FlashAttentionBackwardSm90, _name).__wrapped__.__annotations__)


def tma_backward_kernel():
    """The swap for a TMA backward."""
    return fa4_class_swapped("FlashAttentionBackwardSm90", TmaBiasBackwardSm90)


__all__ = ["TmaBackwardSpec", "round_matches_fa4", "tma_score_mod_bwd", "TmaBiasBackwardSm90",
           "tma_backward_kernel"]
