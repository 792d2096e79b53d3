"""Keeping a key-wise top-w mask up to date while decoding, without re-sorting the cache.

In a Doge-style layer the bias of a key is computed once, from that key's own value states, and
never changes afterwards. If a mask holds the w largest biases among the first L keys, then the
w largest among the first L + 1 are that set plus the new key, less its smallest member: every
key outside the set already has w keys above it. So a step only needs the new key's bias and
the smallest bias in the kept set (an O(S) masked minimum, no sort), and the kept set changes
by at most one key in and one key out per new token.
"""
from __future__ import annotations

import torch

from ...runtime.validation import check_tensor


@torch.no_grad()
def update_topk_mask(mask: torch.Tensor, bias: torch.Tensor, new_positions, keep: int,
                     num_new: int = 1) -> torch.Tensor:
    """Update a key-wise top-`keep` mask in place for new keys, and return it.

    mask: bool [B|1, Hm, 1, S_max], the top-`keep` keys by bias among each row's first keys
    (topk_mask_from_bias on the prefix, or the result of earlier updates; False past the prefix).
    bias: [B|1, Hm, 1, S_max] (any broadcastable batch), holding the new keys' biases already.
    new_positions: int tensor [B] or Python int, the position of the first new key of each batch
    row (cache_seqlens before the append); keys new_positions .. + num_new - 1 (each below S_max)
    are added, one at a time. Device-side torch ops only: no host synchronisation, CUDA-graph capturable.
    Ties between equal biases may resolve differently from a full top-k.
    """
    check_tensor("mask", mask, dims=4, dtypes=(torch.bool,))
    check_tensor("bias", bias, dims=4)
    if mask.shape[2] != 1 or bias.shape[2] != 1:
        raise ValueError(f"mask, bias: expected key-wise shapes [B, H, 1, S_max], got "
                         f"{tuple(mask.shape)} and {tuple(bias.shape)}")
    if bias.shape[1] != mask.shape[1] or bias.shape[3] != mask.shape[3] \
            or bias.shape[0] not in (1, mask.shape[0]):
        raise ValueError(f"bias: expected shape [{mask.shape[0]}|1, {mask.shape[1]}, 1, "
                         f"{mask.shape[3]}] like mask, got {tuple(bias.shape)}")
    if keep < 1:
        raise ValueError(f"keep: expected a positive number of keys, got {keep}")
    batch, heads, _, seqlen = mask.shape
    if isinstance(new_positions, int):
        positions = torch.full((batch,), new_positions, device=mask.device, dtype=torch.int64)
    else:
        check_tensor("new_positions", new_positions, dims=1)
        if new_positions.shape[0] not in (1, batch):
            raise ValueError(f"new_positions: expected shape [{batch}], got {tuple(new_positions.shape)}")
        positions = new_positions.to(mask.device, torch.int64).expand(batch)
    score = bias.detach().float().expand(batch, heads, 1, seqlen)
    for step in range(num_new):
        pos = (positions + step).clamp(0, seqlen - 1).view(batch, 1, 1, 1).expand(batch, heads, 1, 1)
        new_score = score.gather(-1, pos)
        kept_scores = torch.where(mask, score, float("inf"))
        weakest, weakest_at = kept_scores.min(-1, keepdim=True)
        full = mask.sum(-1, keepdim=True) >= keep
        enters = ~full | (new_score > weakest)
        leaves = full & enters
        # the weakest leaves first: when the set is not full it is not touched
        mask.scatter_(-1, weakest_at, mask.gather(-1, weakest_at) & ~leaves)
        mask.scatter_(-1, pos, mask.gather(-1, pos) | enters)
    return mask
