"""Gated DeltaNet and Kimi Delta Attention layers over chunk_gated_delta_rule.

Parameter names and shapes follow flash-linear-attention's `fla.layers.GatedDeltaNet` and
`fla.layers.KimiDeltaAttention` (q_proj, k_proj, v_proj, a_proj / f_proj, b_proj, A_log,
dt_bias, q_conv1d / k_conv1d / v_conv1d, g_proj, o_norm, o_proj), so a state_dict moves between
them unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import chunk_gated_delta_rule
from ._common import (check_cu_seqlens_arg, check_hidden_states, check_padding_mask, check_positive_int,
                      packing_from_cu_seqlens, packing_from_padding_mask)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time followed by SiLU (weight [D, 1, W], as
    nn.Conv1d(D, D, W, groups=D)). Packed sequences do not see each other: a tap that reaches
    before the start of its token's sequence reads 0."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu",
                 device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                         padding=kernel_size - 1, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
        self.activation = activation

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D]; positions [B, T] or [T] (position of each token in its sequence; None:
        one sequence per row); state [B, W - 1, D], the previous inputs (None: zeros).
        Returns (y [B, T, D], the new state: the last W - 1 inputs)."""
        width = self.kernel_size[0]
        batch, length, dim = x.shape
        if state is None:
            state = x.new_zeros(batch, width - 1, dim)
        history = torch.cat([state.to(x.dtype), x], dim=1)
        weight = self.weight[:, 0, :]  # [D, W]; tap W - 1 is the current token
        y = None
        for shift in range(width):
            tap = history[:, width - 1 - shift: width - 1 - shift + length] * weight[:, width - 1 - shift]
            if positions is not None and shift:
                tap = torch.where((positions >= shift).unsqueeze(-1), tap, torch.zeros((), dtype=tap.dtype, device=tap.device))
            y = tap if y is None else y + tap
        if self.bias is not None:
            y = y + self.bias
        if self.activation is not None:
            y = F.silu(y)
        return y, history[:, history.shape[1] - (width - 1):]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (in fp32) times weight, times activation(gate) when a gate is
    given: FLA's FusedRMSNormGated ('swish' or 'sigmoid'), or its RMSNorm without a gate."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "swish", device=None, dtype=None):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"activation: expected 'swish' or 'sigmoid', got {activation!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        if gate is not None:
            g32 = gate.float()
            y = y * (torch.sigmoid(g32) if self.activation == "sigmoid" else F.silu(g32))
        return y.to(x.dtype)


class LinearAttentionState:
    """One layer's state for generation: the short convolutions' last inputs and the
    recurrent state [B, HV, K, V] (fp32). Made by the layer's ``init_state``."""

    def __init__(self):
        self.conv_states: tuple[torch.Tensor | None, ...] = (None, None, None)
        self.recurrent_state: torch.Tensor | None = None
        self.tokens_seen = 0


class _DeltaRuleLayer(nn.Module):
    """What GatedDeltaNet and KimiDeltaAttention share: projections, convolutions, padding and
    packing, the recurrent state, the output norm. Subclasses give the gates."""

    def _init_common(self, hidden_size, expand_v, head_dim, num_heads, num_v_heads, use_short_conv,
                     allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps, disable_recompute):
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("head_dim", head_dim)
        check_positive_int("num_heads", num_heads)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        check_positive_int("num_v_heads", num_v_heads)
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: {num_v_heads} is not a multiple of num_heads={num_heads}")
        if not expand_v > 0:
            raise ValueError(f"expand_v: expected a positive ratio, got {expand_v!r}")
        head_v_dim = head_dim * expand_v
        if not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5):
            raise ValueError(f"expand_v: head_dim * expand_v = {head_v_dim} is not an integer")
        if head_dim > 256 or round(head_v_dim) > 256:
            raise ValueError(f"head_dim: the kernels take key and value head dims up to 256, got "
                             f"{head_dim} and {round(head_v_dim)}")
        check_positive_int("conv_size", conv_size)
        if not norm_eps > 0:
            raise ValueError(f"norm_eps: expected a positive epsilon, got {norm_eps!r}")
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.head_dim = self.head_k_dim = head_dim
        self.head_v_dim = int(round(head_v_dim))
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        # the op's disable_recompute (FLA chunk_kda's option): a faster backward for the forward's
        # per-chunk states held until it runs
        self.disable_recompute = bool(disable_recompute)
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.layer_idx = layer_idx

    def _make_convs(self, factory):
        if self.use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, **factory)
            self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias, **factory)
            self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size, bias=self.conv_bias, **factory)

    def init_state(self) -> LinearAttentionState:
        """An empty state for generation (pass it as past_key_values; it is updated in place)."""
        return LinearAttentionState()

    def _qkv(self, x, positions, state):
        projections = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if not self.use_short_conv:
            return [F.silu(p) for p in projections], (None, None, None)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        previous = state.conv_states if state is not None else (None, None, None)
        results = [conv(p, positions, prev) for conv, p, prev in zip(convs, projections, previous)]
        return [r[0] for r in results], tuple(r[1] for r in results)

    def _gates(self, x):
        """(g [.., HV] or None, gk [.., HV, K] or None, beta [.., HV])."""
        raise NotImplementedError

    def _output_gate(self, x):
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None,
                past_key_values: LinearAttentionState | None = None) -> torch.Tensor:
        """hidden_states [B, T, hidden_size] (fp32, fp16 or bf16); attention_mask [B, T] padding
        mask (1 = token, any side padded) or cu_seqlens (int32 [N + 1]) for sequences packed
        along dim 1 (B = 1); past_key_values: a state from init_state for generation (no padding
        or packing), updated in place. Returns [B, T, hidden_size]; padding positions are 0."""
        check_hidden_states("hidden_states", hidden_states, self.hidden_size)
        batch, length, _ = hidden_states.shape
        device = hidden_states.device
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("attention_mask, cu_seqlens: give one of them (padding, or packed sequences)")
        if past_key_values is not None and (attention_mask is not None or cu_seqlens is not None):
            raise ValueError("past_key_values: generation state works on unpadded batches; pass no "
                             "attention_mask or cu_seqlens with it")
        if past_key_values is not None and not isinstance(past_key_values, LinearAttentionState):
            raise TypeError(f"past_key_values: expected a LinearAttentionState (from init_state), got "
                            f"{type(past_key_values).__name__}")
        packing = None
        if attention_mask is not None:
            check_padding_mask(attention_mask, batch, length, device)
            packing = packing_from_padding_mask(attention_mask)
            x = packing.pack(hidden_states).unsqueeze(0)
        elif cu_seqlens is not None:
            check_cu_seqlens_arg(cu_seqlens, batch, device)
            packing = packing_from_cu_seqlens(cu_seqlens, length, length)
            x = hidden_states
        else:
            x = hidden_states
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"hidden_states: expected fp32, fp16 or bf16, got {x.dtype}")
        positions = packing.positions.unsqueeze(0) if packing is not None else None
        (q, k, v), conv_states = self._qkv(x, positions, past_key_values)
        q = q.unflatten(-1, (self.num_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        g, gk, beta = self._gates(x)
        if packing is not None:
            q, k, v, beta = (packing.guard(t, dim=1) for t in (q, k, v, beta))
            g = None if g is None else packing.guard(g, dim=1)
            gk = None if gk is None else packing.guard(gk, dim=1)
        initial = past_key_values.recurrent_state if past_key_values is not None else None
        o, final = chunk_gated_delta_rule(
            q, k, v, g, beta.to(q.dtype), initial_state=initial, output_final_state=past_key_values is not None,
            use_qk_l2norm_in_kernel=True, cu_seqlens=None if packing is None else packing.cu_seqlens, gk=gk,
            disable_recompute=self.disable_recompute)
        if past_key_values is not None:
            past_key_values.recurrent_state = final
            past_key_values.conv_states = conv_states
            past_key_values.tokens_seen += length
        o = self.o_norm(o, self._output_gate(x))
        o = self.o_proj(o.flatten(-2))
        if attention_mask is not None:
            return packing.unpack(o[0])
        if packing is not None:  # rows past the last offset belong to no sequence
            o = torch.where(packing.in_sequence.view(1, -1, 1), o, torch.zeros((), dtype=o.dtype, device=o.device))
        return o


class GatedDeltaNet(_DeltaRuleLayer):
    r"""Gated DeltaNet (Yang et al., arXiv 2412.06464) with FLA's parameters.

    Per value head, with a scalar decay :math:`\alpha_t = e^{g_t}` and write strength
    :math:`\beta_t`:

    .. math::
        S_t = \alpha_t S_{t-1} (I - \beta_t k_t k_t^\top) + \beta_t v_t k_t^\top,\qquad
        o_t = S_t q_t / \sqrt{d_k},

    where q, k (l2-normalised) and v come from short causal convolutions (SiLU) of their
    projections, :math:`g_t = -e^{A_{\log}}\,\mathrm{softplus}(x_t W_a + \mathrm{dt\_bias})`,
    :math:`\beta_t = \sigma(x_t W_b)` (twice that with allow_neg_eigval), and the output is
    RMS-normalised, gated by :math:`\mathrm{SiLU}(x_t W_g)` (use_gate; output_gate_activation
    'sigmoid' for a sigmoid gate) and projected by o_proj. Arguments and defaults as FLA 0.6's
    fla.layers.GatedDeltaNet (mode: 'chunk' only), plus disable_recompute (chunk_gated_delta_rule's:
    the backward reuses the forward's per-chunk states where the forward writes them).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int | None = None, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", disable_recompute: bool = False, device=None, dtype=None,
                 **kwargs):
        super().__init__()
        if mode != "chunk":
            raise ValueError(f"mode: only 'chunk' is implemented, got {mode!r}")
        if kwargs:
            raise TypeError(f"GatedDeltaNet: unexpected arguments {sorted(kwargs)}")
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation: expected 'swish', 'silu' or 'sigmoid', got "
                             f"{output_gate_activation!r}")
        self._init_common(hidden_size, expand_v, head_dim, num_heads, num_v_heads, use_short_conv,
                          allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps, disable_recompute)
        self.mode = mode
        self.use_gate = use_gate
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **factory)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **factory)
        # Mamba-2 style: A uniform in (0, 16), dt log-uniform in [1e-3, 0.1] (softplus inverted)
        A = torch.empty(self.num_v_heads, dtype=torch.float32, device=device).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.dt_bias = nn.Parameter(_inverse_softplus_dt(self.num_v_heads, device))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self._make_convs(factory)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation=output_gate_activation, **factory)
        else:
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, device=device, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)

    def _gates(self, x):
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return g, None, beta

    def _output_gate(self, x):
        if not self.use_gate:
            return None
        return self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))


class KimiDeltaAttention(_DeltaRuleLayer):
    r"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692): the gated delta rule with a decay
    per key channel, with FLA 0.6's parameters (fla.layers.KimiDeltaAttention; gates per value
    head, so grouped value heads need no repeat).

    .. math::
        S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{Diag}(e^{g_t})\, S_{t-1} + \beta_t k_t v_t^\top,

    with the per-channel log decay from the low-rank projection f_proj. With lower_bound=b the
    gate is bounded, :math:`g_t = b\,\sigma(e^{A_{\log}} (x_t W_f + \mathrm{dt\_bias}))` in (b, 0)
    (Kimi Linear's safe gate); with None it is
    :math:`g_t = -e^{A_{\log}}\,\mathrm{softplus}(x_t W_f + \mathrm{dt\_bias})`, unbounded.
    Unlike FLA (default None) the default here is b = -5: the chunked kernels need per-token
    decays above about -10. beta = sigmoid(b_proj(x)) (twice that with allow_neg_eigval); the
    output is RMS-normalised and gated by sigmoid(g_proj(x)). safe_gate (FLA's flag that b is
    set) only starts A_log at 0, as FLA does. disable_recompute: chunk_kda's option, passed to
    chunk_gated_delta_rule (the backward reuses the forward's per-chunk states).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = -5.0,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None,
                 norm_eps: float = 1e-5, disable_recompute: bool = False, device=None, dtype=None, **kwargs):
        super().__init__()
        if mode != "chunk":
            raise ValueError(f"mode: only 'chunk' is implemented, got {mode!r}")
        if kwargs:
            raise TypeError(f"KimiDeltaAttention: unexpected arguments {sorted(kwargs)}")
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"lower_bound: expected a negative bound (log space) or None, got {lower_bound!r}")
        if safe_gate and lower_bound is None:
            raise ValueError("lower_bound: safe_gate=True needs a lower bound")
        self._init_common(hidden_size, expand_v, head_dim, num_heads, num_v_heads, use_short_conv,
                          allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps, disable_recompute)
        self.mode = mode
        self.safe_gate = safe_gate
        self.lower_bound = lower_bound
        self.gate_dim = self.num_v_heads * self.head_k_dim
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
        self._make_convs(factory)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False, **factory),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False, **factory))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **factory)
        if safe_gate:
            A_log = torch.zeros(self.num_v_heads, dtype=torch.float32, device=device)
        else:
            A_log = torch.empty(self.num_v_heads, dtype=torch.float32, device=device).uniform_(1, 16).log()
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(_inverse_softplus_dt(self.gate_dim, device))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False, **factory),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True, **factory))
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="sigmoid", **factory)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)

    def _gates(self, x):
        raw = self.f_proj(x).float().unflatten(-1, (self.num_v_heads, self.head_k_dim)) \
            + self.dt_bias.float().view(self.num_v_heads, self.head_k_dim)
        rate = self.A_log.float().exp().view(self.num_v_heads, 1)
        if self.lower_bound is not None:
            gk = self.lower_bound * torch.sigmoid(rate * raw)
        else:
            gk = -rate * F.softplus(raw)
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return None, gk, beta

    def _output_gate(self, x):
        return self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))


def _inverse_softplus_dt(size: int, device) -> torch.Tensor:
    """Mamba-2's dt initialisation: dt log-uniform in [1e-3, 0.1], stored as softplus^-1(dt)."""
    dt = torch.exp(torch.rand(size, device=device) * (math.log(0.1) - math.log(1e-3))
                   + math.log(1e-3)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))
