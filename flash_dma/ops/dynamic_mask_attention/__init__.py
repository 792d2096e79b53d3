"""Dynamic mask attention: softmax attention with a keep-mask and a trainable additive bias."""
from .interface import flash_dma_func, flash_dma_varlen_func
from .reference import attention_reference, attention_varlen_reference
from .sparsity import topk_mask_from_bias

__all__ = ["flash_dma_func", "flash_dma_varlen_func", "topk_mask_from_bias",
           "attention_reference", "attention_varlen_reference"]
