"""fp64 references of the layers in flash_dma.layers, written from the formulas, for the tests."""
import torch
import torch.nn.functional as F


def double_params(layer, dtype=torch.float64):
    """fp64 leaf copies of a layer's parameters, by name (gradients compare against the layer's).
    dtype: another precision, for an eager peer that shows how much error the dtype alone costs."""
    return {n: p.detach().to(dtype).requires_grad_() for n, p in layer.named_parameters()}


def rotate(x, positions, theta):
    """RoPE (half split) of x [B, S, H, D] at positions [B, S] (angles in fp64)."""
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D))
    ang = positions.double().unsqueeze(-1) * inv_freq
    ang = torch.cat([ang, ang], -1).unsqueeze(-2)
    x1, x2 = x.chunk(2, -1)
    return x * ang.cos().to(x.dtype) + torch.cat([-x2, x1], -1) * ang.sin().to(x.dtype)


def keep_mask(scores, keep, causal, key_ok=None):
    """Per-row top-keep keys of scores [B, Hk, S] among the visible ones -> [B, Hk, S, S] bool."""
    B, Hk, S = scores.shape
    visible = torch.ones(S, S, dtype=torch.bool, device=scores.device)
    if causal:
        visible = torch.tril(visible)
    visible = visible.expand(B, Hk, S, S)
    if key_ok is not None:
        visible = visible & key_ok[:, None, None, :]
    full = torch.where(visible, scores[:, :, None, :].expand(B, Hk, S, S), float("-inf"))
    kept = torch.zeros_like(visible)
    kept.scatter_(-1, full.topk(min(keep, S), -1).indices, True)
    return kept & visible


def attention(q, k, v, bias, allowed, scale):
    """softmax(scale q k^T + bias) v over allowed keys; q [B, S, H, D], k/v [B, S, Hk, D],
    bias/allowed [B, Hk, S|1, S]; rows with no key give 0."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    bias, allowed = bias.repeat_interleave(group, 1), allowed.repeat_interleave(group, 1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def dma_reference(layer, P, x, real=None, selection_scores=None, extras=None):
    """DynamicMaskAttention in fp64 with parameters P (or in P's dtype: the eager peer of a
    half-precision test). real: [B, S] padding mask (None: all real).
    selection_scores [B, S, Hk]: the scores that choose the kept keys (the layer's own, so that
    rounding cannot flip a choice at the top-w boundary); the bias itself is computed here."""
    B, S, _ = x.shape
    H, Hk, D = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    if real is None:
        real = torch.ones(B, S, dtype=torch.bool, device=x.device)
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    xd = x.to(P["q_proj.weight"].dtype)
    q = (xd @ P["q_proj.weight"].T).unflatten(-1, (H, D))
    k = (xd @ P["k_proj.weight"].T).unflatten(-1, (Hk, D))
    v = (xd @ P["v_proj.weight"].T).unflatten(-1, (Hk, D))
    if layer.rotary is not None:
        q, k = rotate(q, positions, layer.rotary.base), rotate(k, positions, layer.rotary.base)
    dt = F.softplus(v.flatten(-2) @ P["dt_proj.weight"].T)
    delta = torch.exp(P["A"] * dt)  # [B, S, Hk]
    if extras is not None:  # for gradient magnitudes: dL/dA = sum over keys of dL/ddelta * delta * dt
        delta.retain_grad()
        extras.update(delta=delta, dt=dt)
    chooser = delta.detach() if selection_scores is None else selection_scores.double()
    allowed = keep_mask(chooser.permute(0, 2, 1), layer.keep_window_size, layer.is_causal, real)
    out = attention(q, k, v, delta.permute(0, 2, 1).unsqueeze(2), allowed, layer.scaling)
    y = out.flatten(-2) @ P["o_proj.weight"].T
    return torch.where(real.unsqueeze(-1), y, 0.0)


def short_conv(x, weight, positions=None):
    """Causal depthwise conv + SiLU; x [B, T, D], weight [D, 1, W]; positions [B, T] restart it."""
    W = weight.shape[-1]
    T = x.shape[1]
    y = torch.zeros_like(x)
    for s in range(W):
        shifted = F.pad(x, (0, 0, s, 0))[:, :T]
        if positions is not None:
            shifted = shifted * (positions >= s).unsqueeze(-1)
        y = y + shifted * weight[:, 0, W - 1 - s]
    return F.silu(y)


def delta_rule(q, k, v, g, gk, beta, scale, state=None):
    """Token-by-token gated delta rule in fp64: q, k [B, T, H, K], v [B, T, HV, V], g [B, T, HV]
    or gk [B, T, HV, K], beta [B, T, HV]. Returns (o [B, T, HV, V], final state [B, HV, K, V])."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    S = torch.zeros(B, HV, K, V, dtype=torch.float64, device=q.device) if state is None else state.double()
    out = []
    for t in range(T):
        decay = gk[:, t].exp().unsqueeze(-1) if gk is not None else g[:, t].exp()[..., None, None]
        S = S * decay
        kt, vt, bt = k[:, t], v[:, t], beta[:, t][..., None]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * (vt - pred))
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(out, 1), S


def gated_norm(o, gate, weight, eps, activation):
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight
    if gate is None:
        return y
    return y * (torch.sigmoid(gate) if activation == "sigmoid" else F.silu(gate))


def delta_layer_reference(layer, P, x, real=None):
    """GatedDeltaNet / KimiDeltaAttention in fp64 (each row of x one sequence; real: right or left
    padding handled by running each row's tokens alone)."""
    from flash_dma.layers import KimiDeltaAttention
    if real is not None:
        rows = [delta_layer_reference(layer, P, x[b:b + 1, real[b]])[0] for b in range(x.shape[0])]
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for b, r in enumerate(rows):
            out[b, real[b]] = r
        return out
    xd = x.double()
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    lin = lambda name, t: t @ P[name + ".weight"].T + (P[name + ".bias"] if name + ".bias" in P else 0)
    q = short_conv(lin("q_proj", xd), P["q_conv1d.weight"]).unflatten(-1, (H, K))
    k = short_conv(lin("k_proj", xd), P["k_conv1d.weight"]).unflatten(-1, (H, K))
    v = short_conv(lin("v_proj", xd), P["v_conv1d.weight"]).unflatten(-1, (HV, V))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if isinstance(layer, KimiDeltaAttention):
        raw = lin("f_proj.1", lin("f_proj.0", xd)).unflatten(-1, (HV, K)) + P["dt_bias"].view(HV, K)
        rate = P["A_log"].exp().view(HV, 1)
        if layer.lower_bound is not None:
            gk = layer.lower_bound * torch.sigmoid(rate * raw)
        else:
            gk = -rate * F.softplus(raw)
        beta = torch.sigmoid(lin("b_proj", xd))
        g, gate, act = None, lin("g_proj.1", lin("g_proj.0", xd)), "sigmoid"
    else:
        g = -P["A_log"].exp() * F.softplus(lin("a_proj", xd) + P["dt_bias"])
        gk, beta = None, torch.sigmoid(lin("b_proj", xd))
        gate, act = (lin("g_proj", xd) if layer.use_gate else None), layer.o_norm.activation
    if layer.allow_neg_eigval:
        beta = beta * 2
    o, _ = delta_rule(q, k, v, g, gk, beta, K ** -0.5)
    if gate is not None:
        gate = gate.unflatten(-1, (HV, V))
    o = gated_norm(o, gate, P["o_norm.weight"], layer.o_norm.eps, act)
    return lin("o_proj", o.flatten(-2))
