"""flash-dma: trainable attention kernels in Triton (dynamic mask attention, gated delta rule)."""
from .ops.dynamic_mask_attention import flash_dma_func, flash_dma_varlen_func, topk_mask_from_bias
from .ops.decode import flash_dma_with_kvcache, update_topk_mask
from .ops.gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu

__version__ = "0.1.0"
__all__ = ["flash_dma_func", "flash_dma_varlen_func", "topk_mask_from_bias", "flash_dma_with_kvcache",
           "update_topk_mask", "chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd_dhu",
           "DynamicMaskAttention", "GatedDeltaNet", "KimiDeltaAttention", "__version__"]

# the layers (torch.nn modules) load on first use, so that importing the ops stays as light as before
_LAYERS = ("DynamicMaskAttention", "GatedDeltaNet", "KimiDeltaAttention")


def __getattr__(name):
    if name in _LAYERS:
        from . import layers
        return getattr(layers, name)
    raise AttributeError(f"module 'flash_dma' has no attribute {name!r}")
