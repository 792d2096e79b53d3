"""Segments of the delta rule's sequences: the layout (no host sync) and the sequential join."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule.segments import (join_segments, join_segments_reference,
                                                     segment_layout)

CASES = [
    (None, 2, 300, 2),  # equal lengths, a ragged last chunk and segment
    (torch.tensor([0, 0, 70, 333, 334]), 1, 334, 2),  # lengths 0, 70, 263, 1
    (torch.tensor([0, 64, 128]), 1, 200, 1),  # tokens past the last sequence
    (torch.tensor([0, 500]), 1, 500, 3),
]


def _expected_segments(cu, B, T, per):
    """(token start, token end, first global chunk) of every segment, sequence by sequence."""
    seg = per * 64
    bounds = [(b * T, (b + 1) * T) for b in range(B)] if cu is None else list(zip(cu.tolist(), cu.tolist()[1:]))
    out, chunk0 = [], 0
    for b, (start, end) in enumerate(bounds):
        chunk0 = b * -(-T // 64) if cu is None else chunk0
        n = max(1, -(-(end - start) // seg))
        for j in range(n):
            out.append((start + j * seg, min(end, start + (j + 1) * seg), chunk0 + j * per))
        if cu is not None:
            chunk0 += -(-(end - start) // 64)
    return out


@pytest.mark.parametrize("cu, B, T, per", CASES)
def test_layout_matches_a_python_cut(cu, B, T, per):
    lay = segment_layout(B, T, None if cu is None else cu.to(DEVICE, torch.int32), per, torch.device(DEVICE))
    expected = _expected_segments(cu, B, T, per)
    used = int(lay.slot_count.sum())
    assert used == len(expected) <= lay.num_slots
    bounds = lay.cu_seqlens.tolist()
    got = [(bounds[s], bounds[s + 1], lay.chunk_offsets[s].item()) for s in range(used)]
    assert got == expected
    assert all(bounds[s] == bounds[s + 1] for s in range(used, lay.num_slots))  # unused: empty


@pytest.mark.parametrize("cu, B, T, per", CASES)
@pytest.mark.parametrize("K, V", [(16, 16), (24, 40)])
@pytest.mark.parametrize("reverse, transposed", [(False, False), (True, False), (True, True)])
def test_join_matches_the_loop(cu, B, T, per, K, V, reverse, transposed):
    lay = segment_layout(B, T, None if cu is None else cu.to(DEVICE, torch.int32), per, torch.device(DEVICE))
    HV, slots, n = 2, lay.num_slots, lay.first_slot.numel()
    M = torch.randn(slots, HV, K, K, device=DEVICE) * 0.3
    N = torch.randn(slots, HV, K, V, device=DEVICE)
    for initial in (None, torch.randn(n, HV, K, V, device=DEVICE)):
        starts, final = join_segments(M, N, lay, initial, reverse, transposed)
        ref_starts, ref_final = join_segments_reference(M.cpu(), N.cpu(), lay, None if initial is None else initial.cpu(),
                                                        reverse, transposed)
        used = int(lay.slot_count.sum())
        assert not torch.isnan(final).any()
        torch.testing.assert_close(starts[:used].cpu().double(), ref_starts[:used], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final.cpu().double(), ref_final, rtol=1e-5, atol=1e-5)
