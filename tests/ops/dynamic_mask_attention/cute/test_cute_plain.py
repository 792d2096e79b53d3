"""The CuTe plain-attention path (FA4's SM90 kernels through cute/plain.py) against the fp64
reference: outputs, lse (+inf for rows that see no key) and gradients, with poisoned outputs
(conftest), odd lengths, every validated head dim, GQA, bottom-right causal with Sq != Sk, varlen
with sequences of length 0 and 1, deterministic backward, strided inputs, and one compilation per
feature set. GPU only (SM90 with the hopper extra); skipped elsewhere with the reason."""
import math

import pytest
import torch

from conftest import ON_GPU
from helpers import assert_close
from flash_dma.ops.dynamic_mask_attention import attention_reference, attention_varlen_reference
from flash_dma.ops.dynamic_mask_attention.cute import cute_backend_status, plain

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def needs_cute():
    status = cute_backend_status(torch.device("cuda")) if ON_GPU else "no CUDA GPU"
    if status is not None:
        pytest.skip(f"CuTe backend unavailable: {status}")


def assert_lse_matches(lse, ref):
    """+inf exactly where the reference has +inf (rows with no visible key), finite rows close."""
    assert lse.shape == ref.shape, f"lse: shape {tuple(lse.shape)} != reference {tuple(ref.shape)}"
    assert lse.dtype == torch.float32
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert torch.equal(lse == math.inf, ref == math.inf), "lse: +inf rows differ from the reference"
    assert not (lse == -math.inf).any(), "lse: -inf (FA4's convention) leaked out"
    finite = torch.isfinite(ref)
    if finite.any():
        assert (lse[finite].double() - ref[finite]).abs().max().item() < 1e-2


def reference_with_grads(q, k, v, dout, causal, scale, varlen=None):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if varlen is None:
        out, lse = attention_reference(q64, k64, v64, is_causal=causal, softmax_scale=scale)
    else:
        out, lse = attention_varlen_reference(q64, k64, v64, *varlen, is_causal=causal,
                                              softmax_scale=scale)
    out.backward(dout.double())
    return out.detach(), lse, q64.grad, k64.grad, v64.grad


def check_against_reference(q, k, v, causal, dtype, varlen_args=None, deterministic=False):
    """Run forward and backward through the wrapper, compare everything with the reference."""
    scale = q.shape[-1] ** -0.5
    offsets = {}
    if varlen_args is not None:
        cu_q, cu_k = varlen_args
        offsets = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()),
                       max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()))
    out, lse = plain.forward(q, k, v, causal=causal, softmax_scale=scale, **offsets)
    dout = torch.randn_like(out)
    dq, dk, dv = plain.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                deterministic=deterministic, **offsets)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, causal, scale,
                                                                   varlen_args)
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    assert_close("out", out, ref_out, dtype)
    assert_lse_matches(lse, ref_lse)
    assert_close("dq", dq, ref_dq, dtype)
    assert_close("dk", dk, ref_dk, dtype)
    assert_close("dv", dv, ref_dv, dtype)
    empty = ref_lse == math.inf  # rows with no visible key: out and dq exactly 0
    if empty.any():
        rows = empty.transpose(-1, -2) if varlen_args is None else empty.transpose(0, 1)
        assert (out[rows] == 0).all() and (dq[rows] == 0).all()
    return dq, dk, dv


# (dtype, head dim, causal, query heads per kv head): every validated head dim in bf16, fp16 at 128
FEATURES = ([(torch.bfloat16, d, c, g) for d in plain.PLAIN_HEAD_DIMS for c in (False, True)
             for g in (1, 4)]
            + [(torch.float16, 128, c, g) for c in (False, True) for g in (1, 4)])


# odd lengths on both sides, and more queries than keys (causal: the first rows see no key);
# one-tile lengths (FA4 compiles other variants for them) at the smallest and largest head dim
CASES = [(f, lengths) for f in FEATURES
         for lengths in [(197, 333), (333, 197)] + ([(1, 1), (128, 128)] if f[1] in (64, 256) else [])]


def _case_id(case):
    (dtype, d, causal, group), (seqlen_q, seqlen_k) = case
    return f"{str(dtype)[6:]}-D{d}-{'causal' if causal else 'full'}-g{group}-Sq{seqlen_q}-Sk{seqlen_k}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fixed_length(case):
    (dtype, head_dim, causal, group), (seqlen_q, seqlen_k) = case
    kv_heads = 2
    q = torch.randn(2, seqlen_q, kv_heads * group, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(2, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    check_against_reference(q, k, v, causal, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_varlen_with_empty_and_single_token_sequences(head_dim, causal, group):
    dtype = torch.bfloat16
    # sequence 0: no queries; 1: one query, no keys; 2: one and one; 3: odd lengths;
    # 4: more queries than keys (causal: its first rows see nothing); 5: a long one
    lens_q = [0, 1, 1, 37, 9, 300]
    lens_k = [4, 0, 1, 51, 2, 333]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    kv_heads = 2
    q = torch.randn(sum(lens_q), kv_heads * group, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), kv_heads, head_dim, device="cuda", dtype=dtype)
    check_against_reference(q, k, v, causal, dtype, varlen_args=(cu_q, cu_k))


def test_varlen_takes_int64_offsets():
    lens = [5, 130, 1]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)  # int64
    q = torch.randn(sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    check_against_reference(q, k, v, True, torch.bfloat16, varlen_args=(cu, cu))


@pytest.mark.parametrize("group", [1, 4])
def test_deterministic_backward_is_bitwise_repeatable(group):
    dtype = torch.bfloat16
    q = torch.randn(2, 1000, 2 * group, 128, device="cuda", dtype=dtype)
    k = torch.randn(2, 1100, 2, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    scale = 128 ** -0.5
    out, lse = plain.forward(q, k, v, causal=True, softmax_scale=scale)
    dout = torch.randn_like(out)
    first = plain.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale,
                           deterministic=True)
    for _ in range(3):
        again = plain.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale,
                               deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
    check_against_reference(q[:, :300], k[:, :333], v[:, :333], True, dtype, deterministic=True)


def test_strided_inputs():
    """q/k/v as views into one packed qkv tensor (TMA-describable: used in place), and a view
    whose last dim is not unit-stride (copied)."""
    dtype = torch.bfloat16
    qkv = torch.randn(2, 257, 3, 4, 128, device="cuda", dtype=dtype)
    q, k, v = qkv.unbind(2)
    assert plain._tma_ready(q) is q
    check_against_reference(q, k, v, True, dtype)
    k_t = torch.randn(2, 257, 4, 128, device="cuda", dtype=dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert k_t.stride(-1) != 1
    check_against_reference(q, k_t, v, False, dtype)


def test_a_new_length_compiles_nothing():
    fa4 = plain._fa4()
    caches = (fa4._flash_attn_fwd.compile_cache, fa4._flash_attn_bwd.compile_cache,
              fa4._bwd_preprocess.compile_cache, fa4._bwd_postprocess_convert.compile_cache)

    def run(seqlen_q, seqlen_k):
        q = torch.randn(2, seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, seqlen_k, 2, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = plain.forward(q, k, k, causal=True, softmax_scale=0.1)
        plain.backward(torch.randn_like(out), q, k, k, out, lse, causal=True, softmax_scale=0.1)

    run(300, 257)
    compiled = [set(c.cache) for c in caches]
    for lengths in ((1000, 777), (4100, 4100), (555, 2049)):
        run(*lengths)
    assert [set(c.cache) for c in caches] == compiled, "a new length compiled a new kernel"


def test_cuda_graph_capture():
    """Forward and backward captured in one CUDA graph (compiled beforehand), replayed on new
    inputs copied in place: the results match the reference of the new inputs."""
    dtype, scale = torch.bfloat16, 128 ** -0.5
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=dtype)
    k = torch.randn(2, 257, 2, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)

    def step():
        out, lse = plain.forward(q, k, v, causal=True, softmax_scale=scale)
        return (out, lse, *plain.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, dq, dk, dv = step()
    for t in (q, k, v, dout):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, True, scale)
    assert_close("out", out, ref_out, dtype)
    assert_lse_matches(lse, ref_lse)
    for name, g, r in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert_close(name, g, r, dtype)
