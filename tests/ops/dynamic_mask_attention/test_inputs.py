"""Bad input gets a clear error naming the argument; never a crash or a silent wrong answer."""
import pytest
import torch

from conftest import DEVICE, DTYPES
from flash_dma import flash_dma_func, flash_dma_varlen_func

DT = DTYPES[-1]


def qkv(B=1, Sq=8, Sk=8, H=2, Hk=2, D=32, dtype=DT):
    return (torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype),
            torch.randn(B, Sk, Hk, D, device=DEVICE, dtype=dtype),
            torch.randn(B, Sk, Hk, D, device=DEVICE, dtype=dtype))


def expect(exc, words, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"


def test_rank():
    q, k, v = qkv()
    expect(ValueError, ["q", "4 dims"], flash_dma_func, q[0], k, v)


def test_dtype_and_mixed_dtypes():
    q, k, v = qkv()
    expect(TypeError, ["q", "float16", "float32"], flash_dma_func, q.float(), k.float(), v.float())
    other = torch.float16 if DT == torch.bfloat16 else torch.bfloat16
    expect(TypeError, ["k, v", "dtype"], flash_dma_func, q, k.to(other), v)


def test_heads_must_divide():
    q, k, v = qkv(H=3, Hk=2)
    expect(ValueError, ["k", "divide", "3"], flash_dma_func, q, k, v)


def test_head_dim_limits():
    q, k, v = qkv(D=264)
    expect(ValueError, ["head dim", "256", "264"], flash_dma_func, q, k, v)
    q, k, v = qkv(D=36)
    expect(ValueError, ["multiple of 8", "36"], flash_dma_func, q, k, v)


def test_shape_mismatches():
    q, k, v = qkv()
    expect(ValueError, ["v", "shape"], flash_dma_func, q, k, v[:, :4])
    expect(ValueError, ["k", "batch"], flash_dma_func, q, *(t.expand(2, -1, -1, -1) for t in (k, v)))
    expect(ValueError, ["k", "head dim"], flash_dma_func, q, k[..., :16], v[..., :16])


def test_mask_must_be_bool_and_broadcast():
    q, k, v = qkv(B=2, Sq=8, Sk=10)
    expect(TypeError, ["attn_mask", "bool"], flash_dma_func, q, k, v,
           attn_mask=torch.ones(2, 2, 8, 10, device=DEVICE))
    expect(ValueError, ["attn_mask", "dim 3"], flash_dma_func, q, k, v,
           attn_mask=torch.ones(2, 2, 8, 7, device=DEVICE, dtype=torch.bool))
    expect(ValueError, ["attn_mask", "dim 0"], flash_dma_func, q, k, v,
           attn_mask=torch.ones(3, 2, 8, 10, device=DEVICE, dtype=torch.bool))
    expect(ValueError, ["attn_mask", "4 dims"], flash_dma_func, q, k, v,
           attn_mask=torch.ones(8, 10, device=DEVICE, dtype=torch.bool))


def test_bias_dtype_and_broadcast():
    q, k, v = qkv(B=1, Sq=8, Sk=10, H=4, Hk=2)
    expect(TypeError, ["attn_bias", "float32"], flash_dma_func, q, k, v,
           attn_bias=torch.ones(1, 4, 8, 10, device=DEVICE, dtype=torch.float64))
    expect(ValueError, ["attn_bias", "dim 1", "[1, 2, 4]"], flash_dma_func, q, k, v,
           attn_bias=torch.ones(1, 3, 8, 10, device=DEVICE, dtype=DT))
    expect(ValueError, ["attn_bias", "dim 2"], flash_dma_func, q, k, v,
           attn_bias=torch.ones(1, 4, 5, 10, device=DEVICE, dtype=DT))


def test_device_mismatch_and_softmax_scale():
    q, k, v = qkv()
    expect(TypeError, ["softmax_scale"], flash_dma_func, q, k, v, softmax_scale=float("nan"))
    if DEVICE == "cuda":
        expect(ValueError, ["k", "cpu"], flash_dma_func, q, k.cpu(), v)


def test_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (t.cpu() for t in qkv())
    expect(RuntimeError, ["CUDA", "TRITON_INTERPRET=1"], flash_dma_func, q, k, v)


def test_varlen_cu_seqlens():
    q = torch.randn(10, 2, 32, device=DEVICE, dtype=DT)
    k = v = torch.randn(12, 2, 32, device=DEVICE, dtype=DT)
    cu = torch.tensor([0, 4, 10], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12], device=DEVICE, dtype=torch.int32)
    expect(TypeError, ["cu_seqlens_q", "int32"], flash_dma_varlen_func, q, k, v, cu.float(), cu_k, 6, 6)
    expect(ValueError, ["cu_seqlens_k", "3 offsets"], flash_dma_varlen_func, q, k, v, cu, cu_k[:2], 6, 6)
    expect(TypeError, ["max_seqlen_q"], flash_dma_varlen_func, q, k, v, cu, cu_k, 6.0, 6)
    expect(ValueError, ["q", "3 dims"], flash_dma_varlen_func, q[None], k, v, cu, cu_k, 6, 6)
    expect(ValueError, ["attn_bias", "dim 0"], flash_dma_varlen_func, q, k, v, cu, cu_k, 6, 6,
           attn_bias=torch.ones(3, 2, 6, 6, device=DEVICE, dtype=DT))
