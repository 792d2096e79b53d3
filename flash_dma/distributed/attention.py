"""Context parallelism of dynamic mask attention: cp_flash_dma_func (two forms) and
cp_flash_dma_varlen_func (the all-gather form).

Each rank holds a shard of the sequence (context.py: contiguous, or zigzag: chunks r and
2W - 1 - r of 2W, which balances causal work). A key-wise mask or bias, [B|1, H|Hk|1, 1, S_local],
is sharded with its keys; a dense mask or bias is sharded by query rows ([.., S_local, S]: this
rank's rows, every key in global order), so its dbias stays where it is. GQA: the Hk key and value
heads travel as they are.

form="ring" (ring_attention.py, the default): the key/value shards pass from rank to rank with
asynchronous P2P while each rank computes its queries against the block in hand, merging partial
outputs by their lse; in backward the blocks go round again with their dk, dv (and key-wise dbias)
accumulators, which end at their owners. Memory per rank stays at two blocks, the transfers run
beside the kernels, causal blocks in a rank's future are neither computed nor, where no later
rank needs them, sent.

form="all_gather": every rank all-gathers the keys and values (and the key-wise mask or bias) and
computes its own query rows; the gather's backward reduce-scatters dk, dv and the key-wise dbias
back to their owners. Causal: a chunk of queries at global offset o attends to the key prefix
[0, o + len) with bottom-right aligned causal masking, which is exactly the global causal mask;
one flash_dma_func call per local chunk. This is the form Llama 3 training uses: simple and cheap
where keys and values are small next to queries (GQA), but every rank holds the whole sequence's
keys and values (2 S Hk D elements) and the gather is not overlapped with compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.dynamic_mask_attention import flash_dma_func, flash_dma_varlen_func
from ..runtime.validation import check_tensor
from .context import CPContext, gather_shards, group_info, shard, shard_ranges
from .ring_attention import make_ring_plan, ring_flash_dma_func

FORMS = ("ring", "all_gather")


def shard_sequence(x: torch.Tensor, dim: int = 1, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of a global tensor along its sequence dim `dim` (layout: "zigzag" or
    "contiguous", see context.py)."""
    world_size, rank = group_info(group)
    return shard(x, dim, world_size, rank, layout)


def gather_sequence(x: torch.Tensor, dim: int = 1, group=None, layout: str = "zigzag") -> torch.Tensor:
    """Every rank's shard joined along `dim` in global order (differentiable: the gradient of the
    whole is summed back into each owner's shard)."""
    return gather_shards((x,), (dim,), group, layout)[0]


def _pair_kind(name: str, t: torch.Tensor | None, local: int, total: int) -> str | None:
    """How a mask or bias is sharded: "key" (key-wise, gathered with the keys), "local" (by query
    rows, or broadcast along both)."""
    if t is None:
        return None
    check_tensor(name, t, dims=4)
    sq, sk = t.shape[2], t.shape[3]
    if sq == 1 and sk == 1:
        return "local"
    if sq == 1:
        if sk != local:
            raise ValueError(f"{name}: a key-wise {name} [.., 1, S_local] holds this rank's {local} keys "
                             f"along dim 3, got {tuple(t.shape)}")
        return "key"
    if sq != local:
        raise ValueError(f"{name}: dim 2 must be 1 or this rank's {local} query rows, got {tuple(t.shape)}")
    if sk not in (1, total):
        raise ValueError(f"{name}: a {name} sharded by query rows [.., {local}, S] holds every key in global "
                         f"order along dim 3 (S = {total}), or 1; got {tuple(t.shape)}")
    return "local"


def _rows_and_keys(t: torch.Tensor | None, row_start: int, rows: int, keys: int) -> torch.Tensor | None:
    """A mask or bias cut to a chunk's query rows and the first `keys` keys (broadcast dims kept)."""
    if t is None:
        return None
    if t.shape[2] > 1:
        t = t.narrow(2, row_start, rows)
    if t.shape[3] > 1:
        t = t.narrow(3, 0, keys)
    return t


def cp_flash_dma_func(q, k, v, attn_mask=None, attn_bias=None, is_causal=False, softmax_scale=None,
                      return_lse=False, deterministic=False, *, group=None, layout: str = "zigzag",
                      form: str = "ring"):
    """flash_dma_func over a sequence sharded across the ranks of `group` (None: the default).

    q [B, S_local, H, D], k/v [B, S_local, Hk, D]: this rank's shard (shard_sequence with the
    same layout) of a sequence of S = W S_local tokens. attn_mask / attn_bias, broadcastable as
    for flash_dma_func, are sharded by their varying dims: key-wise [B|1, H|Hk|1, 1, S_local] (this
    rank's keys), by query rows [B|1, H|Hk|1, S_local, S|1] (this rank's rows, every key in global
    order), or [.., 1, 1]. Returns this rank's rows of the output (and lse [B, H, S_local]).
    Gradients of k, v and a key-wise bias come back summed over the ranks that used them.
    form: "ring" (P2P of key/value blocks overlapped with compute) or "all_gather" (see the
    module docstring); both give the same result up to rounding.
    """
    if form not in FORMS:
        raise ValueError(f"form: expected one of {FORMS}, got {form!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dims=4)
    world_size, rank = group_info(group)
    local = q.shape[1]
    if k.shape[1] != local or v.shape[1] != local:
        raise ValueError(f"k, v: expected this rank's {local} tokens along dim 1 like q, got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    total = local * world_size
    ranges = shard_ranges(total, world_size, rank, layout)
    kinds = {"attn_mask": _pair_kind("attn_mask", attn_mask, local, total),
             "attn_bias": _pair_kind("attn_bias", attn_bias, local, total)}
    if form == "ring":
        plan = make_ring_plan(group, world_size, rank, total, layout, is_causal, softmax_scale,
                              deterministic, attn_mask, kinds["attn_mask"], attn_bias, kinds["attn_bias"])
        out, lse = ring_flash_dma_func(q, k, v, attn_mask, attn_bias, plan)
        return (out, lse) if return_lse else out
    to_gather = [k, v]
    dims = [1, 1]
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if kinds[name] == "key":
            to_gather.append(t)
            dims.append(3)
    gathered = list(gather_shards(to_gather, dims, group, layout))
    k_all, v_all = gathered[0], gathered[1]
    mask = gathered.pop(2) if kinds["attn_mask"] == "key" else attn_mask
    bias = gathered.pop(2) if kinds["attn_bias"] == "key" else attn_bias

    def attend(row_start: int, rows: int, keys: int, causal: bool):
        return flash_dma_func(q.narrow(1, row_start, rows), k_all.narrow(1, 0, keys), v_all.narrow(1, 0, keys),
                              attn_mask=_rows_and_keys(mask, row_start, rows, keys),
                              attn_bias=_rows_and_keys(bias, row_start, rows, keys), is_causal=causal,
                              softmax_scale=softmax_scale, return_lse=True, deterministic=deterministic)

    if is_causal:  # each local chunk against the key prefix that ends where it ends
        results, offset = [], 0
        for start, end in ranges:
            results.append(attend(offset, end - start, end, True))
            offset += end - start
    else:
        results = [attend(0, local, total, False)]
    out = results[0][0] if len(results) == 1 else torch.cat([o for o, _ in results], 1)
    if not return_lse:
        return out
    lse = results[0][1] if len(results) == 1 else torch.cat([s for _, s in results], 2)
    return out, lse


@dataclass
class _VarlenCall:
    """One flash_dma_varlen_func call: a local range's pieces against their key ranges."""
    local_start: int
    length: int
    key_start: int  # global token where the call's keys start
    key_end: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _varlen_plan(ctx: CPContext, is_causal: bool) -> tuple[_VarlenCall, ...]:
    key = ("attention", is_causal)
    plan = ctx.plans.get(key)
    if plan is not None:
        return plan
    calls, offset = [], 0
    for start, end in ctx.ranges:
        pieces = [p for p in ctx.local_pieces if start <= p.global_start < end]
        # a piece's keys: its sequence up to its own end (causal, bottom-right aligned) or whole;
        # the pieces of one range are whole sequences but the first and last, so the key ranges
        # of consecutive pieces are adjacent
        bounds = [(p.seq_start, p.global_end if is_causal else p.seq_end) for p in pieces]
        key_start = bounds[0][0]
        cu_k = [0] + [e - key_start for _, e in bounds]
        cu_q = [0]
        for p in pieces:
            cu_q.append(cu_q[-1] + p.length)
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
        calls.append(_VarlenCall(
            offset, end - start, key_start, bounds[-1][1],
            torch.tensor(cu_q, dtype=torch.int32, device=ctx.device),
            torch.tensor(cu_k, dtype=torch.int32, device=ctx.device),
            max(p.length for p in pieces), max(e - s for s, e in bounds)))
        offset += end - start
    plan = tuple(calls)
    ctx.plans[key] = plan
    return plan


def cp_flash_dma_varlen_func(q, k, v, cp_context: CPContext, is_causal=False, softmax_scale=None,
                             return_lse=False, deterministic=False):
    """flash_dma_varlen_func over packed sequences sharded across the ranks of cp_context.

    q [T_local, H, D], k/v [T_local, Hk, D]: this rank's tokens (cp_context.shard(x, dim=0)). Each
    query attends to the keys of its own sequence (causal: up to itself), wherever they are.
    Returns this rank's output rows (and lse [H, T_local]). Masks and biases are not taken here
    (their padded per-sequence layout does not shard by tokens): use cp_flash_dma_func for them.
    """
    if not isinstance(cp_context, CPContext):
        raise TypeError(f"cp_context: expected a CPContext from build_cp_context, got {type(cp_context).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dims=3)
        if t.shape[0] != cp_context.local_tokens:
            raise ValueError(f"{name}: expected this rank's {cp_context.local_tokens} tokens along dim 0 "
                             f"(cp_context's shard of {cp_context.total_tokens}), got {tuple(t.shape)}")
    k_all, v_all = cp_context.gather(k, v, dim=0)
    results = []
    for call in _varlen_plan(cp_context, bool(is_causal)):
        keys = call.key_end - call.key_start
        results.append(flash_dma_varlen_func(
            q.narrow(0, call.local_start, call.length), k_all.narrow(0, call.key_start, keys),
            v_all.narrow(0, call.key_start, keys), call.cu_q, call.cu_k, call.max_q, call.max_k,
            is_causal=is_causal, softmax_scale=softmax_scale, return_lse=True, deterministic=deterministic))
    out = results[0][0] if len(results) == 1 else torch.cat([o for o, _ in results], 0)
    if not return_lse:
        return out
    lse = results[0][1] if len(results) == 1 else torch.cat([s for _, s in results], 1)
    return out, lse
