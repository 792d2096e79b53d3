"""Plain PyTorch reference of the chunked gated delta rule, written from the spec (float64).

- gated_delta_rule_reference: the token-by-token recurrence (the definition of the op).
- bwd_dhu_reference: the state-gradient pass (bwd_dhu) as a direct loop over chunks.
- chunk_form_reference: the spec's chunk form (WY representation, v_new, per-chunk states), for
  checking the recurrence against it and for realistic inputs of the state-gradient pass.
- chunk_local_cumsum: gates as chunk-local cumulative sums, restarting at each chunk of each
  sequence.

Everything is differentiable, so tests take reference gradients with torch.autograd. For tests
only: one Python step per token.
"""
from __future__ import annotations

import torch

# Tokens per recomputed segment of the recurrence under autograd: only the state at segment ends
# is kept for the backward pass, so long sequences at real head sizes fit in memory.
_SEGMENT = 64


def _heads_to(t: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B, T, HV, ...]: value head i reads head i // (HV // H)."""
    if t is None or t.shape[2] == num_heads:
        return t
    assert num_heads % t.shape[2] == 0, "the value heads must be a multiple of the q/k heads"
    return t.repeat_interleave(num_heads // t.shape[2], dim=2)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _sequences(cu_seqlens, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return [(cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _cut(t, start, end):
    return None if t is None else t[:, start:end]


def _segment(state, q, k, v, g, gk, beta, scale):
    """The recurrence over a few tokens. state [B, HV, K, V]; q, k [B, L, HV, K]; v [B, L, HV, V];
    g, beta [B, L, HV] or g None; gk [B, L, HV, K] or None. Returns (o [B, L, HV, V], state)."""
    outs = []
    for t in range(q.shape[1]):
        if g is not None:
            state = state * torch.exp(g[:, t])[..., None, None]
        if gk is not None:
            state = state * torch.exp(gk[:, t])[..., None]
        k_t = k[:, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        u = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k_t[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], state))
    return torch.stack(outs, 1), state


class _RecomputedSegment(torch.autograd.Function):
    """_segment that keeps only its inputs for the backward pass and recomputes the rest there.

    (torch.utils.checkpoint would do, but it allocates a grad-requiring dummy with torch.empty,
    which the tests' NaN-poisoning fixture fills in place.)"""

    @staticmethod
    def forward(ctx, scale, *inputs):
        ctx.scale = scale
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return _segment(*inputs, scale)

    @staticmethod
    def backward(ctx, grad_o, grad_state):
        inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad)
                  for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            o, state = _segment(*inputs, ctx.scale)
            grads = iter(torch.autograd.grad((o, state), wanted, (grad_o, grad_state),
                                             allow_unused=True))
        return (None,) + tuple(next(grads) if t is not None and t.requires_grad else None
                               for t in inputs)


def _recurrence(state, q, k, v, g, gk, beta, scale):
    """_segment over the whole length, in recomputed segments when a gradient is wanted."""
    tensors = [t for t in (state, q, k, v, g, gk, beta) if t is not None]
    want_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not want_grad or q.shape[1] <= _SEGMENT:
        return _segment(state, q, k, v, g, gk, beta, scale)
    outs = []
    for s in range(0, q.shape[1], _SEGMENT):
        piece = [_cut(t, s, s + _SEGMENT) for t in (q, k, v, g, gk, beta)]
        o, state = _RecomputedSegment.apply(scale, state, *piece)
        outs.append(o)
    return torch.cat(outs, 1), state


def gated_delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm=False, cu_seqlens=None,
                               gk=None, dtype=torch.float64):
    """The spec's recurrence, token by token, in `dtype` (float64 by default).

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] raw per-token log decay, or None;
    gk [B, T, HV, K] raw per-token per-key log decay, or None; beta [B, T, HV];
    initial_state [N, HV, K, V] or None; cu_seqlens [N + 1] (B == 1) or None.
    Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None), both in `dtype`.
    """
    batch, seqlen, _, head_k = q.shape
    heads_v, head_v = v.shape[2], v.shape[3]
    if cu_seqlens is not None and batch != 1:
        raise ValueError("cu_seqlens needs B == 1")
    scale = head_k ** -0.5 if scale is None else scale
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q, k = _heads_to(q, heads_v), _heads_to(k, heads_v)
    v, beta = v.to(dtype), beta.to(dtype)
    g = None if g is None else g.to(dtype)
    gk = None if gk is None else gk.to(dtype)

    spans = _sequences(cu_seqlens, seqlen)
    n_states = len(spans) if cu_seqlens is not None else batch
    if initial_state is not None:
        h0 = initial_state.to(dtype)
        assert tuple(h0.shape) == (n_states, heads_v, head_k, head_v), "initial_state shape"
    else:
        h0 = torch.zeros(n_states, heads_v, head_k, head_v, dtype=dtype, device=q.device)

    if cu_seqlens is None:
        o, final = _recurrence(h0, q, k, v, g, gk, beta, scale)
    else:
        outs, finals = [], []
        for n, (start, end) in enumerate(spans):
            state = h0[n:n + 1]
            if end > start:
                piece = [_cut(t, start, end) for t in (q, k, v, g, gk, beta)]
                o_n, state = _recurrence(state, *piece, scale)
                outs.append(o_n)
            finals.append(state)
        o = torch.cat(outs, 1) if outs else v.new_zeros(1, 0, heads_v, head_v)
        final = torch.cat(finals, 0)
    return o, (final if output_final_state else None)


def chunk_local_cumsum(x: torch.Tensor, chunk_size: int = 64, cu_seqlens=None) -> torch.Tensor:
    """Cumulative sum along T (dim 1) that restarts at every chunk of every sequence.

    x [B, T, H] or [B, T, H, K]; the result has x's dtype (summed in float64)."""
    pieces = []
    for start, end in _sequences(cu_seqlens, x.shape[1]):
        for c in range(start, end, chunk_size):
            pieces.append(x[:, c:min(c + chunk_size, end)].double().cumsum(1))
    if not pieces:
        return x.clone()
    return torch.cat(pieces, 1).to(x.dtype)


def _chunk_spans(cu_seqlens, total: int, chunk_size: int) -> list[list[tuple[int, int]]]:
    """Per sequence, its chunks as (start, end) rows of the packed T axis."""
    return [[(c, min(c + chunk_size, end)) for c in range(start, end, chunk_size)]
            for start, end in _sequences(cu_seqlens, total)]


def bwd_dhu_reference(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None,
                      cu_seqlens=None, chunk_size=64, dtype=torch.float64):
    """The spec's state-gradient pass, chunk by chunk, in `dtype`.

    q, k, w [B, T, H|HV, K]; do, dv [B, T, HV, V]; g [B, T, HV] and gk [B, T, HV, K] chunk-local
    cumulative sums (or None); h0 only says whether dh0 is wanted; dht [N, HV, K, V] or None.
    Returns (dh [B, NT, HV, K, V], dh0 [N, HV, K, V] or None, dv2 [B, T, HV, V]).
    """
    batch, seqlen, _, head_k = q.shape
    heads_v, head_v = do.shape[2], do.shape[3]
    scale = head_k ** -0.5 if scale is None else scale
    q, k, w = (_heads_to(t.to(dtype), heads_v) for t in (q, k, w))
    do, dv = do.to(dtype), dv.to(dtype)
    g = None if g is None else g.to(dtype)
    gk = None if gk is None else gk.to(dtype)
    seqs = _chunk_spans(cu_seqlens, seqlen, chunk_size)
    n_states = len(seqs) if cu_seqlens is not None else batch
    dhs, dh0s, dv2_pieces = [], [], {}
    for n, chunks in enumerate(seqs):
        rows = slice(n, n + 1) if cu_seqlens is not None else slice(None)
        if dht is not None:
            state_grad = dht[rows].to(dtype)
        else:
            state_grad = torch.zeros(n_states, heads_v, head_k, head_v, dtype=dtype,
                                     device=q.device)[rows]
        seq_dh = []
        for start, end in reversed(chunks):
            seq_dh.append(state_grad)
            qc, kc, wc = q[:, start:end], k[:, start:end], w[:, start:end]  # [B, C, HV, K]
            doc, dvc = do[:, start:end], dv[:, start:end]                    # [B, C, HV, V]
            dv2 = dvc + torch.einsum("bchk,bhkv->bchv", kc, state_grad) * (
                torch.exp(g[:, end - 1:end] - g[:, start:end])[..., None] if g is not None else 1.0)
            decay = torch.ones(state_grad.shape[:-1], dtype=dtype, device=q.device)  # [B, HV, K]
            if g is not None:
                decay = decay * torch.exp(g[:, end - 1])[..., None]
                qc = qc * torch.exp(g[:, start:end])[..., None]
            if gk is not None:
                decay = decay * torch.exp(gk[:, end - 1])
            state_grad = (decay[..., None] * state_grad
                          + scale * torch.einsum("bchk,bchv->bhkv", qc, doc)
                          - torch.einsum("bchk,bchv->bhkv", wc, dv2))
            dv2_pieces[start] = dv2
        dhs.extend(reversed(seq_dh))
        dh0s.append(state_grad)
    if dhs:
        dh = torch.stack(dhs, 1)
    else:
        dh = torch.zeros(batch, 0, heads_v, head_k, head_v, dtype=dtype, device=q.device)
    dv2 = (torch.cat([dv2_pieces[s] for s in sorted(dv2_pieces)], 1) if dv2_pieces
           else dv.clone())
    dh0 = torch.cat(dh0s, 0) if h0 is not None else None
    return dh, dh0, dv2


def chunk_form_reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                         gk=None, chunk_size=64, state_probe=None, v_new_probe=None,
                         dtype=torch.float64):
    """The spec's chunk form, chunk by chunk, in `dtype`, with its intermediates.

    Inputs as gated_delta_rule_reference (raw per-token gates; no l2norm). With the total per-key
    chunk-local gate G = g_cum + gk_cum, per chunk:
        A     = (I + StrictTril(diag(beta) (K e^G)(K e^-G)^T))^-1
        w     = A diag(beta) (K e^G),  u = A diag(beta) V,  v_new = u - w h
        o     = scale (Q e^G) h + scale Tril((Q e^G)(K e^-G)^T) v_new
        h_end = diag(e^G_last) h + (K e^(G_last - G))^T v_new
    Returns a dict of [B, T, ...] tensors (value heads): o, w, u, v_new, g_cum, gk_cum, and what the
    state-gradient pass takes with gk (q_gated = q e^gk_cum, k_gated = k e^(gk_last - gk_cum));
    h [B, NT, HV, K, V] (state at each chunk's start), h_end (state at each chunk's end, same shape),
    final_state [N, HV, K, V].
    state_probe [B, NT, HV, K, V] (zeros, say) is added to each chunk's end state: the gradient
    that reaches it is the gradient of the state at that chunk's end, which bwd_dhu returns as dh;
    v_new_probe [B, T, HV, V] is added to v_new likewise (its gradient: bwd_dhu's dv2).
    """
    batch, seqlen, _, head_k = q.shape
    heads_v, head_v = v.shape[2], v.shape[3]
    scale = head_k ** -0.5 if scale is None else scale
    q, k = (_heads_to(t.to(dtype), heads_v) for t in (q, k))
    v, beta = v.to(dtype), beta.to(dtype)
    zeros_g = torch.zeros(batch, seqlen, heads_v, dtype=dtype, device=q.device)
    g_cum = chunk_local_cumsum(zeros_g if g is None else g.to(dtype), chunk_size, cu_seqlens)
    gk_cum = (None if gk is None else chunk_local_cumsum(gk.to(dtype), chunk_size, cu_seqlens))
    seqs = _chunk_spans(cu_seqlens, seqlen, chunk_size)
    n_states = len(seqs) if cu_seqlens is not None else batch
    if initial_state is None:
        initial_state = torch.zeros(n_states, heads_v, head_k, head_v, dtype=dtype,
                                    device=q.device)
    pieces = {name: {} for name in ("o", "w", "u", "v_new", "q_gated", "k_gated")}
    h_list, h_end_list, finals = [], [], []
    for n, chunks in enumerate(seqs):
        state = initial_state[n:n + 1].to(dtype) if cu_seqlens is not None else initial_state.to(dtype)
        for start, end in chunks:
            size = end - start
            qc, kc, vc, bc = (t[:, start:end].transpose(1, 2) for t in (q, k, v, beta))
            # [B, HV, C, K|V], beta [B, HV, C]
            gate = g_cum[:, start:end].transpose(1, 2)[..., None]  # [B, HV, C, 1]
            if gk_cum is not None:
                gate = gate + gk_cum[:, start:end].transpose(1, 2)
            gate_last = gate[:, :, -1:]
            k_up, k_down, q_up = kc * torch.exp(gate), kc * torch.exp(-gate), qc * torch.exp(gate)
            strict = torch.tril(torch.ones(size, size, dtype=torch.bool, device=q.device), -1)
            lower = torch.tril(torch.ones(size, size, dtype=torch.bool, device=q.device))
            eye = torch.eye(size, dtype=dtype, device=q.device)
            m = eye + (bc[..., None] * (k_up @ k_down.transpose(-1, -2))) * strict
            a_inv = torch.linalg.solve_triangular(m, eye.expand_as(m).contiguous(), upper=False,
                                                  unitriangular=True)
            w = a_inv @ (bc[..., None] * k_up)
            u = a_inv @ (bc[..., None] * vc)
            h_list.append(state)
            v_new = u - w @ state
            if v_new_probe is not None:
                v_new = v_new + v_new_probe[:, start:end].transpose(1, 2).to(dtype)
            o = scale * (q_up @ state) + scale * ((q_up @ k_down.transpose(-1, -2)) * lower) @ v_new
            state = torch.exp(gate_last).transpose(-1, -2) * state \
                + (kc * torch.exp(gate_last - gate)).transpose(-1, -2) @ v_new
            if state_probe is not None:
                state = state + state_probe[:, len(h_end_list)].to(dtype)
            h_end_list.append(state)
            gk_c = (gk_cum[:, start:end].transpose(1, 2) if gk_cum is not None
                    else torch.zeros_like(qc))
            for name, value in (("o", o), ("w", w), ("u", u), ("v_new", v_new),
                                ("q_gated", qc * torch.exp(gk_c)),
                                ("k_gated", kc * torch.exp(gk_c[:, :, -1:] - gk_c))):
                pieces[name][start] = value.transpose(1, 2)
        finals.append(state)
    result = {}
    for name, parts in pieces.items():
        result[name] = (torch.cat([parts[s] for s in sorted(parts)], 1) if parts else
                        q.new_zeros(batch, 0, heads_v, head_v if name in ("o", "u", "v_new")
                                    else head_k))
    empty = q.new_zeros(batch, 0, heads_v, head_k, head_v)
    result["h"] = torch.stack(h_list, 1) if h_list else empty
    result["h_end"] = torch.stack(h_end_list, 1) if h_end_list else empty
    result["final_state"] = torch.cat(finals, 0) if cu_seqlens is not None else finals[0]
    result["g_cum"], result["gk_cum"] = g_cum, gk_cum
    return result
