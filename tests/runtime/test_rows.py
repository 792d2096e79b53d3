"""runtime.rows.zero_rows_past: rows at or past cu_seqlens[-1] become 0, the others are untouched."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.runtime.rows import zero_rows_past


@pytest.mark.parametrize("shape, row_dim", [((1, 37, 3, 5), 1), ((37, 2, 8), 0), ((1, 37), 1)])
@pytest.mark.parametrize("end", [0, 1, 20, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_past_the_end_are_zero_and_the_rest_untouched(shape, row_dim, end, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype) + 3  # no zeros before
    before = x.clone()
    cu = torch.tensor([0, end // 2, end], dtype=torch.int32, device=DEVICE)
    zero_rows_past(cu, row_dim, x)
    kept, past = before.narrow(row_dim, 0, end), x.narrow(row_dim, end, shape[row_dim] - end)
    assert torch.equal(x.narrow(row_dim, 0, end), kept)
    assert (past == 0).all()


def test_strided_tensors_and_int64_offsets():
    base = torch.randn(1, 10, 4, 6, device=DEVICE) + 3
    x = base.transpose(2, 3)  # not contiguous: the masked-fill path
    cu = torch.tensor([0, 7], dtype=torch.int64, device=DEVICE)
    zero_rows_past(cu, 1, x, None)
    assert (base[:, 7:] == 0).all() and (base[:, :7] != 0).all()
