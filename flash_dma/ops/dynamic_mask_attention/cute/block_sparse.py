"""FA4's block-sparse tile lists, made from our keep-mask, so that the CuTe kernels skip the
mask's empty tiles in the forward and in the backward.

The lists are the Triton backend's (sparsity.plan_key_walk, remembered per mask by
cached_key_walk): per query block (forward) or key block (backward) the tiles holding a kept
entry, ascending, split into full tiles (every entry kept and visible: FA4 skips the mask_mod)
and partial ones, with bottom-right causal and ragged ends folded in. Here they are only
re-laid-out for FA4 (BlockSparseTensorsTorch: "mask" = partial, "full" = full; counts
[B, H, rows], indices [B, H, rows, n]) on the device, with fixed shapes: no host sync.

Tile sizes: 128 query rows per list row in both passes, and FA4's own SM90 key tile (forward:
its tile_n with a 128-row query block; backward: its tile_n when block-sparse), so that one
listed tile is one FA4 tile along keys. FA4 walks each list from its last entry, so ascending
lists put the ragged last key tile first, which is the tile FA4 masks for length.

Compile keys: FA4 keys its kernels on which list dims have stride 0. A list shared across
batches or heads (mask dim 1) is given stride 0 there even when that dim has size 1, so the key
depends on the mask's broadcast shape, never on B, H or the lengths.
"""
from __future__ import annotations

import functools

import torch

from ....runtime.config import ceil_div
from .. import sparsity

# Query rows per list row, forward and backward (FA4's SM90 tiles divide it: 128 forward, 64 or
# 128 backward).
SPARSE_BLOCK_Q = 128


@functools.lru_cache(maxsize=1)
def _fa4_block_types():
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _tile_size_bwd_sm90, _tile_size_fwd_sm90
    return BlockSparseTensorsTorch, _tile_size_fwd_sm90, _tile_size_bwd_sm90


def forward_block_kv(head_dim: int) -> int:
    """Keys per listed tile in FA4's SM90 forward with 128-row sparse query blocks."""
    _, fwd_tile, _ = _fa4_block_types()
    return fwd_tile(head_dim, head_dim, False, False, sparse_block_size_q=SPARSE_BLOCK_Q).n_block_size


def backward_block_kv(head_dim: int) -> int:
    """Keys per listed tile in FA4's SM90 backward (causal off: a mask_mod carries it)."""
    _, _, bwd_tile = _fa4_block_types()
    return bwd_tile(head_dim, head_dim, False, False, sparse_block_size_q=SPARSE_BLOCK_Q).n_block_size


def _shared_stride0(t: torch.Tensor, shared: tuple[bool, bool], full: tuple[int, int]) -> torch.Tensor:
    """t [Bl, Hl, ...] as [B, H, ...] with stride 0 along each shared dim (also where B or H is 1)."""
    size = list(t.shape)
    stride = list(t.stride())
    for dim in (0, 1):
        if shared[dim]:
            size[dim], stride[dim] = full[dim], 0
    return t.as_strided(size, stride, t.storage_offset())


def block_lists(mask: torch.Tensor, *, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                is_causal: bool, block_kv: int, key_major: bool):
    """BlockSparseTensorsTorch for a [B|1, H|Hk|1, Sq|1, Sk|1] bool mask (fixed lengths):
    query-major (forward) or key-major (backward), block size (128, block_kv). Remembered with
    the mask's walk (sparsity.cached_key_walk), so a mask used again costs no launch here."""
    walk = _walk(mask, num_heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                 is_causal=is_causal, block_kv=block_kv, key_major=key_major)
    key = ("fa4", batch, num_heads, seqlen_q, seqlen_k, block_kv, key_major)
    lists = walk.derived.get(key)
    if lists is None:  # once per mask (and shape): later calls launch nothing here
        BlockSparseTensorsTorch = _fa4_block_types()[0]
        lists = BlockSparseTensorsTorch(
            **_fa4_layout(walk, mask.device, batch=batch, num_heads=num_heads, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, block_kv=block_kv, key_major=key_major),
            block_size=(SPARSE_BLOCK_Q, block_kv))
        walk.derived[key] = lists
    return lists


def _walk(mask, *, num_heads, seqlen_q, seqlen_k, is_causal, block_kv, key_major):
    return sparsity.cached_key_walk(
        mask, sparsity.KV_BLOCK_LIST, num_heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        is_causal=is_causal, cu_seqlens_q=None, cu_seqlens_k=None, block_m=SPARSE_BLOCK_Q,
        block_n=block_kv, key_major=key_major, device=mask.device)


def tile_lists(mask: torch.Tensor, *, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
               is_causal: bool, block_kv: int, key_major: bool) -> dict[str, torch.Tensor]:
    """The four tensors of `block_lists` (FA4's field names), in torch alone."""
    walk = _walk(mask, num_heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                 is_causal=is_causal, block_kv=block_kv, key_major=key_major)
    return _fa4_layout(walk, mask.device, batch=batch, num_heads=num_heads, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, block_kv=block_kv, key_major=key_major)


def _fa4_layout(walk, device, *, batch, num_heads, seqlen_q, seqlen_k, block_kv, key_major):
    count, index = walk.count, walk.index  # [Bl, Hl, rows|1, 2], [Bl, Hl, rows|1, 2, n]
    list_heads = count.shape[1]
    if list_heads not in (1, num_heads):  # one list per kv head: FA4 takes H or 1 heads
        heads = torch.arange(num_heads, device=device) // (num_heads // list_heads)
        count, index = count.index_select(1, heads), index.index_select(1, heads)
    rows = ceil_div(seqlen_k, block_kv) if key_major else ceil_div(seqlen_q, SPARSE_BLOCK_Q)
    # one list shared by every query block (a key-wise mask): FA4 wants a row per block
    count = count.expand(count.shape[0], count.shape[1], rows, 2)
    index = index.expand(index.shape[0], index.shape[1], rows, 2, index.shape[-1])
    shared = (count.shape[0] == 1, count.shape[1] == 1)
    full = (batch, num_heads)

    def part(kind: int):
        cnt = _shared_stride0(count.select(-1, kind).contiguous(), shared, full)
        idx = _shared_stride0(index.select(-2, kind).contiguous(), shared, full)
        return cnt, idx

    full_cnt, full_idx = part(0)
    partial_cnt, partial_idx = part(1)
    return dict(mask_block_cnt=partial_cnt, mask_block_idx=partial_idx,
                full_block_cnt=full_cnt, full_block_idx=full_idx)
