"""The forward's bias on SM90 as tiles in shared memory, loaded by TMA from an idle producer warp.

forward_bias.py adds the bias from global memory in each consumer thread, 4 bytes per load, on
the softmax warps' path. Here the producer warpgroup's second warp (idle while warp 0 issues
FA4's TMA loads of Q, K and V) walks the same key tiles as FA4's loop and loads each
(query tile x key tile) block of the bias by TMA into a two-stage ring in shared memory, with its
own mbarriers. Each consumer thread then reads its accumulator fragment's share with ldmatrix
(the 8x8 ldmatrix fragment is the wgmma accumulator's: row lane/4, keys 2*(lane%4) and +1), adds
it, and frees the stage. Out-of-range rows and keys (and FA4's key tile -1 under causal with
Sq > Sk) arrive zero-filled; FA4 masks those lanes after this step.

Kept from FA4 unchanged: every pipeline, the tile loops, softmax. Our subclass adds, without
editing FA4's methods: the bias's TMA descriptor in __call__ (carried to the kernel at the end of
the aux tensors), the ring and its mbarriers allocated and initialised in a kernel prologue
that then runs FA4's own kernel body, a bias loop beside FA4's load, and the consumer step in
apply_score_mod. The bias warp must visit key tiles in the order FA4's consumers do (dense
walk: key tile n_max - 1 first, then downwards): `order_matches_fa4` checks FA4's source for
that walk, and masked.py uses this class only where it holds.

Serves: a 16-bit bias with full query and key dims (no mask, fixed lengths, FA4 not packing GQA),
keys contiguous, every other stride a multiple of 16 bytes and a 16-byte-aligned start
(`tma_ready`), head dims whose tiles leave room for two bias stages (masked.TMA_BIAS_HEAD_DIMS).
"""
# No `from __future__ import annotations` here: cute.struct and the DSL's argument passing read
# the annotations as objects.
import functools
import hashlib
import inspect
from types import SimpleNamespace
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr, pipeline
from cutlass.base_dsl.dsl import BaseDSL
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.utils import LayoutEnum
from flash_attn.cute import pipeline as fa4_pipeline
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils, sm90_utils

from . import forward_bias, hooks
from .tma_operands import TMA_ALIGN_BYTES, tma_ready, tma_view  # noqa: F401 (re-exported)

with open(__file__, "rb") as _source:
    # with forward_bias.py's (and through it hooks.py's): the class builds on both
    _SOURCE_DIGEST = hashlib.sha256(_source.read() + forward_bias.SOURCE_DIGEST.encode()).hexdigest()
SOURCE_DIGEST = _SOURCE_DIGEST  # for kernels that trace this module's helpers

BIAS_STAGES = 2  # what fits beside FA4's buffers at masked.TMA_BIAS_HEAD_DIMS (225 KB of 227 at D128)
# The L2 eviction-priority operand of a TMA load (PTX createpolicy's encoding of evict_first for
# the whole line, as CUTLASS's CacheHintSm90 spells it): each bias tile is read once, so it need
# not push K and V, which every query tile of a head reads, out of L2.
L2_EVICT_FIRST = 0x12F0000000000000


def bias_head_and_batch(head_mode: str, batch_broadcast: bool, head_idx, batch_idx,
                        qhead_per_kvhead: int):
    """The (head, batch) of the bias's TMA view that a query head and batch read (traced code):
    head_mode "each" (one bias per query head), "kv" (per kv head) or "shared"; batch 0 where
    the bias is broadcast along batches."""
    head = head_idx
    if head_mode == "kv":
        head = head_idx // qhead_per_kvhead
    elif head_mode == "shared":
        head = 0
    return head, (0 if batch_broadcast else batch_idx)


@functools.lru_cache(maxsize=None)
def order_matches_fa4() -> bool:
    """FA4's dense key walk, which the bias warp repeats: its consumers take key tile
    n_block_max - 1 first, then n_block_max - 1 - n_tile downwards, and its load warp fetches K
    in that order. Read from FA4's source (4.0.0b36's expressions), so that a changed walk turns
    this path off instead of deadlocking it."""
    load = inspect.getsource(FlashAttentionForwardSm90.load)
    mma = inspect.getsource(FlashAttentionForwardSm90.mma)
    return ("n_block = n_block_max - 1 - i - 1" in load and "n_block_max - 1 - n_tile" in mma
            and "n_block=n_block_max - 1," in mma)


@functools.lru_cache(maxsize=None)
def tma_bias_score_mod(tma_slot: int, batch_broadcast: bool, head_mode: str, bias_dtype: str,
                       evict_first: bool = False):
    """The score_mod FA4 is given for a TMA-bias forward (never called: the class below replaces
    the method that would). head_mode: "each" (one bias per query head), "kv" (per kv head) or
    "shared" (one for all heads); evict_first: the bias loads carry L2_EVICT_FIRST."""
    fn = hooks.bias_score_mod(0, False, 1)

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return fn(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors)

    if head_mode not in ("each", "kv", "shared"):
        raise ValueError(f"head_mode: expected each, kv or shared, got {head_mode!r}")
    score_mod.tma_bias = (tma_slot, batch_broadcast, head_mode, getattr(cutlass, bias_dtype), evict_first)
    score_mod.__cute_hash__ = hashlib.sha256(
        f"{_SOURCE_DIGEST}:tma:{tma_slot}:{batch_broadcast}:{head_mode}:{bias_dtype}:{evict_first}"
        .encode()).hexdigest()
    return score_mod


@cute.jit
def add_bias_fragment(acc_S, values, softmax_scale):
    """acc_S = acc_S * softmax_scale + values (traced): values is the bias's 16-bit fragment in
    acc_S's element order. For bf16 each pair of neighbours shares a 32-bit word, and a bf16
    value's bits are a float32's upper half: the word's low element becomes a float32 by one
    shift, its high one by one mask (the generic conversion spends a byte permute and a shift on
    the high one, and the scores' softmax warps are issue-bound)."""
    if const_expr(values.element_type == cutlass.BFloat16 and cute.size(acc_S.shape) % 2 == 0):
        words = values.load().bitcast(Uint32)
        for i in cutlass.range_constexpr(cute.size(acc_S.shape) // 2):
            word = Uint32(words[i])
            acc_S[2 * i] = acc_S[2 * i] * softmax_scale + (word << Uint32(16)).bitcast(Float32)
            acc_S[2 * i + 1] = acc_S[2 * i + 1] * softmax_scale + (word & Uint32(0xFFFF0000)).bitcast(Float32)
    else:
        bias = values.load().to(Float32)
        for i in cutlass.range_constexpr(cute.size(acc_S.shape)):
            acc_S[i] = acc_S[i] * softmax_scale + bias[i]


def _fa4_kernel_body():
    """FA4's kernel body as a plain traced function (its AST rewriting applied), so our kernel
    prologue can run it inline."""
    body = FlashAttentionForwardSm90.kernel.__wrapped__
    BaseDSL._preprocess_and_replace_code(body)
    return body


class TmaBiasForwardSm90(forward_bias.DirectBiasForwardSm90):
    """FA4's SM90 forward with the bias tile loaded by TMA into shared memory (module docstring)."""

    def _tma_spec(self):
        return getattr(self.score_mod, "tma_bias", None)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], softmax_scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor] = None, mCuSeqlensK: Optional[cute.Tensor] = None,
                 mSeqUsedQ: Optional[cute.Tensor] = None, mSeqUsedK: Optional[cute.Tensor] = None,
                 mPageTable: Optional[cute.Tensor] = None, window_size_left: Optional[Int32] = None,
                 window_size_right: Optional[Int32] = None,
                 learnable_sink: Optional[cute.Tensor] = None, blocksparse_tensors=None,
                 aux_data: AuxData = AuxData(), mCuTotalMBlocks: Optional[cute.Tensor] = None,
                 mCuTotalSplitsMBlocks: Optional[cute.Tensor] = None, stream: cuda.CUstream = None):
        spec = self._tma_spec()
        if const_expr(spec is not None):
            bias = assume_tensor_aligned(aux_data.tensors[spec[0]])
            # (Sq, Sk, Hb, Bb): FA4's mode order for its own tensors (rows, columns, head, batch)
            bias = layout_utils.select(bias, [2, 3, 1, 0])
            tile = (self.tile_m, self.tile_n)
            self.sBias_layout = sm90_utils.make_smem_layout(bias.element_type, LayoutEnum.ROW_MAJOR,
                                                            tile, BIAS_STAGES)
            one_stage = cute.select(self.sBias_layout, mode=[0, 1])
            atom, tma_bias = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), bias,
                                                         one_stage, tile)
            self.bias_tx_bytes = cute.size_in_bytes(bias.element_type, one_stage)
            aux_data = AuxData((*aux_data.tensors, atom, tma_bias), aux_data.scalars)
        FlashAttentionForwardSm90.__call__(
            self, mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
            mSeqUsedK, mPageTable, window_size_left, window_size_right, learnable_sink,
            blocksparse_tensors, aux_data, mCuTotalMBlocks, mCuTotalSplitsMBlocks, stream)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
               mPageTable, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2,
               softmax_scale, window_size_left, window_size_right, learnable_sink,
               blocksparse_tensors, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout,
               gmem_tiled_copy_Q, gmem_tiled_copy_K, gmem_tiled_copy_V, gmem_tiled_copy_O,
               tiled_mma_qk, tiled_mma_pv, tile_sched_params, TileScheduler, SharedStorage,
               aux_data, fastdiv_mods):
        if const_expr(self._tma_spec() is not None):
            self._bias_ring_init(aux_data, tiled_mma_qk)
        _fa4_kernel_body()(
            self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mPageTable, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, softmax_scale_log2,
            softmax_scale, window_size_left, window_size_right, learnable_sink,
            blocksparse_tensors, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout,
            gmem_tiled_copy_Q, gmem_tiled_copy_K, gmem_tiled_copy_V, gmem_tiled_copy_O,
            tiled_mma_qk, tiled_mma_pv, tile_sched_params, TileScheduler, SharedStorage,
            aux_data, fastdiv_mods)

    def _bias_ring_init(self, aux_data: AuxData, tiled_mma_qk):
        """The bias ring in shared memory and its pipeline (mbarriers initialised here, before
        FA4's body fences and syncs its own), kept on self for the producer and consumer
        branches of this kernel's trace."""
        dtype = self._tma_spec()[3]
        layout = sm90_utils.make_smem_layout(dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n),
                                             BIAS_STAGES)
        ring_struct = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]
        barrier_struct = cute.struct.MemRange[Int64, 2 * BIAS_STAGES]

        @cute.struct
        class BiasRing:
            full_and_empty: barrier_struct
            tiles: ring_struct

        ring = cutlass.utils.SmemAllocator().allocate(BiasRing)
        threads = pipeline.Agent.Thread
        bias_pipeline = fa4_pipeline.PipelineTmaAsync.create(
            barrier_storage=ring.full_and_empty.data_ptr(), num_stages=BIAS_STAGES,
            producer_group=pipeline.CooperativeGroup(threads, 1),
            consumer_group=pipeline.CooperativeGroup(threads, self.num_mma_threads // cute.arch.WARP_SIZE),
            tx_count=self.bias_tx_bytes, defer_sync=True)
        self._bias_ring = SimpleNamespace(
            pipeline=bias_pipeline, tiles=ring.tiles.get_tensor(layout.outer, swizzle=layout.inner),
            atom=aux_data.tensors[-2], tensor=aux_data.tensors[-1], tiled_mma_qk=tiled_mma_qk)

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k,
             pipeline_v, pipeline_q, gmem_tiled_copy_Q, mPageTable, blocksparse_tensors,
             block_info, SeqlenInfoCls, TileSchedulerCls):
        if const_expr(self._tma_spec() is not None):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 1:
                self._load_bias_tiles(block_info, SeqlenInfoCls, TileSchedulerCls)
        FlashAttentionForwardSm90.load(
            self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipeline_k,
            pipeline_v, pipeline_q, gmem_tiled_copy_Q, mPageTable, blocksparse_tensors,
            block_info, SeqlenInfoCls, TileSchedulerCls)

    @cute.jit
    def _load_bias_tiles(self, block_info, SeqlenInfoCls, TileSchedulerCls):
        """The bias warp: for each work tile, the key tiles in FA4's order into the ring."""
        # self._bias_ring is read where used, never held in a local: a local would be carried
        # through the dynamic loop and its static fields (the stage count) staged
        _, batch_broadcast, head_mode, _, evict_first = self._tma_spec()
        hint = {"cache_policy": Int64(L2_EVICT_FIRST)} if const_expr(evict_first) else {}
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, BIAS_STAGES)
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            head, batch = bias_head_and_batch(head_mode, batch_broadcast, head_idx, batch_idx,
                                              self.qhead_per_kvhead)
            rows = cute.local_tile(self._bias_ring.tensor[None, None, head, batch],
                                   (self.tile_m, self.tile_n), (m_block, None))
            copy, _, _ = copy_utils.tma_get_copy_fn(self._bias_ring.atom, 0, cute.make_layout(1),
                                                    rows, self._bias_ring.tiles)
            copy = copy_utils.tma_producer_copy_fn(copy, self._bias_ring.pipeline)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            # like FA4's K: the first tile even where the range is empty (n_block -1 zero-fills)
            self._bias_ring.pipeline.producer_acquire(state)
            copy(src_idx=n_block_max - 1, producer_state=state, **hint)
            state.advance()
            for i in cutlass.range(n_block_max - 1 - n_block_min, unroll=1):
                self._bias_ring.pipeline.producer_acquire(state)
                copy(src_idx=n_block_max - 2 - i, producer_state=state, **hint)
                state.advance()
            tile_scheduler.prefetch_next_work()
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()
        self._bias_ring.pipeline.producer_tail(state)

    @cute.jit
    def mma_init(self):
        forward_bias.DirectBiasForwardSm90.mma_init(self)
        if const_expr(self._tma_spec() is not None):
            dtype = self._tma_spec()[3]
            atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
            thread = cute.arch.thread_idx()[0] - self.num_threads_per_warp_group
            self._bias_copy = cute.make_tiled_copy_C(atom, self._bias_ring.tiled_mma_qk).get_slice(thread)
            self._bias_smem = self._bias_copy.partition_S(self._bias_ring.tiles)
            # tiles this thread has taken from the ring: its stage and phase
            self._bias_taken = cute.make_rmem_tensor(1, Int32)
            self._bias_taken[0] = 0

    @cute.jit
    def apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                        softmax_scale, seqlen, aux_data: AuxData = AuxData(), fastdiv_mods=None):
        if const_expr(self._tma_spec() is None):
            forward_bias.DirectBiasForwardSm90.apply_score_mod(
                self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                seqlen, aux_data, fastdiv_mods)
        else:
            taken = self._bias_taken[0]
            stage = taken % BIAS_STAGES
            self._bias_ring.pipeline.consumer_wait_w_index_phase(stage, (taken // BIAS_STAGES) % 2)
            values = cute.make_rmem_tensor_like(acc_S, self._tma_spec()[3])
            cute.copy(self._bias_copy, self._bias_smem[None, None, None, stage],
                      self._bias_copy.retile(values))
            add_bias_fragment(acc_S, values, softmax_scale)
            cute.arch.sync_warp()  # the whole warp's reads done before its arrival frees the stage
            self._bias_ring.pipeline.consumer_release_w_index(stage)
            self._bias_taken[0] = taken + 1


# Our kernel prologue takes FA4's kernel arguments as they are: the same annotations (the DSL
# reads them to pass each argument).
TmaBiasForwardSm90.kernel.__wrapped__.__annotations__ = dict(
    FlashAttentionForwardSm90.kernel.__wrapped__.__annotations__)


def tma_bias_kernel():
    """The swap for a TMA-bias forward."""
    return forward_bias.fa4_class_swapped("FlashAttentionForwardSm90", TmaBiasForwardSm90)


__all__ = ["tma_ready", "tma_view", "bias_head_and_batch", "add_bias_fragment", "order_matches_fa4",
           "tma_bias_score_mod", "TmaBiasForwardSm90", "tma_bias_kernel"]
