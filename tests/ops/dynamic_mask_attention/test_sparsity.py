"""The work lists that make sparsity pay, and the top-w mask helper."""
import pytest
import torch

from conftest import DEVICE
from flash_dma import topk_mask_from_bias
from flash_dma.ops.dynamic_mask_attention.sparsity import KV_BLOCK_LIST, KV_DENSE, KV_GATHERED, choose_mode, \
    plan_key_walk


def walk(mask, key_major, causal=False, bm=16, bn=16, H=4):
    mode = choose_mode(mask, H, 2)
    return plan_key_walk(mask, mode, num_heads=H, seqlen_q=mask.shape[2] if mask.shape[2] > 1 else 50,
                         seqlen_k=mask.shape[3], is_causal=causal, cu_seqlens_q=None,
                         cu_seqlens_k=None, block_m=bm, block_n=bn, key_major=key_major,
                         device=torch.device(DEVICE))


def test_mode_choice():
    assert choose_mode(None, 4, 2) == KV_DENSE
    assert choose_mode(torch.ones(1, 2, 1, 64, dtype=torch.bool), 4, 2) == KV_GATHERED
    assert choose_mode(torch.ones(1, 1, 1, 64, dtype=torch.bool), 4, 2) == KV_GATHERED
    # key-wise but differing across the heads of a kv group: block lists
    assert choose_mode(torch.ones(1, 4, 1, 64, dtype=torch.bool), 4, 2) == KV_BLOCK_LIST
    assert choose_mode(torch.ones(1, 4, 1, 64, dtype=torch.bool), 4, 4) == KV_GATHERED
    assert choose_mode(torch.ones(1, 4, 50, 64, dtype=torch.bool), 4, 2) == KV_BLOCK_LIST


def test_block_lists_list_exactly_the_nonempty_tiles():
    mask = torch.zeros(1, 1, 50, 70, dtype=torch.bool, device=DEVICE)
    mask[0, 0, 3, 20] = True     # tile (0, 1)
    mask[0, 0, 40, 69] = True    # tile (2, 4), the ragged last key tile
    mask[0, 0, 49, 0] = True     # tile (3, 0), the ragged last query tile
    w = walk(mask, key_major=False)
    full, partial = w.count[0, 0, :, 0], w.count[0, 0, :, 1]
    assert full.tolist() == [0, 0, 0, 0] and partial.tolist() == [1, 0, 1, 1]
    assert w.index[0, 0, 0, 1, 0] == 1 and w.index[0, 0, 2, 1, 0] == 4 and w.index[0, 0, 3, 1, 0] == 0
    t = walk(mask, key_major=True)
    assert t.count[0, 0, :, 1].tolist() == [1, 1, 0, 0, 1]
    assert t.index[0, 0, 0, 1, 0] == 3 and t.index[0, 0, 1, 1, 0] == 0 and t.index[0, 0, 4, 1, 0] == 2


def test_full_tiles_need_every_entry_kept_and_whole_keys():
    mask = torch.ones(1, 1, 40, 40, dtype=torch.bool, device=DEVICE)
    mask[0, 0, 5, 5] = False  # tile (0, 0) is no longer full
    w = walk(mask, key_major=False)
    # key tile 2 (keys 32..39) overhangs the 40 keys' tile grid: never full, always checked
    assert w.count[0, 0, :, 0].tolist() == [1, 2, 2]
    assert w.count[0, 0, :, 1].tolist() == [2, 1, 1]
    assert w.index[0, 0, 0, 1, :2].tolist() == [0, 2]


def test_block_lists_fold_in_causal():
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool, device=DEVICE)
    w = walk(mask, key_major=False, causal=True)
    assert w.count[0, 0, :, 0].tolist() == [0, 1, 2, 3]  # below the diagonal: full
    assert w.count[0, 0, :, 1].tolist() == [1, 1, 1, 1]  # on it: partial
    assert w.index[0, 0, 3, 0, :3].tolist() == [0, 1, 2] and w.index[0, 0, 3, 1, 0] == 3


def test_gather_lists_compact_kept_keys_and_causal_counts():
    keep = torch.zeros(1, 2, 1, 64, dtype=torch.bool, device=DEVICE)
    keep[0, 0, 0, [2, 9, 17, 40, 63]] = True
    keep[0, 1, 0, [0]] = True
    w = walk(keep, key_major=False, causal=True)  # Sq = 50, Sk = 64: shift 14
    assert w.index[0, 0, :5].tolist() == [2, 9, 17, 40, 63]
    # query block i sees keys <= min(16 i + 15, 49) + 14
    assert w.count[0, 0].tolist() == [3, 4, 4, 5]
    t = walk(keep, key_major=True)
    assert t.count[0].tolist() == [5, 1]


@pytest.mark.parametrize("block_size", [None, 8])
def test_topk_mask_from_bias(block_size):
    bias = torch.randn(2, 3, 20, 40, device=DEVICE)
    mask = topk_mask_from_bias(bias, 6, is_causal=True, block_size=block_size)
    assert mask.shape == bias.shape and mask.dtype == torch.bool
    rows = torch.arange(20, device=DEVICE).view(-1, 1)
    cols = torch.arange(40, device=DEVICE).view(1, -1)
    assert not (mask & (cols > rows + 20)).any(), "a causally hidden key was kept"
    per_row = mask.sum(-1)
    if block_size is None:
        assert (per_row == 6).all()
        # the kept entries are the largest allowed ones
        kth = bias.masked_fill(cols > rows + 20, float("-inf")).topk(6, -1).values[..., -1:]
        assert (bias[mask] >= kth.expand_as(bias)[mask]).all()
    else:
        assert (per_row <= 8).all() and (per_row > 0).all()


def test_topk_key_padding_and_keywise():
    bias = torch.randn(2, 1, 1, 30, device=DEVICE)
    pad = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
    pad[1, 10:] = False
    mask = topk_mask_from_bias(bias, 12, key_padding_mask=pad)
    assert mask.shape == (2, 1, 1, 30)
    assert mask[0].sum() == 12 and mask[1].sum() == 10 and not mask[1, ..., 10:].any()
