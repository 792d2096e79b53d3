"""Host side of the CuTe mask/bias path (cute/masked.py), on CPU: the aux views the hooks index
(every broadcast shape reads the right element for each (b, h, q, k), stride 0 on every shared
dim), the fixed aux slots, and the dbias reduction choice. Needs no CuTe stack."""
import pytest
import torch

from flash_dma.runtime import config

from flash_dma.ops.dynamic_mask_attention.cute import masked
from flash_dma.ops.dynamic_mask_attention.reference import heads_to

B, H, HK, SQ, SK = 2, 6, 2, 5, 7
SHAPES = [(B, H, SQ, SK), (1, H, SQ, SK), (B, 1, SQ, SK), (B, HK, SQ, SK), (1, HK, 1, SK),
          (B, H, 1, SK), (1, 1, SQ, 1), (1, HK, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_aux_view_reads_the_broadcast_element(shape):
    t = torch.randn(shape)
    view, grouped = masked._pair_view(t, B, H, SQ, SK)
    full = heads_to(t, H, 1).expand(B, H, SQ, SK)
    assert grouped == (shape[1] not in (1, H))
    for dim, size in enumerate(shape):
        if size == 1:  # a shared dim: stride 0 whatever its size in the problem
            assert view.stride(dim) == 0
    if grouped:
        group = H // shape[1]
        assert view.shape == (B, shape[1], group, SQ, SK) and view.stride(2) == 0
        read = torch.stack([view[:, h // group, 0] for h in range(H)], 1)  # hooks.py's h // G
    else:
        assert view.shape == (B, H, SQ, SK)
        read = view
    assert torch.equal(read, full)


def test_aux_slots_are_fixed_and_bool_masks_read_as_bytes():
    mask = torch.rand(B, 1, SQ, SK) < 0.5
    bias = torch.randn(1, HK, SQ, SK)
    aux, grouped = masked._aux((B, H, SQ, SK), mask, None)
    assert len(aux) == 2 and aux[masked.MASK_SLOT].dtype == torch.uint8
    assert aux[masked.BIAS_SLOT].numel() == 1  # a placeholder keeps the mask at its slot
    assert torch.equal(aux[masked.MASK_SLOT].bool(), mask.expand(B, H, SQ, SK))
    assert grouped == {masked.MASK_SLOT: False}
    buffer = torch.zeros(bias.shape)
    aux, grouped = masked._aux((B, H, SQ, SK), None, bias, buffer)
    assert len(aux) == 3 and grouped == {masked.BIAS_SLOT: True, masked.DBIAS_SLOT: True}
    assert aux[masked.DBIAS_SLOT].data_ptr() == buffer.data_ptr()
    aux, _ = masked._aux((B, H, SQ, SK), None, bias)
    assert len(aux) == 1  # a forward carries no dbias slot


@pytest.mark.parametrize("shape, reduce", [((B, H, SQ, SK), "store"), ((1, H, SQ, SK), "atomic"),
                                           ((B, 1, SQ, SK), "atomic"), ((B, HK, SQ, SK), "atomic")])
def test_dbias_reduce(shape, reduce):
    assert masked.dbias_reduce(B, H, torch.empty(shape)) == reduce
    assert masked.dbias_reduce(1, H, torch.empty(1, H, SQ, SK)) == "store"  # B = 1: one writer


def test_backward_gaps():
    kw = dict(seqlen_q=SQ, seqlen_k=SK, batch=B, num_heads=H, want_dbias=True, deterministic=False,
              head_dim=128)
    assert masked.backward_gap(mask=None, bias=torch.empty(B, H, SQ, SK), **kw) is None
    assert "along keys" in masked.backward_gap(mask=None, bias=torch.empty(B, H, SQ, 1), **kw)
    # a bias broadcast along queries: dbias summed per key tile where FA4's scores are transposed
    for head_dim in masked.SUM_QUERIES_HEAD_DIMS:
        assert masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK), **{**kw, "head_dim": head_dim}) is None
    assert "over queries" in masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK),
                                                 **{**kw, "head_dim": 256})
    with config.overrides(attention_cute_direct_bias_backward=False):
        assert "over queries" in masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK), **kw)
    # a single query (or key) is no broadcast
    assert masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK),
                               **{**kw, "seqlen_q": 1, "head_dim": 256}) is None
    assert masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK),
                               **{**kw, "want_dbias": False, "head_dim": 256}) is None
    det = {**kw, "deterministic": True}
    assert masked.backward_gap(mask=None, bias=torch.empty(B, H, SQ, SK), **det) is None
    assert masked.backward_gap(mask=None, bias=torch.empty(B, H, 1, SK), **det) is None  # one writer
    assert "atomics" in masked.backward_gap(mask=None, bias=torch.empty(1, H, SQ, SK), **det)
    assert "mask" in masked.backward_gap(mask=torch.empty(B, H, SQ, SK, dtype=torch.bool), bias=None,
                                         **{**det, "want_dbias": False})
