"""How a decode call is cut: tile sizes, and how many splits share each kv head's keys.

Decoding reads the whole cache once and does little arithmetic per byte, so the rule is about
keeping the GPU's memory system busy: enough programs in flight to cover every SM, each with a
long enough run of keys to be worth its setup and its partial's write-back and merge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...runtime.config import ceil_div, head_dim_block, overridden
from ...runtime.hardware import device_info, interpreter_active

MAX_SPLITS = 128
# keys each split walks: the decode sweep (bench/tune_decode.py) found the best split count
# at about this many keys per split both with few programs (B1, 8 kv heads, cache 32768: 16
# splits) and with many (B64, cache 8192: 4 splits); longer walks leave loads in flight idle,
# shorter ones pay the partial's write and merge (docs/perf/decode.md)
KEYS_PER_SPLIT = 2048
# fewer key tiles than this per split and the partial's write and merge outweigh the parallelism
MIN_TILES_PER_SPLIT = 4
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
    """Splits of each program's key walk: about KEYS_PER_SPLIT keys per split, and at least one
    program per SM when the programs alone are few, each split keeping MIN_TILES_PER_SPLIT tiles."""
    key_tiles = max(ceil_div(max_keys, block_n), 1)
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    by_keys = ceil_div(max_keys, KEYS_PER_SPLIT)
    by_occupancy = ceil_div(sm_count, max(programs, 1))
    return max(1, min(most, max(by_keys, by_occupancy)))


def plan_decode(device: torch.device, *, batch: int, kv_heads: int, packed_rows: int,
                max_keys: int, head_dim: int, num_splits: int | None) -> DecodePlan:
    """packed_rows: query heads per kv head times query rows; max_keys: the longest the key walk
    can be (the cache's capacity, or a key-wise mask's width), since the lengths live on the
    device and are not read back."""
    padded_d = head_dim_block(head_dim)
    override = overridden(KERNEL)
    if override is not None:
        block_m, block_n, warps, stages = override.block_m, override.block_n, override.num_warps, override.num_stages
    elif interpreter_active() or device.type != "cuda":
        block_m, block_n, warps, stages = 16, 16, 1, 1
    else:
        block_m = min(max(16, 1 << (packed_rows - 1).bit_length()), 64)
        # 128-key tiles with 8 warps led the launch sweep at D 128; the wider head dims keep 32
        block_n, warps = (128, 8) if padded_d <= 128 else (32, 4)
        stages = 3 if padded_d <= 128 else 2
    row_blocks = ceil_div(packed_rows, block_m)
    key_tiles = max(ceil_div(max_keys, block_n), 1)
    if num_splits is None or num_splits <= 0:
        sm_count = device_info(device).sm_count
        splits = choose_splits(batch * kv_heads * row_blocks, max_keys, block_n, sm_count)
    else:
        splits = min(int(num_splits), key_tiles, MAX_SPLITS)
    return DecodePlan(max(splits, 1), block_m, block_n, row_blocks, warps, stages)
