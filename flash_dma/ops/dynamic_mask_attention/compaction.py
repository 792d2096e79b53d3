"""Key-wise top-k masks served by compacted keys.

A key-wise mask ([B|1, Hk|1, 1, Sk], or H heads where H == Hk) that `topk_mask_from_bias` made
keeps exactly `keep` keys in every row, and that function remembers which (per mask object and
version, never across an in-place edit; an edit through `mask.data`, which bumps no version, is
not seen: make a new mask instead). Attention with such a mask is plain attention over
those keys: gathering K, V and the bias's entries at the kept positions gives a dense problem of
`keep` keys, which the dense kernels run at their full speed (on Hopper FA4's, where the
gathered-key walk of the Triton kernels pays for per-key gathers in every program). Autograd
through the gathers scatters dk, dv and dbias back into their own shapes.

Not for causal calls (positions matter there), varlen, deterministic mode (the scatters' order),
masks per query head under GQA (the gathered keys would differ within a head group), a bias with
full query rows that the gathers would expand over batch or heads (their backward would build
that expanded gradient in full), CUDA graph capture (the indices would replay unchanged), or
torch.compile (attention takes its custom op there). The
declared choice attention_keywise_compaction: "auto" (the default: where the CuTe backend can run
the dense call; 1.5x the walk on an H100), "on" (wherever it applies), "off" (always the walk).
"""
from __future__ import annotations

import torch

from ...runtime import profile
from ...runtime.config import choice, declare_choice
from ...runtime.hardware import device_info
from ...runtime.tensor_cache import TensorKeyedCache

declare_choice("attention_keywise_compaction", "auto", ("off", "on", "auto"),
               "a key-wise top-k mask from topk_mask_from_bias runs as dense attention over the "
               "gathered kept keys (compaction.py): off, on, or auto (where the CuTe backend "
               "runs the dense call)")

_KEPT_KEYS = TensorKeyedCache()
_KEY = ("kept keys",)


def remember_kept_keys(mask: torch.Tensor, kept: torch.Tensor) -> None:
    """kept: [mask's B, H, 1, keep] int64 key indices, each row's `keep` distinct keys (the
    positions where that row of mask is True), in any order (softmax does not see the order)."""
    _KEPT_KEYS.get(mask, _KEY, lambda: kept)


def kept_keys(mask) -> torch.Tensor | None:
    """The kept key indices remembered for this mask object at its current version, else None."""
    if not isinstance(mask, torch.Tensor):
        return None
    return _KEPT_KEYS.peek(mask, _KEY)


def _wanted(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    wanted = choice("attention_keywise_compaction").value
    if wanted != "auto":
        return wanted == "on"
    # auto: where the dense call runs on the CuTe backend (a 16-bit q and bias, a head dim FA4's
    # kernels take)
    from .cute import availability, plain, select
    return (select.requested_backend() != "triton" and q.dtype in plain.PLAIN_DTYPES
            and q.shape[-1] in plain.PLAIN_HEAD_DIMS and (bias is None or bias.dtype == q.dtype)
            and availability.cute_backend_status(q.device) is None)


def plan(q, k, mask, bias, is_causal: bool, deterministic: bool) -> torch.Tensor | None:
    """The kept key indices [Bm, Hm, w] where this call runs compacted, else None."""
    kept = kept_keys(mask)
    if kept is None or is_causal or deterministic:
        return None
    H, Hk, Sk = q.shape[2], k.shape[2], k.shape[1]
    if mask.shape[1] not in (1, Hk) or mask.shape[2] != 1 or mask.shape[3] != Sk:
        return None  # (a mask broadcast along keys keeps every key, not the remembered ones)
    if bias is not None:
        if bias.shape[-1] != Sk:
            return None
        batch, heads = max(bias.shape[0], mask.shape[0]), _compact_bias_heads(bias, mask, H)
        if bias.shape[2] > 1 and (bias.shape[0] < batch or bias.shape[1] < heads):
            # the gathers' backward would build the expanded bias's gradient in full
            return None
    if not _wanted(q, bias):
        return None
    if profile.active():
        profile.log_choice("attention", "keywise", "torch", device_info(q.device),
                           (("keep", kept.shape[-1]), ("Sk", k.shape[1]), ("H", H), ("Hk", Hk)),
                           "compacted", "choice")
    return kept[:, :, 0, :]


def _compact_bias_heads(bias: torch.Tensor, mask_or_kept: torch.Tensor, num_heads: int) -> int:
    """Heads of the gathered bias: the query heads for a bias per query head, else the mask's
    (kv heads or 1) or the bias's, whichever has more."""
    return num_heads if bias.shape[1] == num_heads else max(bias.shape[1], mask_or_kept.shape[1])


def compact(q, k, v, bias, kept: torch.Tensor):
    """(k, v, bias) gathered at the kept keys: k, v [B, w, Hk, D]; the bias over the same keys,
    with heads and batch as the mask and the bias need them (gradients flow back through the
    gathers into the originals)."""
    B, _, H, D = q.shape
    Hk, w = k.shape[2], kept.shape[-1]
    index = kept.expand(B, Hk, w).transpose(1, 2)  # [B, w, Hk]
    index = index.unsqueeze(-1).expand(B, w, Hk, D)
    k_kept, v_kept = k.gather(1, index), v.gather(1, index)
    if bias is None:
        return k_kept, v_kept, None
    Bb, Hb, Sb, _ = bias.shape
    heads = _compact_bias_heads(bias, kept, H)
    batch = max(Bb, kept.shape[0])
    key_index = kept
    if heads == H and kept.shape[1] == Hk and H != Hk:
        key_index = kept.repeat_interleave(H // Hk, dim=1)  # query head h reads kv head h // G
    key_index = key_index.unsqueeze(2).expand(batch, heads, Sb, w)
    bias_kept = bias.expand(batch, heads, Sb, bias.shape[-1]).gather(-1, key_index)
    return k_kept, v_kept, bias_kept


__all__ = ["remember_kept_keys", "kept_keys", "plan", "compact"]
