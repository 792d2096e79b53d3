"""How a decode call is cut: tile sizes, and how many splits share each kv head's keys.

Decoding reads the whole cache once and does little arithmetic per byte, so the rule is about
keeping the GPU's memory system busy: enough programs in flight to cover every SM, each with a
long enough run of keys to be worth its setup and its partial's write-back and merge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...runtime.config import ceil_div, head_dim_block
from ...runtime.hardware import device_info, interpreter_active

MAX_SPLITS = 128
# fewer key tiles than this per split and the partial's write and merge outweigh the parallelism
MIN_TILES_PER_SPLIT = 4
# programs the rule aims at per SM: two keep one's loads in flight while the other computes
PROGRAMS_PER_SM = 2


# Launch settings that replace the rule's (keys: block_m, block_n, num_warps, num_stages); set by
# bench/tune_decode.py's sweeps and by tests, empty otherwise. The defaults below are not
# measured yet.
OVERRIDES: dict = {}


@dataclass(frozen=True)
class DecodePlan:
    num_splits: int
    block_m: int  # packed (query head, query) rows per program
    block_n: int  # keys per tile
    row_blocks: int  # programs along the packed rows
    num_warps: int
    num_stages: int


def choose_splits(programs: int, key_tiles: int, sm_count: int) -> int:
    """FlashAttention's wave-efficiency rule: among split counts that leave each split at least
    MIN_TILES_PER_SPLIT key tiles, the smallest whose last wave of programs is at least 85% as
    full as the best one's. One split when the programs alone nearly fill the GPU."""
    slots = sm_count * PROGRAMS_PER_SM
    if programs >= 0.8 * slots:
        return 1
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    def efficiency(s: int) -> float:
        waves = programs * s / slots
        return waves / math.ceil(waves)
    best = max(efficiency(s) for s in range(1, most + 1))
    for s in range(1, most + 1):
        if efficiency(s) >= 0.85 * best:
            return s
    return 1


def plan_decode(device: torch.device, *, batch: int, kv_heads: int, packed_rows: int,
                max_keys: int, head_dim: int, num_splits: int | None) -> DecodePlan:
    """packed_rows: query heads per kv head times query rows; max_keys: the longest the key walk
    can be (the cache's capacity, or a key-wise mask's width), since the lengths live on the
    device and are not read back."""
    padded_d = head_dim_block(head_dim)
    if interpreter_active() or device.type != "cuda":
        block_m, block_n, warps, stages = 16, 16, 1, 1
    else:
        block_m = min(max(16, 1 << (packed_rows - 1).bit_length()), 64)
        block_n = 64 if padded_d <= 128 else 32
        warps, stages = 4, (3 if padded_d <= 128 else 2)
    block_m = OVERRIDES.get("block_m", block_m)
    block_n = OVERRIDES.get("block_n", block_n)
    warps = OVERRIDES.get("num_warps", warps)
    stages = OVERRIDES.get("num_stages", stages)
    row_blocks = ceil_div(packed_rows, block_m)
    key_tiles = max(ceil_div(max_keys, block_n), 1)
    if num_splits is None or num_splits <= 0:
        sm_count = device_info(device).sm_count
        splits = choose_splits(batch * kv_heads * row_blocks, key_tiles, sm_count)
    else:
        splits = min(int(num_splits), key_tiles, MAX_SPLITS)
    return DecodePlan(max(splits, 1), block_m, block_n, row_blocks, warps, stages)
