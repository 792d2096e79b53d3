"""Model layers over the flash-dma ops: dynamic mask attention (Doge-style), Gated DeltaNet and
Kimi Delta Attention (FLA-compatible parameters), rotary embedding."""
from .dynamic_mask_attention import DynamicMaskAttention, DynamicMaskAttentionCache
from .gated_deltanet import GatedDeltaNet, GatedRMSNorm, KimiDeltaAttention, LinearAttentionState, ShortConvolution
from .rotary import RotaryEmbedding, apply_rotary

__all__ = ["DynamicMaskAttention", "DynamicMaskAttentionCache", "GatedDeltaNet", "KimiDeltaAttention",
           "LinearAttentionState", "ShortConvolution", "GatedRMSNorm", "RotaryEmbedding", "apply_rotary"]
