"""Decoding with a KV cache: a few queries over a (paged) cache, with mask and bias."""
from .interface import flash_dma_with_kvcache
from .reference import decode_reference
from .topk import update_topk_mask

__all__ = ["flash_dma_with_kvcache", "decode_reference", "update_topk_mask"]
