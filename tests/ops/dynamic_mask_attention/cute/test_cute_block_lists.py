"""FA4's tile lists made from our keep-mask (cute/block_sparse.py), on CPU against a brute-force
count: per query block (forward) or key block (backward), the full tiles (every entry kept,
visible and inside the lengths) exactly, and partial tiles covering every other tile with a kept
and visible entry (under causal a tile holding kept entries and visible ones, not the same ones,
may be listed too: the mask_mod then hides it all, which costs time, never correctness);
ascending, in FA4's shapes, with stride 0 exactly on the dims the mask shares. Needs no CuTe
stack."""
import pytest
import torch

from flash_dma.ops.dynamic_mask_attention.cute import block_sparse
from flash_dma.ops.dynamic_mask_attention.reference import heads_to


def brute_force(mask, B, H, Sq, Sk, causal, block_q, block_kv, key_major):
    """{(b, h, row): (full tiles, partial tiles)} as sorted lists."""
    keep = heads_to(mask, H, 1).expand(B, H, Sq, Sk)
    if causal:
        rows = torch.arange(Sq).view(-1, 1)
        cols = torch.arange(Sk).view(1, -1)
        keep = keep & (cols <= rows + Sk - Sq)
    n_m, n_n = -(-Sq // block_q), -(-Sk // block_kv)
    out = {}
    for b in range(B):
        for h in range(H):
            tiles = {}
            for m in range(n_m):
                for n in range(n_n):
                    tile = keep[b, h, m * block_q:(m + 1) * block_q, n * block_kv:(n + 1) * block_kv]
                    if tile.any():
                        whole = tile.shape[1] == block_kv  # a ragged last key tile is never full
                        tiles[(m, n)] = bool(tile.all()) and whole
            for row in range(n_n if key_major else n_m):
                listed = sorted((n if not key_major else m, full) for (m, n), full in tiles.items()
                                if (n if key_major else m) == row)
                out[(b, h, row)] = ([i for i, f in listed if f], [i for i, f in listed if not f])
    return out


CASES = [  # (mask shape as a function of B, H, Hk, Sq, Sk)
    lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk),
    lambda B, H, Hk, Sq, Sk: (1, Hk, Sq, Sk),
    lambda B, H, Hk, Sq, Sk: (B, 1, Sq, Sk),
    lambda B, H, Hk, Sq, Sk: (B, H, 1, Sk),
    lambda B, H, Hk, Sq, Sk: (1, 1, Sq, 1),
]


@pytest.mark.parametrize("key_major", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_tile_lists_match_brute_force(case, causal, key_major):
    B, H, Hk, Sq, Sk, block_kv = 2, 4, 2, 300, 200, 64
    shape = CASES[case](B, H, Hk, Sq, Sk)
    coarse = torch.rand(shape[0], shape[1], -(-shape[2] // 32), -(-shape[3] // 32)) < 0.5
    mask = coarse.repeat_interleave(32, 2)[:, :, :shape[2]].repeat_interleave(32, 3)[..., :shape[3]]
    mask &= torch.rand(shape) < 0.97  # partial tiles beside whole ones
    lists = block_sparse.tile_lists(mask, batch=B, num_heads=H, seqlen_q=Sq, seqlen_k=Sk,
                                    is_causal=causal, block_kv=block_kv, key_major=key_major)
    rows = -(-Sk // block_kv) if key_major else -(-Sq // 128)
    want = brute_force(mask, B, H, Sq, Sk, causal, 128, block_kv, key_major)
    for name in ("mask_block_cnt", "full_block_cnt"):
        t = lists[name]
        assert t.dtype == torch.int32 and t.shape == (B, H, rows)
        assert t.stride(-1) == 1
        assert (t.stride(0) == 0) == (shape[0] == 1) and (t.stride(1) == 0) == (shape[1] == 1)
    for name in ("mask_block_idx", "full_block_idx"):
        t = lists[name]
        assert t.dtype == torch.int32 and t.shape[:3] == (B, H, rows) and t.stride(-1) == 1
    for (b, h, row), (full, partial) in want.items():
        got_full = lists["full_block_idx"][b, h, row, :lists["full_block_cnt"][b, h, row]].tolist()
        got_partial = lists["mask_block_idx"][b, h, row, :lists["mask_block_cnt"][b, h, row]].tolist()
        assert got_full == full, (b, h, row)
        assert got_partial == sorted(got_partial) and not set(got_partial) & set(full), (b, h, row)
        assert set(partial) <= set(got_partial), (b, h, row)
        if not causal:
            assert got_partial == partial, (b, h, row)


def test_block_lists_remembered_per_mask_until_it_changes(monkeypatch):
    """block_lists lays the walk out for FA4 once per mask and shape: the same object again,
    no new lists, until the mask changes in place (its walk is planned again)."""
    class Lists:  # stands in for FA4's BlockSparseTensorsTorch (no CuTe stack needed)
        def __init__(self, **fields):
            self.__dict__.update(fields)
    monkeypatch.setattr(block_sparse, "_fa4_block_types", lambda: (Lists, None, None))
    laid_out = []
    real = block_sparse._fa4_layout
    monkeypatch.setattr(block_sparse, "_fa4_layout", lambda *a, **k: laid_out.append(1) or real(*a, **k))
    mask = torch.rand(2, 4, 300, 200) < 0.3
    args = dict(batch=2, num_heads=4, seqlen_q=300, seqlen_k=200, is_causal=True, block_kv=64, key_major=False)
    first = block_sparse.block_lists(mask, **args)
    assert block_sparse.block_lists(mask, **args) is first and len(laid_out) == 1
    assert block_sparse.block_lists(mask, **{**args, "key_major": True}) is not first and len(laid_out) == 2
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]
    again = block_sparse.block_lists(mask, **args)
    assert again is not first and len(laid_out) == 3
    assert first.block_size == again.block_size == (128, 64)
    expected = block_sparse.tile_lists(mask, **args)
    for name, tensor in expected.items():
        assert torch.equal(getattr(again, name), tensor), name
