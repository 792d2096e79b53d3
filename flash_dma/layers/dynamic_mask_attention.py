"""Dynamic mask attention as a layer (Doge / flash-dmattn, arXiv 2508.02124)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import (flash_dma_func, flash_dma_varlen_func, flash_dma_with_kvcache, topk_mask_from_bias,
                update_topk_mask)
from ._common import (HALF_DTYPES, Packing, check_cu_seqlens_arg, check_divides, check_hidden_states,
                      check_padding_mask, check_positive_int, packing_from_cu_seqlens,
                      packing_from_padding_mask)
from .rotary import RotaryEmbedding, apply_rotary

# the per-row top-k of a causal mask is built this many query rows at a time, bounding its fp32
# temporaries to about rows * keys per (batch, kv head)
_MASK_ROW_CHUNK = 1024
# queries per decoding call that flash_dma_with_kvcache accepts
_MAX_DECODE_QUERIES = 16


class DynamicMaskAttention(nn.Module):
    r"""Multi-head attention with a trainable, content-dependent sparse mask (Dynamic Mask
    Attention, DMA: Shi et al., "Trainable Dynamic Mask Sparse Attention", arXiv 2508.02124, the
    attention of the Doge models).

    Each kv head h scores every key j from its value vector, through a learned projection
    :math:`W_\Delta` (``dt_proj``) and a learned per-head coefficient :math:`A_h` (``A``):

    .. math::
        \delta_{h,j} = \exp\big(A_h \cdot \mathrm{softplus}((v_j W_\Delta)_h)\big)

    The score is an additive attention bias shared by all queries (and by the query heads of a
    GQA group), and it picks which keys a query sees: when more than ``keep_window_size`` keys are
    visible, query i keeps the ``keep_window_size`` keys of largest :math:`\delta` among the keys
    it may see (the causal rule and padding are applied first), and

    .. math::
        \mathrm{out}_i = \mathrm{softmax}_{j \in \mathrm{top}_w(i)}
            \big(q_i k_j^\top / \sqrt{d} + \delta_{h,j}\big)\, v_j .

    With ``keep_window_size`` at least the sequence length nothing is dropped and the bias alone
    acts (as in the paper). The mask takes no gradient; :math:`A` and :math:`W_\Delta` learn through
    the bias gradient of ``flash_dma_func``. ``A`` starts at 0 (every key scored 1, as in Doge).

    Args:
        hidden_size: model width.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA), dividing ``num_attention_heads``; default all.
        head_dim: per-head width (a multiple of 8 up to 256); default hidden_size // heads.
        keep_window_size: w, the keys kept per query (the paper's default 2048).
        is_causal: causal self-attention (decoder) or not (encoder).
        attention_bias: biases in the q/k/v/o projections and ``dt_proj``.
        rope_theta: rotary base, or None for no rotary embedding.
        layer_idx: the layer's index (for caches kept by the caller).

    ``forward(hidden_states, attention_mask=None, position_ids=None, cu_seqlens=None,
    max_seqlen=None, past_key_values=None)``: hidden_states [B, S, hidden_size] (the attention
    runs in fp16 or bf16: cast the layer or use autocast); attention_mask [B, S] padding mask
    (1 = token, any side padded), served by ``flash_dma_varlen_func`` on the packed tokens;
    or cu_seqlens (int32 [N + 1]) and max_seqlen for sequences already packed along dim 1 (B = 1);
    past_key_values: a ``DynamicMaskAttentionCache`` from ``init_cache`` for generation.
    Returns [B, S, hidden_size]; padding positions are 0.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, keep_window_size: int = 2048, is_causal: bool = True,
                 attention_bias: bool = False, rope_theta: float | None = 10000.0,
                 layer_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_attention_heads", num_attention_heads)
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        check_positive_int("num_key_value_heads", num_key_value_heads)
        check_divides("num_attention_heads", num_attention_heads, "num_key_value_heads", num_key_value_heads)
        if head_dim is None:
            check_divides("hidden_size", hidden_size, "num_attention_heads", num_attention_heads)
            head_dim = hidden_size // num_attention_heads
        check_positive_int("head_dim", head_dim)
        if head_dim % 8 or head_dim > 256:
            raise ValueError(f"head_dim: the kernels take a multiple of 8 up to 256, got {head_dim}")
        check_positive_int("keep_window_size", keep_window_size)
        if rope_theta is not None and not rope_theta > 0:
            raise ValueError(f"rope_theta: expected a positive rotary base or None, got {rope_theta!r}")
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.keep_window_size = keep_window_size
        self.is_causal = bool(is_causal)
        self.layer_idx = layer_idx
        self.scaling = head_dim ** -0.5
        factory = dict(device=device, dtype=dtype)
        q_width, kv_width = num_attention_heads * head_dim, num_key_value_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, q_width, bias=attention_bias, **factory)
        self.k_proj = nn.Linear(hidden_size, kv_width, bias=attention_bias, **factory)
        self.v_proj = nn.Linear(hidden_size, kv_width, bias=attention_bias, **factory)
        self.A = nn.Parameter(torch.zeros(num_key_value_heads, **factory))
        self.dt_proj = nn.Linear(kv_width, num_key_value_heads, bias=attention_bias, **factory)
        self.o_proj = nn.Linear(q_width, hidden_size, bias=attention_bias, **factory)
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rope_theta is not None else None

    # -- pieces -----------------------------------------------------------------------------------
    def _project(self, hidden_states: torch.Tensor, positions: torch.Tensor | None):
        """q [.., H, D], k, v [.., Hk, D] (rotated at positions) and the key scores delta [.., Hk]
        in fp32, for hidden_states [.., hidden_size]."""
        lead = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states).view(*lead, self.num_attention_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(*lead, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(*lead, self.num_key_value_heads, self.head_dim)
        if q.dtype not in HALF_DTYPES:
            raise TypeError(f"hidden_states: DynamicMaskAttention attends in fp16 or bf16, but the "
                            f"projections give {q.dtype}; cast the layer (.half() / .bfloat16()) or "
                            "run it under torch.autocast")
        if self.rotary is not None:
            cos, sin = self.rotary(positions)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        delta = torch.exp(self.A.float() * F.softplus(self.dt_proj(v.flatten(-2)).float()))
        return q, k, v, delta

    def _keep_mask(self, bias: torch.Tensor, seq_len: int, key_padding_mask=None):
        """The top-w keep-mask for a key-wise bias [N, Hk, 1, S], or None when every visible key
        is kept anyway."""
        if seq_len <= self.keep_window_size:
            return None
        if not self.is_causal:  # every query sees the same keys: one key-wise set
            return topk_mask_from_bias(bias, self.keep_window_size, key_padding_mask=key_padding_mask)
        # causal: query i keeps the top w among keys <= i (Doge's per-row mask)
        rows = []
        for start in range(0, seq_len, _MASK_ROW_CHUNK):
            stop = min(start + _MASK_ROW_CHUNK, seq_len)
            # the rows [start, stop) of the causal triangle are its bottom rows of a problem with
            # stop queries over stop keys; keys past stop are hidden from all of them
            block = bias[..., :stop].expand(-1, -1, stop - start, -1)
            kpm = None if key_padding_mask is None else key_padding_mask[:, :stop]
            kept = topk_mask_from_bias(block, self.keep_window_size, is_causal=True, key_padding_mask=kpm)
            rows.append(F.pad(kept, (0, seq_len - stop)))
        return torch.cat(rows, dim=2)

    def _scores_to_bias(self, delta: torch.Tensor) -> torch.Tensor:
        """[N, S, Hk] -> key-wise bias [N, Hk, 1, S]."""
        return delta.permute(0, 2, 1).unsqueeze(2)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None, past_key_values: "DynamicMaskAttentionCache | None" = None):
        check_hidden_states("hidden_states", hidden_states, self.hidden_size)
        batch, seq_len, _ = hidden_states.shape
        device = hidden_states.device
        if past_key_values is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: not supported together with past_key_values")
            return self._forward_cached(hidden_states, attention_mask, past_key_values)
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("attention_mask, cu_seqlens: give one of them (padding, or packed sequences)")
        if position_ids is not None and position_ids.shape != (batch, seq_len):
            raise ValueError(f"position_ids: expected shape [{batch}, {seq_len}], got {tuple(position_ids.shape)}")
        if cu_seqlens is not None:
            check_cu_seqlens_arg(cu_seqlens, batch, device)
            if max_seqlen is None:
                raise ValueError("max_seqlen: required with cu_seqlens (a host int bound on every length)")
            check_positive_int("max_seqlen", max_seqlen)
            packing = packing_from_cu_seqlens(cu_seqlens, seq_len, max_seqlen)
            out = self._forward_packed(hidden_states[0], packing, None if position_ids is None else position_ids[0])
            return out.unsqueeze(0)
        if attention_mask is not None:
            check_padding_mask(attention_mask, batch, seq_len, device)
            packing = packing_from_padding_mask(attention_mask)
            positions = None if position_ids is None else packing.pack(position_ids)
            out = self._forward_packed(packing.pack(hidden_states), packing, positions)
            return packing.unpack(out)
        positions = position_ids if position_ids is not None else \
            torch.arange(seq_len, device=device).expand(batch, seq_len)
        q, k, v, delta = self._project(hidden_states, positions)
        bias = self._scores_to_bias(delta)
        out = flash_dma_func(q, k, v, attn_mask=self._keep_mask(bias, seq_len), attn_bias=bias,
                             is_causal=self.is_causal, softmax_scale=self.scaling)
        return self.o_proj(out.flatten(-2))

    def _forward_packed(self, tokens: torch.Tensor, packing: Packing, positions: torch.Tensor | None):
        """tokens [T, hidden] packed as `packing` says -> [T, hidden] (rows outside every
        sequence are 0)."""
        positions = packing.positions if positions is None else positions
        q, k, v, delta = (packing.guard(t) for t in self._project(tokens, positions))
        bias = self._scores_to_bias(packing.sequence_layout(delta))
        mask = self._keep_mask(bias, packing.max_seqlen, packing.key_padding_mask())
        out = flash_dma_varlen_func(q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_seqlen,
                                    packing.max_seqlen, attn_mask=mask, attn_bias=bias,
                                    is_causal=self.is_causal, softmax_scale=self.scaling)
        out = torch.where(packing.in_sequence.view(-1, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return self.o_proj(out.flatten(-2))

    # -- generation -------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None,
                   device=None) -> "DynamicMaskAttentionCache":
        """An empty KV cache for generating up to max_length tokens per row."""
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_length", max_length)
        weight = self.q_proj.weight
        dtype = dtype or (weight.dtype if weight.dtype in HALF_DTYPES else torch.float16)
        if dtype not in HALF_DTYPES:
            raise TypeError(f"dtype: the cache holds fp16 or bf16 keys and values, got {dtype}")
        return DynamicMaskAttentionCache(batch_size, max_length, self.num_key_value_heads, self.head_dim,
                                         dtype, device or weight.device)

    @torch.no_grad()
    def _forward_cached(self, hidden_states, attention_mask, cache: "DynamicMaskAttentionCache"):
        if not self.is_causal:
            raise ValueError("past_key_values: generation needs a causal layer (is_causal=True)")
        if not isinstance(cache, DynamicMaskAttentionCache):
            raise TypeError(f"past_key_values: expected a DynamicMaskAttentionCache (from init_cache), "
                            f"got {type(cache).__name__}")
        batch, seq_len, _ = hidden_states.shape
        if batch != cache.batch_size:
            raise ValueError(f"past_key_values: the cache holds {cache.batch_size} rows, hidden_states {batch}")
        if not cache.prefilled:
            return self._prefill(hidden_states, attention_mask, cache)
        if attention_mask is not None:
            raise ValueError("attention_mask: after the prefill every new token is a real token; "
                             "padding is given once, with the prompt")
        if seq_len > _MAX_DECODE_QUERIES:
            raise ValueError(f"hidden_states: at most {_MAX_DECODE_QUERIES} new tokens per decoding "
                             f"step, got {seq_len}")
        if cache.tokens_written + seq_len > cache.max_length:
            raise ValueError(f"past_key_values: {seq_len} more tokens overflow the cache's "
                             f"max_length {cache.max_length}")
        lengths = cache.cache_seqlens
        positions = lengths.long().view(-1, 1) + torch.arange(seq_len, device=lengths.device)
        q, k, v, delta = self._project(hidden_states, positions)
        # the new keys' scores go to their positions, then the keep-set takes them in
        cache.bias.scatter_(-1, positions.view(batch, 1, 1, seq_len).expand(-1, self.num_key_value_heads, -1, -1),
                            delta.permute(0, 2, 1).unsqueeze(2))
        update_topk_mask(cache.mask, cache.bias, lengths, self.keep_window_size, num_new=seq_len)
        out = flash_dma_with_kvcache(q, cache.k, cache.v, k=k, v=v, cache_seqlens=lengths,
                                     attn_mask=cache.mask, attn_bias=cache.bias, is_causal=True,
                                     softmax_scale=self.scaling)
        cache.cache_seqlens = lengths + seq_len
        cache.tokens_written += seq_len
        return self.o_proj(out.flatten(-2))

    def _prefill(self, hidden_states, attention_mask, cache):
        batch, seq_len, _ = hidden_states.shape
        if seq_len > cache.max_length:
            raise ValueError(f"hidden_states: a prompt of {seq_len} tokens does not fit the cache's "
                             f"max_length {cache.max_length}")
        if attention_mask is not None:
            check_padding_mask(attention_mask, batch, seq_len, hidden_states.device)
            real = attention_mask.bool()
        else:
            real = torch.ones(batch, seq_len, dtype=torch.bool, device=hidden_states.device)
        out = self.forward(hidden_states, attention_mask=attention_mask)
        # the cache holds each row's tokens from position 0 (left padding removed)
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
        positions = (real.long().cumsum(1) - 1).clamp(min=0)
        q, k, v, delta = self._project(hidden_states, positions)

        def rows(t):
            return t.gather(1, order.view(batch, seq_len, *([1] * (t.dim() - 2))).expand_as(t))

        lengths = real.sum(1, dtype=torch.int32)
        cache.k[:, :seq_len] = rows(k)
        cache.v[:, :seq_len] = rows(v)
        cache.bias[..., :seq_len] = self._scores_to_bias(rows(delta))
        filled = torch.arange(cache.max_length, device=lengths.device).view(1, -1) < lengths.view(-1, 1)
        # the keep-set of the next query: the top w of all cached keys
        cache.mask.copy_(topk_mask_from_bias(cache.bias, self.keep_window_size, key_padding_mask=filled))
        cache.cache_seqlens = lengths
        cache.tokens_written = seq_len
        cache.prefilled = True
        return out


class DynamicMaskAttentionCache:
    """One layer's KV cache for generation: keys, values, the key scores (the bias) and the
    top-w keep-set of the next query, per row. Made by ``DynamicMaskAttention.init_cache``; the
    first forward with it is the prompt (any length, padding allowed), each later one appends
    1 to 16 tokens per row."""

    def __init__(self, batch_size: int, max_length: int, num_key_value_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.batch_size = batch_size
        self.max_length = max_length
        shape = (batch_size, max_length, num_key_value_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.bias = torch.zeros((batch_size, num_key_value_heads, 1, max_length), dtype=torch.float32, device=device)
        self.mask = torch.zeros((batch_size, num_key_value_heads, 1, max_length), dtype=torch.bool, device=device)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.tokens_written = 0  # host count of positions used by the longest row: no read-back
        self.prefilled = False
