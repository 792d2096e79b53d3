"""Turning a keep-mask into the work lists the kernels walk, and building top-w masks.

Everything here is a handful of device-side torch ops on the mask (no host synchronisation): the
lists have fixed, worst-case shapes and carry their own counts, which the kernels read.

Two list kinds (see triton/common.py for how they are walked):
- block lists: for each query tile the key tiles holding a kept entry, ascending (and the
  transpose, for the key-major backward pass), split into full tiles (every entry kept and
  visible: the kernel neither loads the mask nor checks anything) and partial ones. Causal
  visibility is folded in, so a tile the causal rule hides is skipped like one the mask empties.
- gathered keys (key-wise masks [B|1, H|Hk|1, 1, Sk]): the kept key positions, compacted and
  ascending, plus how many of them each query block may see under the causal rule.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ...runtime.config import ceil_div
from ...runtime.hardware import graph_capturing
from ...runtime.tensor_cache import TensorKeyedCache

# How a kernel walks the key axis (its KV_MODE; triton/common.py describes each walk)
KV_DENSE = 0  # every key tile; the causal rule cuts the range short
KV_BLOCK_LIST = 1  # listed tiles only: full ones without checks, then partial ones
KV_GATHERED = 2  # key-wise masks: the kept keys, compacted

WALK_NAMES = {KV_DENSE: "dense", KV_BLOCK_LIST: "lists", KV_GATHERED: "gathered"}


@dataclass
class KeyWalk:
    """How one kernel walks the key (or, key-major, the query) axis. See triton/common.py.

    Block lists: count [Bl, Hl, rows|1, 2] and index [Bl, Hl, rows|1, 2, n], kind 0 holding the
    full tiles and kind 1 the partial ones. Gathered keys: count [Bl, Hl, rows|1] (key-major:
    [Bl, Hl]) and index [Bl, Hl, Sk].
    """
    mode: int
    count: torch.Tensor
    index: torch.Tensor
    head_div: int  # query head h reads list head h // head_div
    # other layouts of these lists (FA4's, cute/block_sparse.py), made once per walk: a walk is
    # remembered per mask and never changes
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def strides(self) -> tuple[int, ...]:
        """Strides the kernels take: count (batch, head, row), index (batch, head, row, kind).
        Computed once: a walk is remembered across calls and never changes."""
        c, i = self.count, self.index
        listed = self.mode == KV_BLOCK_LIST
        return (_broadcast_stride(c, 0), _broadcast_stride(c, 1),
                _broadcast_stride(c, 2) if c.dim() > 2 else 0,
                _broadcast_stride(i, 0), _broadcast_stride(i, 1),
                _broadcast_stride(i, 2) if listed else 0, i.stride(3) if listed else 0)


def _broadcast_stride(t: torch.Tensor, dim: int) -> int:
    return 0 if t.shape[dim] == 1 else t.stride(dim)


def choose_mode(mask: torch.Tensor | None, num_heads: int, num_kv_heads: int) -> int:
    """Dense without a mask; gathered keys for key-wise masks; block lists otherwise.

    Gathering needs one key set per kv head (the key-major pass sums a whole query-head group
    into one dk/dv tile), so a key-wise mask that differs across the heads of a group falls back
    to block lists, which are still exact, only less frugal.
    """
    if mask is None:
        return KV_DENSE
    key_wise = mask.shape[2] == 1 and mask.shape[3] > 1
    if key_wise and (mask.shape[1] != num_heads or num_heads == num_kv_heads):
        return KV_GATHERED
    return KV_BLOCK_LIST


def _blocks_reduce(mask: torch.Tensor, dim: int, block: int, reduce) -> torch.Tensor:
    """Reduce `dim` of a bool tensor to one entry per block of `block` (torch.any or torch.all);
    a ragged last block reduces over the entries it has."""
    size = mask.shape[dim]
    if size == 1:
        return mask
    full = size // block
    parts = []
    if full:
        head = mask.narrow(dim, 0, full * block)
        parts.append(reduce(head.unflatten(dim, (full, block)), dim + 1))
    if size % block:
        parts.append(reduce(mask.narrow(dim, full * block, size - full * block), dim, keepdim=True))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _sequence_lengths(cu_seqlens: torch.Tensor | None, fixed: int, device) -> torch.Tensor:
    """Per-sequence lengths as an int64 tensor shaped to broadcast over [N, H, blocks]."""
    if cu_seqlens is None:
        # (a fill, not a copy from the host: that could not be captured in a CUDA graph)
        return torch.full((1, 1, 1), fixed, device=device, dtype=torch.int64)
    return (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64).view(-1, 1, 1)


def _sorted_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, index): per row, how many entries are set, and their positions first, ascending."""
    count = blocks.sum(-1, dtype=torch.int32).contiguous()
    # kernels read each list as a contiguous row; argsort would keep a transposed input's layout
    index = torch.argsort(blocks.logical_not().to(torch.uint8), dim=-1, stable=True).to(torch.int32).contiguous()
    return count, index


@functools.lru_cache(maxsize=None)
def _dense_walk(device: torch.device) -> KeyWalk:
    """Dense walks read no list: one placeholder per device, not an allocation per call."""
    unused = torch.zeros(1, 1, 1, 2, 1, dtype=torch.int32, device=device)
    return KeyWalk(KV_DENSE, unused[..., 0], unused, 1)


def plan_key_walk(mask: torch.Tensor | None, mode: int, *, num_heads: int, seqlen_q: int,
                  seqlen_k: int, is_causal: bool, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, block_m: int, block_n: int,
                  key_major: bool, device: torch.device) -> KeyWalk:
    """Lists for one kernel's tile sizes. seqlen_q/k are the (max) lengths the mask is padded to."""
    if mode == KV_DENSE:
        return _dense_walk(device)

    n_m = ceil_div(seqlen_q, block_m)
    n_n = ceil_div(seqlen_k, block_n)
    len_q = _sequence_lengths(cu_seqlens_q, seqlen_q, device)
    len_k = _sequence_lengths(cu_seqlens_k, seqlen_k, device)
    causal_shift = len_k - len_q  # key j is hidden from query i when j > i + shift

    if mode == KV_GATHERED:
        keep = mask[:, :, 0, :]
        if cu_seqlens_k is not None:  # keys past a sequence's end are padding, never kept
            keep = keep & (torch.arange(seqlen_k, device=device) < len_k)
        count, index = _sorted_lists(keep)
        head_div = num_heads // keep.shape[1]
        if key_major:
            return KeyWalk(KV_GATHERED, count, index, head_div)
        if is_causal:
            seen = keep.cumsum(-1, dtype=torch.int32)
            last_row = torch.minimum((torch.arange(n_m, device=device) + 1) * block_m, len_q) - 1
            last_key = last_row + causal_shift  # [N|1, 1, n_m]
            per_block = seen.gather(-1, last_key.clamp(0, seqlen_k - 1).expand(
                seen.shape[0], seen.shape[1], n_m))
            count = torch.where(last_key >= 0, per_block, 0).to(torch.int32)
        else:
            count = count[..., None]
        return KeyWalk(KV_GATHERED, count, index, head_div)

    if mask is None:  # every tile (all_tiles_walk)
        any_kept = all_kept = torch.ones(1, 1, n_m, n_n, dtype=torch.bool, device=device)
    else:
        any_kept = _blocks_reduce(_blocks_reduce(mask, 2, block_m, torch.any), 3, block_n, torch.any)
        all_kept = _blocks_reduce(_blocks_reduce(mask, 2, block_m, torch.all), 3, block_n, torch.all)
    first_key = torch.arange(n_n, device=device).view(1, 1, 1, -1) * block_n
    last_key = first_key + block_n - 1
    len_k4 = len_k.unsqueeze(-1)
    # a tile is "full" when no check is needed at all: every entry kept, every key inside the
    # sequence, every key visible to every row; tiles starting past the sequence are dropped
    full = any_kept & all_kept & (last_key < len_k4)
    partial = any_kept & (first_key < len_k4)
    if is_causal:
        first_row = torch.arange(n_m, device=device).view(1, 1, -1, 1) * block_m
        shift = causal_shift.unsqueeze(-1)
        full = full & (last_key <= first_row + shift)
        partial = partial & (first_key <= first_row + block_m - 1 + shift)
    partial = partial & full.logical_not()
    rows = n_m if (key_major or full.shape[2] > 1 or partial.shape[2] > 1) else 1
    shape = (max(full.shape[0], partial.shape[0]), full.shape[1], rows, n_n)
    full, partial = full.expand(shape), partial.expand(shape)
    if key_major:
        full, partial = full.transpose(-1, -2), partial.transpose(-1, -2)
    count, index = _sorted_lists(torch.stack([full, partial], dim=-2))
    return KeyWalk(KV_BLOCK_LIST, count, index, num_heads // shape[1])


def _plan_all_tiles(*, num_heads: int, seqlen_q: int, seqlen_k: int, is_causal: bool, block_m: int,
                    block_n: int, key_major: bool, device: torch.device) -> KeyWalk:
    return plan_key_walk(None, KV_BLOCK_LIST, num_heads=num_heads, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k, is_causal=is_causal, cu_seqlens_q=None,
                         cu_seqlens_k=None, block_m=block_m, block_n=block_n,
                         key_major=key_major, device=device)


_remembered_all_tiles = functools.lru_cache(maxsize=64)(_plan_all_tiles)


def all_tiles_walk(**kw) -> KeyWalk:
    """Block lists of every tile (without a mask; causal visibility and ragged ends folded in as
    for a mask), shared by all batches and heads: the key-major backward walks them faster than
    its dense walk (KV_BLOCK_LIST against KV_DENSE; see plan.plan_backward). Fixed lengths
    only; remembered per shape, except in CUDA graph capture (lists made there are only filled at
    replay: built each time, as TensorKeyedCache.get does)."""
    if graph_capturing(kw["device"]):
        return _plan_all_tiles(**kw)
    return _remembered_all_tiles(**kw)


# key walks of recent masks: the forward, the backward and every layer sharing a mask plan it once
_PLANS = TensorKeyedCache()


def cached_key_walk(mask: torch.Tensor | None, mode: int, **kw) -> KeyWalk:
    """plan_key_walk, remembered per mask (fixed-length batches only: varlen plans depend on the
    cu_seqlens values too)."""
    if mask is None or mode == KV_DENSE or kw.get("cu_seqlens_q") is not None:
        return plan_key_walk(mask, mode, **kw)
    # (name, value) pairs in the caller's order, unsorted: a call site that names them in another
    # order only plans once more, and sorting cost more host time than the lookup it guards
    key = (mode, *[item for item in kw.items() if item[0] not in ("cu_seqlens_q", "cu_seqlens_k")])
    return _PLANS.get(mask, key, lambda: plan_key_walk(mask, mode, **kw))


def topk_mask_from_bias(attn_bias: torch.Tensor, keep: int, *, is_causal: bool = False,
                        key_padding_mask: torch.Tensor | None = None,
                        block_size: int | None = None) -> torch.Tensor:
    """Keep-mask of the `keep` largest bias entries per row (Doge-style dynamic masks).

    attn_bias: [B|1, H|Hk|1, Sq|1, Sk]. A row of length 1 along Sq gives a key-wise mask, the case
    the kernels serve at O(Sq * keep). Keys hidden by the causal rule (when the bias has full
    query rows) or by key_padding_mask ([B, Sk], True = real token) are never chosen. With
    block_size, whole key blocks are kept instead: the ceil(keep / block_size) blocks with the
    largest maximum bias, so that tile skipping can drop every other block.
    Returns a bool tensor of the bias's shape.
    """
    if attn_bias.dim() != 4:
        raise ValueError(f"attn_bias: expected 4 dims [B, H, Sq, Sk], got shape {tuple(attn_bias.shape)}")
    if keep < 1:
        raise ValueError(f"keep: expected a positive number of keys, got {keep}")
    score = attn_bias.detach().float()
    sq, sk = score.shape[2], score.shape[3]
    allowed = torch.ones_like(score, dtype=torch.bool)
    if is_causal and sq > 1:
        rows = torch.arange(sq, device=score.device).view(-1, 1)
        cols = torch.arange(sk, device=score.device).view(1, -1)
        allowed = allowed & (cols <= rows + (sk - sq))
    if key_padding_mask is not None:
        if key_padding_mask.shape[-1] != sk or key_padding_mask.dim() != 2:
            raise ValueError(f"key_padding_mask: expected [B, {sk}], got {tuple(key_padding_mask.shape)}")
        allowed = allowed & key_padding_mask.bool()[:, None, None, :]
    score = torch.where(allowed, score, float("-inf"))
    if block_size is None:
        k = min(keep, sk)
        top = score.topk(k, dim=-1).indices
        chosen = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
        chosen.scatter_(-1, top, True)
        if sq == 1 and key_padding_mask is None and not torch.compiler.is_compiling():
            # every row keeps exactly k keys: attention can run over them gathered (compaction.py;
            # not while traced: attention under torch.compile takes its custom op, uncompacted)
            from .compaction import remember_kept_keys
            remember_kept_keys(chosen, top)
            return chosen
        return chosen & allowed
    n_blocks = -(-sk // block_size)
    padded = torch.nn.functional.pad(score, (0, n_blocks * block_size - sk), value=float("-inf"))
    block_score = padded.unflatten(-1, (n_blocks, block_size)).amax(-1)
    k = min(-(-keep // block_size), n_blocks)
    top = block_score.topk(k, dim=-1).indices
    chosen_blocks = torch.zeros(block_score.shape, dtype=torch.bool, device=score.device)
    chosen_blocks.scatter_(-1, top, True)
    chosen = chosen_blocks.repeat_interleave(block_size, -1)[..., :sk]
    return chosen & allowed
