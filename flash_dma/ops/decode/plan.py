"""How a decode call is cut: tile sizes, and how many splits share each kv head's keys.

Decoding reads the whole cache once and does little arithmetic per byte, so the rule is about
keeping the GPU's memory system busy: enough programs in flight to cover every SM, each with a
long enough run of keys to be worth its setup and its partial's write-back and merge.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime.config import ceil_div, head_dim_block, overridden
from ...runtime.hardware import device_info, interpreter_active

MAX_SPLITS = 128
# keys each split walks when the programs alone leave SMs idle: the decode sweep
# (bench/tune_decode.py, docs/perf/decode.md) found B1 with 8 kv heads and a cache of 32768
# fastest at 16 splits
KEYS_PER_SPLIT = 2048
# fewer key tiles than this per split and the partial's write and merge outweigh the parallelism
MIN_TILES_PER_SPLIT = 4
# programs per SM above which a split only adds the partials' write and merge (B64: one split)
PROGRAMS_PER_SM = 2
KERNEL = "decode_fwd"  # the name a LaunchConfig override uses (config.overrides(decode_fwd=...))


@dataclass(frozen=True)
class DecodePlan:
    num_splits: int
    block_m: int  # packed (query head, query) rows per program
    block_n: int  # keys per tile
    row_blocks: int  # programs along the packed rows
    num_warps: int
    num_stages: int


def choose_splits(programs: int, max_keys: int, block_n: int, sm_count: int) -> int:
    """One split when the programs nearly fill the GPU; otherwise about KEYS_PER_SPLIT keys per
    split, each split keeping MIN_TILES_PER_SPLIT tiles."""
    if programs >= 0.8 * sm_count * PROGRAMS_PER_SM:
        return 1
    key_tiles = max(ceil_div(max_keys, block_n), 1)
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    return max(1, min(most, ceil_div(max_keys, KEYS_PER_SPLIT)))


def plan_decode(device: torch.device, *, batch: int, kv_heads: int, packed_rows: int,
                max_keys: int, head_dim: int, num_splits: int | None, walk: str = "contiguous") -> DecodePlan:
    """packed_rows: query heads per kv head times query rows; max_keys: the longest the key walk
    can be (the cache's capacity), since the lengths live on the device and are not read back;
    walk: "contiguous", "paged" or "gathered" (a key-wise mask's kept keys)."""
    padded_d = head_dim_block(head_dim)
    override = overridden(KERNEL)
    on_gpu = not interpreter_active() and device.type == "cuda"
    sm_count = device_info(device).sm_count if on_gpu else 1
    block_m = min(max(16, 1 << (packed_rows - 1).bit_length()), 64)
    programs = batch * kv_heads * ceil_div(packed_rows, block_m)
    if override is not None:
        block_m, block_n, warps, stages = override.block_m, override.block_n, override.num_warps, override.num_stages
    elif not on_gpu:
        block_m, block_n, warps, stages = 16, 16, 1, 1
    elif padded_d <= 128:
        # whole contiguous walks over many programs: 128-key tiles with 8 warps led the launch
        # sweep; paged and gathered walks, and split ones, were fastest with 64 keys and 4 warps
        wide = walk == "contiguous" and programs >= 0.8 * sm_count * PROGRAMS_PER_SM
        block_n, warps, stages = (128, 8, 3) if wide else (64, 4, 3)
    else:
        block_n, warps, stages = 32, 4, 2
    row_blocks = ceil_div(packed_rows, block_m)
    key_tiles = max(ceil_div(max_keys, block_n), 1)
    if num_splits is None or num_splits <= 0:
        splits = choose_splits(batch * kv_heads * row_blocks, max_keys, block_n, sm_count)
    else:
        splits = min(int(num_splits), key_tiles, MAX_SPLITS)
    return DecodePlan(max(splits, 1), block_m, block_n, row_blocks, warps, stages)
