"""exp2 on the FMA pipe: accuracy, exact zeros, and the half-and-half split of a tile."""
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from flash_dma.runtime.triton_math import exp2_poly, exp2_split


@triton.jit
def _exp2_kernel(X, Y, POLY: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(Y + offs, exp2_split(tl.load(X + offs), POLY))


@triton.jit
def _exp2_poly_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, exp2_poly(tl.load(X + offs)))


def test_exp2_poly_accuracy_and_zeros():
    x = torch.cat([-torch.rand(1000) * 130.0, torch.tensor([0.0, -1e-7, -0.5, -1.0, -125.9, -126.5,
                                                             -200.0, float("-inf")])])
    x = torch.nn.functional.pad(x, (0, 1024 - x.numel()), value=-3.0).to(DEVICE)
    y = torch.empty_like(x)
    _exp2_poly_kernel[(1,)](x, y, 1024)
    ref = torch.exp2(x.double())
    normal = x > -126.0
    rel = ((y.double() - ref).abs() / ref)[normal]
    assert rel.max().item() < 1e-4
    assert (y[x < -126.0] == 0).all(), "below the normal range (and -inf) must give exactly 0"


@pytest.mark.parametrize("poly", [False, True])
def test_exp2_split_keeps_every_column_in_place(poly):
    x = -torch.rand(16, 32, device=DEVICE) * 20
    x[3, 5] = float("-inf")
    y = torch.empty_like(x)
    _exp2_kernel[(1,)](x, y, poly, 16, 32)
    assert torch.allclose(y, torch.exp2(x), rtol=1e-4, atol=0)
    assert y[3, 5] == 0
