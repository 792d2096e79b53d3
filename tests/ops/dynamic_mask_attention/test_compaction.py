"""Key-wise top-k masks run as dense attention over the gathered kept keys (compaction.py):
topk_mask_from_bias remembers exact rows, the compacted call matches the fp64 reference and the
gathered-key walk in output, lse and every gradient, and calls it cannot serve keep the walk."""
import pytest
import torch

from conftest import DEVICE, DTYPES
from test_attention import check_against_reference
from flash_dma import flash_dma_func, topk_mask_from_bias
from flash_dma.ops.dynamic_mask_attention import compaction
from flash_dma.runtime import config

B, SQ, SK, H, HK, D, KEEP = 2, 70, 150, 4, 2, 32, 20


@pytest.fixture
def compacted(monkeypatch):
    """Compaction on; records each compact() call's kept-key count."""
    calls = []
    real = compaction.compact

    def recording(q, k, v, bias, kept):
        calls.append(kept.shape[-1])
        return real(q, k, v, bias, kept)
    monkeypatch.setattr(compaction, "compact", recording)
    with config.overrides(attention_keywise_compaction="on"):
        yield calls


def _keywise_mask(mask_heads, batch=B):
    return topk_mask_from_bias(torch.randn(batch, mask_heads, 1, SK, device=DEVICE), KEEP)


def test_topk_mask_remembers_its_exact_rows():
    mask = _keywise_mask(HK)
    kept = compaction.kept_keys(mask)
    assert kept is not None and kept.shape == (B, HK, 1, KEEP)
    assert mask.gather(-1, kept).all() and kept.sort(-1).values.diff(dim=-1).gt(0).all()  # distinct
    assert torch.equal(mask.sum(-1), torch.full((B, HK, 1), KEEP, device=DEVICE))
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]  # edited in place: no longer those rows
    assert compaction.kept_keys(mask) is None
    padded = topk_mask_from_bias(torch.randn(B, HK, 1, SK, device=DEVICE), KEEP,
                                 key_padding_mask=torch.ones(B, SK, dtype=torch.bool, device=DEVICE))
    full_rows = topk_mask_from_bias(torch.randn(B, HK, SQ, SK, device=DEVICE), KEEP)
    assert compaction.kept_keys(padded) is None and compaction.kept_keys(full_rows) is None
    assert compaction.kept_keys(mask.clone()) is None  # another tensor, same contents


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_heads,mask_batch,bias_shape", [
    (HK, B, None), (HK, B, (B, HK, 1, SK)), (HK, B, (B, H, 1, SK)), (1, B, (1, 1, 1, SK)),
    (1, B, (B, H, SQ, SK)), (HK, 1, (B, HK, SQ, SK)), (HK, 1, (1, HK, 1, SK))])
def test_compacted_call_matches_the_reference(compacted, dtype, mask_heads, mask_batch, bias_shape):
    q = torch.randn(B, SQ, H, D, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, SK, HK, D, device=DEVICE, dtype=dtype) for _ in range(2))
    bias = torch.randn(bias_shape, device=DEVICE, dtype=dtype) if bias_shape else None
    mask = _keywise_mask(mask_heads, mask_batch)
    out, grads = check_against_reference(q, k, v, mask, bias, False, dtype)
    assert compacted == [KEEP]
    # the same call through the gathered-key walk
    with config.overrides(attention_keywise_compaction="off"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
            [bias.clone().requires_grad_()] if bias is not None else [])
        walked, lse_walked = flash_dma_func(*leaves[:3], attn_mask=mask,
                                            attn_bias=leaves[3] if bias is not None else None,
                                            return_lse=True)
    assert compacted == [KEEP]
    assert (out - walked).abs().max().item() < 1e-2
    _, lse = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, return_lse=True)
    assert (lse - lse_walked).abs().max().item() < 1e-3


@pytest.mark.parametrize("why", ["causal", "deterministic", "mask per query head", "not from topk",
                                 "full-row bias shared over the batch", "mask broadcast along keys"])
def test_calls_it_cannot_serve_keep_the_gathered_walk(compacted, why):
    dtype = torch.float16
    q = torch.randn(B, SQ, H, D, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, SK, HK, D, device=DEVICE, dtype=dtype) for _ in range(2))
    mask = _keywise_mask(H if why == "mask per query head" else HK)
    bias = None
    if why == "not from topk":
        mask = mask.clone()
    elif why == "full-row bias shared over the batch":
        bias = torch.randn(1, HK, SQ, SK, device=DEVICE, dtype=dtype)
    elif why == "mask broadcast along keys":  # one key kept of one: every key visible
        mask = topk_mask_from_bias(torch.randn(B, HK, 1, 1, device=DEVICE), 1)
        assert compaction.kept_keys(mask) is not None
    check_against_reference(q, k, v, mask, bias, why == "causal", dtype, grad=False,
                            deterministic=why == "deterministic")
    assert compacted == []


@pytest.mark.parametrize("head_dim", [D, 64])
def test_auto_by_default_where_the_cute_backend_runs(head_dim):
    """auto (the default) compacts only where the dense call runs on CuTe: a head dim FA4 takes
    (32 is not one), a 16-bit q, the stack on this device, the backend not forced to Triton;
    off never compacts."""
    from flash_dma.ops.dynamic_mask_attention.cute import availability, plain, select
    mask = _keywise_mask(HK)
    q = torch.randn(B, SQ, H, head_dim, device=DEVICE, dtype=torch.float16)
    k = torch.randn(B, SK, HK, head_dim, device=DEVICE, dtype=torch.float16)
    served = (availability.cute_backend_status(q.device) is None
              and head_dim in plain.PLAIN_HEAD_DIMS and select.requested_backend() != "triton")
    assert (compaction.plan(q, k, mask, None, False, False) is not None) == served
    with config.overrides(attention_keywise_compaction="off"):
        assert compaction.plan(q, k, mask, None, False, False) is None
    with config.overrides(attention_keywise_compaction="on"):
        assert compaction.plan(q, k, mask, None, False, False) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bias_shape", [None, (2, 8, 1, 4100), (2, 8, 1000, 4100)])
def test_gpu_compacted_on_the_cute_backend(monkeypatch, head_dim, bias_shape):
    """Under auto on an SM90 GPU with the CuTe stack: top-512 of 4100 keys, bf16, against fp64."""
    from flash_dma.ops.dynamic_mask_attention.cute import availability
    if availability.cute_backend_status(DEVICE) is not None:
        pytest.skip("the CuTe backend cannot run here")
    calls = []
    real = compaction.compact
    monkeypatch.setattr(compaction, "compact", lambda *a: calls.append(1) or real(*a))
    dtype = torch.bfloat16
    q = torch.randn(2, 1000, 8, head_dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(2, 4100, 8, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    bias = torch.randn(bias_shape, device=DEVICE, dtype=dtype) if bias_shape else None
    mask = topk_mask_from_bias(torch.randn(2, 8, 1, 4100, device=DEVICE), 512)
    with config.overrides(attention_keywise_compaction="auto"):
        check_against_reference(q, k, v, mask, bias, False, dtype)
    assert calls == [1]
