"""Context parallelism across ranks with torch.distributed (NCCL on GPUs, gloo on CPUs).

build_cp_context           packed sequences split over a process group (contiguous or zigzag)
cp_chunk_gated_delta_rule  the gated delta rule on such a split
cp_flash_dma_varlen_func   dynamic mask attention on such a split
cp_flash_dma_func          dynamic mask attention on [B, S/W, ...] shards of equal-length batches
                           (form="ring": P2P ring overlapped with compute; "all_gather")
shard_sequence / gather_sequence  cut a global tensor into a rank's shard / join the shards back
"""
from .attention import cp_flash_dma_func, cp_flash_dma_varlen_func, gather_sequence, shard_sequence
from .context import CPContext, build_cp_context
from .gated_delta_rule import cp_chunk_gated_delta_rule

__all__ = ["build_cp_context", "CPContext", "cp_chunk_gated_delta_rule", "cp_flash_dma_func",
           "cp_flash_dma_varlen_func", "shard_sequence", "gather_sequence"]
