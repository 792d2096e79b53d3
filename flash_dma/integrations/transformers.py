"""flash-dma as a Hugging Face transformers attention implementation.

    from flash_dma.integrations.transformers import register
    name = register()                      # "dma_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

transformers 5 treats every implementation name containing "flash" as one of its own
FlashAttention kernels (and then looks for an installed flash-attn), so the name has none.

What the model gets:
- causal or bidirectional attention, GQA/MQA (no repeat of the kv heads), the model's scaling;
- padding masks: the padded tokens are packed away (a stable sort, no host read-back of the mask)
  and the real ones served by flash_dma_varlen_func, which reads the offsets back once per forward
  (every layer shares them); left or right padding, prefill or decoding with a cache;
- any other mask the model builds (sliding windows, packed sequences given by position_ids, a
  static cache's fixed length, custom mask functions) as a boolean keep-mask, and an additive
  float mask or a `position_bias` as a trainable attention bias (its gradient comes back through
  the kernel's dbias).
Not served: attention dropout while training and output_attentions raise a ValueError;
fp32 inputs, logit soft-capping, attention sinks and head dims the kernels do not take run
transformers' sdpa instead, with a one-time warning.
"""
from __future__ import annotations

import warnings

import torch

from .. import flash_dma_func, flash_dma_varlen_func
from ..layers._common import HALF_DTYPES, packing_from_padding_mask

DEFAULT_NAME = "dma_attention"


def _padding_keep(attention_mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """The last kv_length entries of a 2-D padding mask, as bool (True = token)."""
    return attention_mask[:, -kv_length:].bool()


def make_mask_function():
    """transformers mask builder for this implementation: the 2-D padding mask (or None) where the
    mask is the plain causal rule aligned to the end of the keys, else sdpa's 4-D boolean mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    def dma_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                 mask_function=causal_mask_function, attention_mask=None, **kwargs):
        plain = (mask_function is causal_mask_function and isinstance(q_offset, int) and kv_offset == 0
                 and q_offset + q_length == kv_length)
        if plain:
            if attention_mask is None:
                return None
            if attention_mask.dim() == 2 and attention_mask.shape[1] >= kv_length:
                return _padding_keep(attention_mask, kv_length)
        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, **kwargs)

    return dma_mask


class _Fallback:
    """sdpa for what the kernels do not serve, warning once per reason."""

    def __init__(self):
        self.warned: set[str] = set()

    def __call__(self, reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"flash-dma attention: {reason}; running transformers' sdpa attention instead",
                          stacklevel=3)
        if attention_mask is not None and attention_mask.dim() == 2:  # our 2-D padding form
            attention_mask = _dense_keep(attention_mask, query.shape[2], key.shape[2], is_causal)
            is_causal = False
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)


def _dense_keep(padding: torch.Tensor, q_length: int, kv_length: int, causal: bool) -> torch.Tensor:
    keep = padding[:, None, None, :].expand(-1, 1, q_length, kv_length)
    if causal:
        rows = torch.arange(q_length, device=padding.device).view(-1, 1)
        cols = torch.arange(kv_length, device=padding.device).view(1, -1)
        keep = keep & (cols <= rows + (kv_length - q_length))
    return keep


def make_attention_function():
    """The AttentionInterface function: (module, query [B, H, Sq, D], key/value [B, Hk, Sk, D],
    attention_mask, ...) -> (out [B, Sq, H, D], None)."""
    fallback = _Fallback()

    def dma_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              position_bias: torch.Tensor | None = None, **kwargs):
        if dropout and module.training:
            raise ValueError(f"flash-dma attention has no attention dropout, but the model asks for "
                             f"dropout={dropout} in training: set the config's attention_dropout to 0")
        if kwargs.get("output_attentions"):
            raise ValueError("flash-dma attention does not return attention weights (output_attentions=True): "
                             "use attn_implementation='eager' for them")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        reason = None
        if query.dtype not in HALF_DTYPES:
            reason = f"{query.dtype} inputs (the kernels take fp16 and bf16)"
        elif query.shape[-1] % 8 or query.shape[-1] > 256 or value.shape[-1] != query.shape[-1]:
            reason = f"head dim {query.shape[-1]} (the kernels take multiples of 8 up to 256)"
        elif kwargs.get("softcap") is not None:
            reason = "logit soft-capping"
        elif kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            reason = "attention sinks"
        if reason is not None:
            if position_bias is not None:
                kwargs["position_bias"] = position_bias
            return fallback(reason, module, query, key, value, attention_mask, dropout, scaling, causal, kwargs)

        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        q_length = q.shape[1]
        bias = position_bias
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            if bias is None:
                return _varlen(q, k, v, attention_mask, causal, scaling), None
            mask = attention_mask[:, None, None, :]  # key-wise keep-mask, beside the bias
        elif attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                mask = attention_mask
            else:  # an additive mask: a bias (-inf / dtype-min entries hide keys)
                bias = attention_mask if bias is None else bias + attention_mask
            causal = False  # a 4-D mask already holds the causal rule
        if bias is not None and bias.dtype not in (q.dtype, torch.float32):
            bias = bias.to(q.dtype)
        out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias,
                             is_causal=bool(causal) and q_length > 1, softmax_scale=scaling)
        return out, None

    return dma_attention_forward


def _varlen(q, k, v, padding: torch.Tensor, causal: bool, scaling):
    """Padded batch -> packed real tokens -> flash_dma_varlen_func -> padded (padding rows 0)."""
    q_length, kv_length = q.shape[1], k.shape[1]
    keys = packing_from_padding_mask(padding)
    queries = keys if q_length == kv_length else packing_from_padding_mask(padding[:, -q_length:])
    out = flash_dma_varlen_func(queries.guard(queries.pack(q)), keys.guard(keys.pack(k)),
                                keys.guard(keys.pack(v)), queries.cu_seqlens,
                                keys.cu_seqlens, q_length, kv_length, is_causal=bool(causal),
                                softmax_scale=scaling)
    return queries.unpack(out)


def register(name: str = DEFAULT_NAME) -> str:
    """Add flash-dma to transformers' attention and mask interfaces under `name` and return it,
    for `attn_implementation=name` (from_pretrained, from_config, set_attn_implementation)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if "flash" in name:
        raise ValueError(f"name: transformers takes every implementation name containing 'flash' for one "
                         f"of its own FlashAttention kernels; choose a name without it, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("flash_dma.integrations.transformers needs transformers>=5 "
                          "(pip install 'flash-dma[hf]')") from error
    AttentionInterface.register(name, make_attention_function())
    AttentionMaskInterface.register(name, make_mask_function())
    return name
