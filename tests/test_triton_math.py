"""exp2 on the FMA pipe: accuracy, exact zeros, and the half-and-half split of a tile."""
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, DTYPES
from flash_dma.runtime import config
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


def test_attention_with_polynomial_exp2(monkeypatch):
    """The forward with half of its exponentials on the FMA pipe matches the reference."""
    from test_attention import check_against_reference, make_inputs
    monkeypatch.setattr(config, "INTERPRETER_CONFIG",
                        config.LaunchConfig(16, 16, 1, 1, exp2_poly=True))
    if DEVICE == "cuda":
        real = config.select_config
        monkeypatch.setattr("flash_dma.ops.dynamic_mask_attention.interface.select_config",
                            lambda k, *a, **kw: config.LaunchConfig(**{**real(k, *a, **kw).__dict__,
                                                                       "exp2_poly": k == "attn_fwd"}))
    dtype = DTYPES[-1]
    q, k, v, mask, bias = make_inputs(2, 37, 45, 4, 2, 32, dtype, (2, 4, 37, 45), (2, 4, 37, 45))
    mask[:, :, 7] = False  # an empty row: still exactly 0, no NaN
    out, _ = check_against_reference(q, k, v, mask, bias, True, dtype)
    assert (out[:, 7] == 0).all()
