"""flash-dma: trainable attention kernels in Triton (dynamic mask attention)."""
from .ops.dynamic_mask_attention import flash_dma_func, flash_dma_varlen_func, topk_mask_from_bias

__version__ = "0.1.0"
__all__ = ["flash_dma_func", "flash_dma_varlen_func", "topk_mask_from_bias", "__version__"]
