"""The public state-gradient pass (chunk_gated_delta_rule_bwd_dhu) in its five modes against the
fp64 reference, batched and packed."""
import pytest
import torch

from conftest import DTYPES

from .cases import MODES, check_dhu, cu_from_lengths, dhu_inputs


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("mode", list(MODES))
def test_bwd_dhu(mode, varlen):
    dtype = DTYPES[-1]
    H = 1 if mode in ("A", "B", "C") else 2  # q/k with fewer heads than v where they are ungated
    if varlen:
        lengths = [1, 64, 0, 150]  # the last: two full chunks (one decay of D) and a partial one
        cu = cu_from_lengths(lengths)
        x = dhu_inputs(1, sum(lengths), H, 2, 16, 32, dtype, mode, cu)
    else:
        cu = None
        x = dhu_inputs(2, 130, H, 2, 32, 32, dtype, mode)
    check_dhu(x, dtype, None if mode == "A" else 0.25, cu)


@pytest.mark.parametrize("mode", ["B", "E"])
def test_bwd_dhu_head_dim_256(mode):
    """K = 256 takes its own form of the state update in the kernel (products accumulated into
    the state itself)."""
    dtype = DTYPES[-1]
    x = dhu_inputs(1, 100, 1, 1, 256, 16, dtype, mode)
    check_dhu(x, dtype, 0.25)


def test_bwd_dhu_after_cu_seqlens_changes_in_place():
    """The chunk layout (and dh's chunk count) is remembered per cu_seqlens tensor: an in-place
    change of the lengths must be seen."""
    dtype = DTYPES[-1]
    cu = cu_from_lengths([70, 10])
    check_dhu(dhu_inputs(1, 80, 1, 1, 16, 16, dtype, "C", cu), dtype, 0.5, cu)
    cu.copy_(cu_from_lengths([60, 20]))  # 3 chunks -> 2
    check_dhu(dhu_inputs(1, 80, 1, 1, 16, 16, dtype, "C", cu), dtype, 0.5, cu)


# ---------------------------------------------------------------------------------------------
# real sizes (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_bwd_dhu_head_dim_256(mode):
    dtype = torch.bfloat16
    x = dhu_inputs(2, 2048, 2 if mode in ("A", "B", "C") else 4, 4, 256, 256, dtype, mode)
    check_dhu(x, dtype, 256 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_bwd_dhu(mode, varlen):
    dtype = torch.bfloat16
    H = 8 if mode in ("A", "B", "C") else 16
    if varlen:
        lengths = [1, 64, 0, 1000, 2500, 31, 500]
        cu = cu_from_lengths(lengths)
        x = dhu_inputs(1, sum(lengths), H, 16, 128, 128, dtype, mode, cu)
    else:
        cu = None
        x = dhu_inputs(2, 4096, H, 16, 128, 128, dtype, mode)
    check_dhu(x, dtype, 128 ** -0.5, cu)
