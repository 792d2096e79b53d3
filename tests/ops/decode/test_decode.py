"""Decoding with a KV cache against the fp64 reference: outputs, lse and the cache after the call."""
import pytest
import torch

from conftest import DEVICE, DTYPES
from helpers import assert_close, assert_lse_close
from flash_dma import topk_mask_from_bias
from flash_dma.ops.decode import decode_reference, flash_dma_with_kvcache, update_topk_mask


def make_cache(B, S_max, Hk, D, dtype, B_cache=None):
    k_cache = torch.randn(B_cache or B, S_max, Hk, D, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(B_cache or B, S_max, Hk, D, device=DEVICE, dtype=dtype)
    return k_cache, v_cache


def to_paged(k_cache, v_cache, page_size, spare_pages=3):
    """The same logical contents in a paged pool: rows' pages shuffled across the pool, plus some
    pages nobody uses. -> (k_pages, v_pages, block_table)."""
    B, S_max, Hk, D = k_cache.shape
    per_row = -(-S_max // page_size)
    n_pages = B * per_row + spare_pages
    order = torch.randperm(n_pages, device=DEVICE)[:B * per_row].view(B, per_row).to(torch.int32)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.randn(n_pages, page_size, Hk, D, device=DEVICE, dtype=cache.dtype)
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_row * page_size - S_max))
        pool[order.long()] = padded.view(B, per_row, page_size, Hk, D)
        pools.append(pool)
    return pools[0], pools[1], order


def check(q, k_cache, v_cache, dtype, **kw):
    """Our call against the reference on copies of the caches; the caches after the call must
    equal the reference's exactly (new tokens written, nothing else touched)."""
    ref_out, ref_lse, ref_k, ref_v = decode_reference(q, k_cache.clone(), v_cache.clone(),
                                                      **{n: a for n, a in kw.items() if n != "num_splits"})
    out, lse = flash_dma_with_kvcache(q, k_cache, v_cache, return_lse=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("out", out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    assert torch.equal(k_cache, ref_k), "k_cache after the call differs from the expected cache"
    assert torch.equal(v_cache, ref_v), "v_cache after the call differs from the expected cache"
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [1, 2, 7, 16])
def test_queries_and_cache_lengths(seqlen_q, causal):
    dtype = DTYPES[-1]
    B, H, Hk, D, S_max = 4, 4, 2, 32, 45
    q = torch.randn(B, seqlen_q, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    lengths = torch.tensor([0, 1, 23, S_max], device=DEVICE, dtype=torch.int32)  # empty, one, odd, full
    check(q, k_cache, v_cache, dtype, cache_seqlens=lengths, is_causal=causal)


@pytest.mark.parametrize("num_splits", [1, 2, 5, None])
def test_split_counts(num_splits):
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 2, 3, 6, 2, 40, 90
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    lengths = torch.tensor([70, 9], device=DEVICE, dtype=torch.int32)
    check(q, k_cache, v_cache, dtype, cache_seqlens=lengths, num_splits=num_splits)


def test_gpu_sized_tiles():
    """The GPU's tile sizes (64 packed rows, 64 keys) in the interpreter: tiles that straddle
    pages of 16, a ragged last row block, gathered keys."""
    from flash_dma.runtime.config import LaunchConfig, overrides
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 2, 5, 16, 1, 32, 160  # 80 packed rows: two row blocks
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, Sq, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([150, 77], device=DEVICE, dtype=torch.int32)
    mask = torch.rand(B, 1, 1, S_max, device=DEVICE) < 0.7
    bias = torch.randn(B, H, 1, S_max, device=DEVICE, dtype=dtype)
    k_pages, v_pages, table = to_paged(k_cache, v_cache, 16)
    with overrides(decode_fwd=LaunchConfig(block_m=64, block_n=64, num_warps=1, num_stages=1)):
        check(q, k_pages, v_pages, dtype, k=k, v=v, cache_seqlens=lengths, block_table=table,
              attn_mask=mask, attn_bias=bias, num_splits=2)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (6, 3)])
def test_gqa_mqa_mha(heads):
    dtype = DTYPES[-1]
    H, Hk = heads
    q = torch.randn(2, 2, H, 16, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(2, 37, Hk, 16, dtype)
    check(q, k_cache, v_cache, dtype, cache_seqlens=torch.tensor([37, 20], device=DEVICE,
                                                                 dtype=torch.int32), num_splits=2)


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_append_new_tokens(new_tokens):
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 3, new_tokens, 4, 2, 32, 40
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, new_tokens, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([0, 17, S_max - new_tokens], device=DEVICE, dtype=torch.int32)
    check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths, num_splits=2)


def test_append_with_python_int_lengths():
    dtype = DTYPES[-1]
    q = torch.randn(2, 1, 2, 32, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(2, 24, 2, 32, dtype)
    k, v = (torch.randn(2, 1, 2, 32, device=DEVICE, dtype=dtype) for _ in range(2))
    check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=11)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_equals_contiguous(page_size):
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 3, 2, 4, 2, 32, 64
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, 2, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([5, 40, 62], device=DEVICE, dtype=torch.int32)  # 40 + 2 crosses a page
    bias = torch.randn(B, Hk, 1, S_max, device=DEVICE, dtype=dtype)
    k_pages, v_pages, table = to_paged(k_cache, v_cache, page_size)
    kw = dict(k=k, v=v, cache_seqlens=lengths, attn_bias=bias, num_splits=2)
    contiguous, _ = check(q, k_cache, v_cache, dtype, **kw)
    paged, _ = check(q, k_pages, v_pages, dtype, block_table=table, **kw)
    assert torch.allclose(paged.float(), contiguous.float(), atol=1e-3, rtol=1e-3)
    # the pages hold what the contiguous cache holds, the appended tokens included
    for b in range(B):
        logical = k_pages[table[b].long()].reshape(-1, Hk, D)[:S_max]
        assert torch.equal(logical, k_cache[b])


def test_cache_batch_idx():
    dtype = DTYPES[-1]
    B, H, Hk, D, S_max = 2, 4, 2, 32, 30
    q = torch.randn(B, 1, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype, B_cache=5)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    rows = torch.tensor([3, 1], device=DEVICE, dtype=torch.int32)
    lengths = torch.tensor([12, 29], device=DEVICE, dtype=torch.int32)
    check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths, cache_batch_idx=rows)


# (mask shape, bias shape) as functions of (B, H, Hk, Sq, S_max)
MASKS = {
    "keywise-gather/kvhead-bias": (lambda B, H, Hk, Sq, S: (B, Hk, 1, S), lambda B, H, Hk, Sq, S: (B, Hk, 1, S)),
    "keywise-shared/head-bias": (lambda B, H, Hk, Sq, S: (1, 1, 1, S), lambda B, H, Hk, Sq, S: (B, H, 1, S)),
    "keywise-perhead (union gathered)": (lambda B, H, Hk, Sq, S: (B, H, 1, S), None),
    "dense/dense": (lambda B, H, Hk, Sq, S: (B, H, Sq, S), lambda B, H, Hk, Sq, S: (1, Hk, Sq, S)),
    "querywise/bias-only": (lambda B, H, Hk, Sq, S: (B, 1, Sq, 1), lambda B, H, Hk, Sq, S: (B, 1, 1, S)),
}


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kind", list(MASKS))
def test_masks_and_biases(kind, paged):
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 2, 3, 4, 2, 32, 48
    dims = (B, H, Hk, Sq, S_max)
    mask_fn, bias_fn = MASKS[kind]
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    mask = torch.rand(mask_fn(*dims), device=DEVICE) < 0.4 if mask_fn else None
    bias = torch.randn(bias_fn(*dims), device=DEVICE, dtype=dtype) if bias_fn else None
    lengths = torch.tensor([30, 44], device=DEVICE, dtype=torch.int32)
    kw = dict(k=k, v=v, cache_seqlens=lengths, attn_mask=mask, attn_bias=bias, num_splits=2)
    if paged:
        k_cache, v_cache, kw["block_table"] = to_paged(k_cache, v_cache, 16)
    check(q, k_cache, v_cache, dtype, **kw)


def test_fp32_bias_and_scale():
    dtype = DTYPES[-1]
    q = torch.randn(1, 2, 2, 32, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(1, 33, 1, 32, dtype)
    bias = torch.randn(1, 2, 2, 33, device=DEVICE, dtype=torch.float32)
    check(q, k_cache, v_cache, dtype, cache_seqlens=33, attn_bias=bias, softmax_scale=0.3)


def test_empty_kept_sets_give_zero_and_inf_lse():
    dtype = DTYPES[-1]
    B, Sq, H, Hk, D, S_max = 3, 2, 4, 2, 32, 40
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    mask = torch.rand(B, Hk, 1, S_max, device=DEVICE) < 0.5
    mask[0] = False           # row 0: nothing kept in any head
    mask[1, 1] = False        # row 1: kv head 1 keeps nothing
    mask[2, :, :, 10:] = False  # row 2: only keys past its length 10... none kept below
    mask[2, :, :, :10] = False
    lengths = torch.tensor([40, 25, 10], device=DEVICE, dtype=torch.int32)
    for splits in (1, 3):
        out, lse = check(q, k_cache, v_cache, dtype, cache_seqlens=lengths, attn_mask=mask,
                         num_splits=splits)
        assert torch.all(out[0] == 0) and torch.all(out[2] == 0) and torch.all(out[1, :, 2:] == 0)
        assert torch.all(torch.isinf(lse[0])) and torch.all(torch.isinf(lse[1, 2:]))


def test_causal_rows_that_see_no_key():
    dtype = DTYPES[-1]
    q = torch.randn(2, 5, 2, 16, device=DEVICE, dtype=dtype)  # 5 queries over 0 and 2 keys
    k_cache, v_cache = make_cache(2, 20, 1, 16, dtype)
    lengths = torch.tensor([0, 2], device=DEVICE, dtype=torch.int32)
    out, lse = check(q, k_cache, v_cache, dtype, cache_seqlens=lengths, num_splits=2)
    assert torch.all(out[0] == 0) and torch.all(out[1, :3] == 0)


def _inputs(B=2, Sq=1, H=4, Hk=2, D=32, S_max=32):
    dtype = DTYPES[-1]
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([3, 7], device=DEVICE, dtype=torch.int32)
    return q, k_cache, v_cache, k, v, lengths


def _bad_calls():
    """(name, kwargs maker, exception, text in the message). Each gets fresh inputs."""
    i32 = dict(device=DEVICE, dtype=torch.int32)
    return [
        ("q dtype", lambda q, kc, vc, k, v, n: dict(q=q.float()), TypeError, "q"),
        ("too many queries", lambda q, kc, vc, k, v, n: dict(q=q.expand(2, 17, 4, 32)), ValueError, "q"),
        ("cache dtype", lambda q, kc, vc, k, v, n: dict(k_cache=kc.float()), TypeError, "k_cache"),
        ("cache shapes", lambda q, kc, vc, k, v, n: dict(v_cache=vc[:, :16]), ValueError, "v_cache"),
        ("cache head dim", lambda q, kc, vc, k, v, n: dict(k_cache=kc[..., :16], v_cache=vc[..., :16]),
         ValueError, "k_cache"),
        ("cache heads", lambda q, kc, vc, k, v, n: dict(k_cache=kc[:, :, :1].expand(2, 32, 3, 32),
                                                         v_cache=vc[:, :, :1].expand(2, 32, 3, 32)),
         ValueError, "k_cache"),
        ("cache batch", lambda q, kc, vc, k, v, n: dict(k_cache=kc[:1], v_cache=vc[:1]), ValueError, "k_cache"),
        ("k without v", lambda q, kc, vc, k, v, n: dict(v=None), ValueError, "k, v"),
        ("new token heads", lambda q, kc, vc, k, v, n: dict(k=k[:, :, :1], v=v[:, :, :1]), ValueError, "k"),
        ("new token dtype", lambda q, kc, vc, k, v, n: dict(k=k.float(), v=v.float()), TypeError, "k"),
        ("no cache_seqlens", lambda q, kc, vc, k, v, n: dict(cache_seqlens=None), ValueError, "cache_seqlens"),
        ("seqlens dtype", lambda q, kc, vc, k, v, n: dict(cache_seqlens=n.long()), TypeError, "cache_seqlens"),
        ("seqlens shape", lambda q, kc, vc, k, v, n: dict(cache_seqlens=n[:1]), ValueError, "cache_seqlens"),
        ("int seqlens past capacity", lambda q, kc, vc, k, v, n: dict(cache_seqlens=32), ValueError,
         "cache_seqlens"),
        ("batch idx dtype", lambda q, kc, vc, k, v, n: dict(cache_batch_idx=n.long()), TypeError,
         "cache_batch_idx"),
        ("table dtype", lambda q, kc, vc, k, v, n: dict(block_table=torch.zeros(2, 2, device=DEVICE)),
         TypeError, "block_table"),
        ("table with batch idx", lambda q, kc, vc, k, v, n: dict(block_table=torch.zeros(2, 2, **i32),
                                                                  cache_batch_idx=torch.zeros(2, **i32)),
         ValueError, "cache_batch_idx"),
        ("page size", lambda q, kc, vc, k, v, n: dict(k_cache=kc[:, :24], v_cache=vc[:, :24],
                                                      block_table=torch.zeros(2, 2, **i32)),
         ValueError, "page size"),
        ("mask dtype", lambda q, kc, vc, k, v, n: dict(attn_mask=torch.ones(2, 1, 1, 32, device=DEVICE)),
         TypeError, "attn_mask"),
        ("mask width", lambda q, kc, vc, k, v, n: dict(attn_mask=torch.ones(2, 1, 1, 31, device=DEVICE,
                                                                            dtype=torch.bool)),
         ValueError, "attn_mask"),
        ("bias heads", lambda q, kc, vc, k, v, n: dict(attn_bias=torch.zeros(2, 3, 1, 32, device=DEVICE,
                                                                             dtype=q.dtype)),
         ValueError, "attn_bias"),
        ("num_splits", lambda q, kc, vc, k, v, n: dict(num_splits=-1), TypeError, "num_splits"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_input_raises_and_writes_nothing(case):
    _, make, exc, text = case
    q, k_cache, v_cache, k, v, lengths = _inputs()
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=lengths)
    args.update(make(q, k_cache, v_cache, k, v, lengths))
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(exc, match=text):
        flash_dma_with_kvcache(**args)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_device_values_out_of_range():
    """Without check_inputs: bad rows give NaN and write nothing, the others are right. With it:
    ValueError naming the argument, nothing written."""
    q, k_cache, v_cache, k, v, _ = _inputs(B=3)
    lengths = torch.tensor([3, 32, -1], device=DEVICE, dtype=torch.int32)  # 32 + 1 > 32
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_dma_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, check_inputs=True)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    rows = torch.tensor([0, 1, 2], device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_dma_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(
            [1, 1, 1], device=DEVICE, dtype=torch.int32), cache_batch_idx=rows + 2, check_inputs=True)
    out, lse = flash_dma_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                      return_lse=True, num_splits=2)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    assert not torch.isnan(out[0]).any()
    assert torch.equal(k_cache[1:], before[0][1:]) and torch.equal(v_cache[1:], before[1][1:])
    assert torch.equal(k_cache[0, 3], k[0, 0])
    # a block table pointing past the pool (checked), and the same table unchecked: no write
    kp, vp, table = to_paged(k_cache[:2], v_cache[:2], 16)
    table[1, 0] = kp.shape[0] + 5
    kq = q[:2]
    kk, kv_ = torch.randn_like(k[:2]), torch.randn_like(v[:2])  # (k[0] is at position 3 already)
    before = kp.clone(), vp.clone()
    short = torch.tensor([3, 7], device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        flash_dma_with_kvcache(kq, kp, vp, kk, kv_, cache_seqlens=short, block_table=table,
                               check_inputs=True)
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])
    flash_dma_with_kvcache(kq, kp, vp, kk, kv_, cache_seqlens=short, block_table=table)
    changed = (kp != before[0]).any(-1).any(-1).nonzero()
    assert changed.tolist() == [[table[0, 0].item(), 3]]


def test_update_topk_mask_matches_topk_of_prefix():
    B, H, S, keep = 3, 2, 64, 8
    bias = torch.randn(B, H, 1, S, device=DEVICE)
    start = torch.tensor([0, 5, 20], device=DEVICE)
    prefix = torch.arange(S, device=DEVICE).view(1, 1, 1, S) < start.view(B, 1, 1, 1)
    mask = topk_mask_from_bias(bias.masked_fill(~prefix, float("-inf")), keep) & prefix
    lengths = start.clone()
    for step in range(30):
        n = 1 if step % 3 else 2
        update_topk_mask(mask, bias, lengths, keep, num_new=n)
        lengths += n
        seen = torch.arange(S, device=DEVICE).view(1, 1, 1, S) < lengths.view(B, 1, 1, 1)
        want = topk_mask_from_bias(bias.masked_fill(~seen, float("-inf")), keep) & seen
        assert torch.equal(mask, want), f"step {step}"


def test_update_topk_mask_then_decode():
    """The decoding loop the helper is for: append a token, update the mask, attend."""
    dtype = DTYPES[-1]
    B, H, Hk, D, S_max, keep = 2, 4, 2, 32, 48, 6
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    bias = torch.randn(B, Hk, 1, S_max, device=DEVICE, dtype=dtype)
    lengths = torch.tensor([10, 20], device=DEVICE, dtype=torch.int32)
    seen = torch.arange(S_max, device=DEVICE) < lengths.view(B, 1, 1, 1)
    mask = topk_mask_from_bias(bias.masked_fill(~seen, float("-inf")), keep) & seen
    for _ in range(2):
        q = torch.randn(B, 1, H, D, device=DEVICE, dtype=dtype)
        k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
        update_topk_mask(mask, bias, lengths, keep)
        assert (mask.sum(-1) == keep).all()
        check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths, attn_mask=mask,
              attn_bias=bias)
        lengths += 1


# ------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_real_sizes(head_dim, seqlen_q, dtype):
    B, H, Hk, S_max = 8, 32, 8, 4100
    q = torch.randn(B, seqlen_q, H, head_dim, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, head_dim, dtype)
    k, v = (torch.randn(B, seqlen_q, Hk, head_dim, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.randint(0, S_max - seqlen_q + 1, (B,), device=DEVICE, dtype=torch.int32)
    lengths[0] = S_max - seqlen_q
    lengths[1] = 0
    check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("per_query_head", [False, True])
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_paged_keywise_topk(page_size, num_splits, per_query_head):
    dtype = torch.bfloat16
    B, Sq, H, Hk, D, S_max = 4, 2, 16, 4, 128, 8192
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, Sq, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([8190, 5000, 1, 3333], device=DEVICE, dtype=torch.int32)
    bias = torch.randn(B, H if per_query_head else Hk, 1, S_max, device=DEVICE, dtype=dtype)
    mask = topk_mask_from_bias(bias, 512)
    k_pages, v_pages, table = to_paged(k_cache, v_cache, page_size)
    check(q, k_pages, v_pages, dtype, k=k, v=v, cache_seqlens=lengths, block_table=table,
          attn_mask=mask, attn_bias=bias, num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_batch_idx_dense_mask_bias():
    dtype = torch.bfloat16
    B, Sq, H, Hk, D, S_max = 6, 3, 8, 2, 128, 3000
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype, B_cache=9)
    rows = torch.randperm(9, device=DEVICE)[:B].to(torch.int32)
    lengths = torch.randint(0, S_max - 1, (B,), device=DEVICE, dtype=torch.int32)
    mask = torch.rand(B, H, Sq, S_max, device=DEVICE) < 0.3
    bias = torch.randn(1, Hk, Sq, S_max, device=DEVICE, dtype=torch.float32)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    check(q, k_cache, v_cache, dtype, k=k, v=v, cache_seqlens=lengths, cache_batch_idx=rows,
          attn_mask=mask, attn_bias=bias)


@pytest.mark.gpu
def test_gpu_cache_past_2_31_elements():
    """B66 S32768 Hk8 D128: each cache holds more than 2^31 elements, so offsets into the last
    rows need int64 (appending there and reading there)."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2 ** 30:
        pytest.skip("needs 24 GiB of GPU memory")
    dtype = torch.bfloat16
    B, H, Hk, D, S_max = 66, 8, 8, 128, 32768
    assert B * S_max * Hk * D > 2 ** 31
    k_cache = torch.zeros(B, S_max, Hk, D, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[-1].normal_()
    v_cache[-1].normal_()
    q = torch.randn(B, 1, H, D, device=DEVICE, dtype=dtype)
    lengths = torch.full((B,), S_max - 40, device=DEVICE, dtype=torch.int32)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    for splits in (1, 4):
        out, lse = flash_dma_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                          return_lse=True, num_splits=splits)
        assert torch.equal(k_cache[-1, S_max - 40], k[-1, 0])
        assert torch.equal(v_cache[-1, S_max - 40], v[-1, 0])
        ref, ref_lse, _, _ = decode_reference(q[-1:], k_cache[-1:], v_cache[-1:],
                                              cache_seqlens=S_max - 39)
        assert_close("out (last row)", out[-1:], ref, dtype)
        assert_lse_close(lse[-1:], ref_lse)
        assert not torch.isnan(out).any()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_lengths():
    """Captured once (append, key-wise compaction, split kernel, merge), replayed with new
    lengths, queries and tokens copied into the static tensors: no host synchronisation inside."""
    dtype = torch.bfloat16
    B, H, Hk, D, S_max = 4, 16, 4, 128, 2048
    q = torch.randn(B, 1, H, D, device=DEVICE, dtype=dtype)
    k_cache, v_cache = make_cache(B, S_max, Hk, D, dtype)
    k, v = (torch.randn(B, 1, Hk, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([100, 2000, 0, 1500], device=DEVICE, dtype=torch.int32)
    bias = torch.randn(B, Hk, 1, S_max, device=DEVICE, dtype=dtype)
    mask = topk_mask_from_bias(bias, 256)

    def step():
        return flash_dma_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                      attn_mask=mask, attn_bias=bias, num_splits=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lengths in ([7, 1000, 2047, 0], [2047, 3, 512, 1999]):
        lengths.copy_(torch.tensor(new_lengths, device=DEVICE, dtype=torch.int32))
        q.normal_(), k.normal_(), v.normal_()
        mask.copy_(topk_mask_from_bias(torch.randn_like(bias), 256))
        ref_out, _, ref_k, _ = decode_reference(q, k_cache.clone(), v_cache.clone(), k, v,
                                                cache_seqlens=lengths, attn_mask=mask,
                                                attn_bias=bias)
        graph.replay()
        torch.cuda.synchronize()
        assert_close("out", out, ref_out, dtype)
        assert torch.equal(k_cache, ref_k)


def test_bench_plan_lists_the_issue_configurations():
    from flash_dma.benchmarks import decode
    labels = [c.label for _, cases in decode.sections(quick=False) for c in cases]
    assert any("cache 32768" in lab and "top-1024" in lab for lab in labels)
    assert any("pages of 16" in lab for lab in labels) and any("pages of 256" in lab for lab in labels)
    assert decode.DecodeCase("x", 64, 32, 8, 128, 8192).cache_bytes() == 2 * 64 * 8192 * 8 * 128 * 2


def test_split_plan():
    from flash_dma.ops.decode.plan import choose_splits
    # (programs, max_keys, block_n, SMs)
    assert choose_splits(512, 8192, 128, 132) == 1     # B64 Hk8: the programs fill the GPU alone
    assert choose_splits(8, 32768, 64, 132) == 16      # B1 Hk8: 2048 keys per split (the sweep's best)
    assert choose_splits(8, 256, 64, 132) == 1         # too few key tiles to split
    assert choose_splits(1, 1 << 20, 64, 132) == 128   # capped
