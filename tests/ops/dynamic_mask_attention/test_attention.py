"""Dynamic mask attention against the fp64 reference: values, lse and every gradient."""
import pytest
import torch

from conftest import DEVICE, DTYPES, ON_GPU
from helpers import assert_close, assert_lse_close
from flash_dma import flash_dma_func, flash_dma_varlen_func
from flash_dma.ops.dynamic_mask_attention import attention_reference, attention_varlen_reference
from flash_dma.ops.dynamic_mask_attention.reference import heads_to
from flash_dma.runtime import config


def random_mask(shape, density=0.6, coarse=16):
    """Elementwise-random keep-mask, with whole coarse tiles emptied so tile skipping is exercised."""
    fine = torch.rand(shape, device=DEVICE) < density
    b, h, sq, sk = shape
    coarse_keep = torch.rand(b, h, -(-sq // coarse), -(-sk // coarse), device=DEVICE) < 0.6
    coarse_keep = coarse_keep.repeat_interleave(coarse, 2)[:, :, :sq].repeat_interleave(coarse, 3)[..., :sk]
    return fine & coarse_keep


def make_inputs(B, Sq, Sk, H, Hk, D, dtype, mask_shape=None, bias_shape=None, bias_dtype=None):
    q = torch.randn(B, Sq, H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, Sk, Hk, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, Sk, Hk, D, device=DEVICE, dtype=dtype)
    mask = random_mask(mask_shape) if mask_shape is not None else None
    bias = (torch.randn(bias_shape, device=DEVICE, dtype=bias_dtype or dtype)
            if bias_shape is not None else None)
    return q, k, v, mask, bias


def check_against_reference(q, k, v, mask, bias, causal, dtype, grad=True, deterministic=False,
                            varlen=None, scale=None, bias_grad=True):
    """bias_grad=False: the bias is a constant (no dbias asked for), q, k and v still learn."""
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    bias_grad = grad and bias_grad and bias is not None
    bias_leaf = bias.clone().requires_grad_(bias_grad) if bias is not None else None
    if varlen is None:
        out, lse = flash_dma_func(*leaves, attn_mask=mask, attn_bias=bias_leaf, is_causal=causal,
                                  softmax_scale=scale, return_lse=True, deterministic=deterministic)
    else:
        cu_q, cu_k, mq, mk = varlen
        out, lse = flash_dma_varlen_func(*leaves, cu_q, cu_k, mq, mk, attn_mask=mask,
                                         attn_bias=bias_leaf, is_causal=causal, softmax_scale=scale,
                                         return_lse=True, deterministic=deterministic)
    ref_leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref_bias = bias.detach().double().requires_grad_(bias_grad) if bias is not None else None
    # A zero full-shape bias in the reference yields dS itself: the scale against which a bias
    # gradient summed over keys is judged (that sum is exactly 0, softmax being shift-invariant).
    zero_full = None
    if bias is not None:
        n_batch = len(varlen[0]) - 1 if varlen else q.shape[0]
        full_shape = (n_batch, q.shape[-2], varlen[2] if varlen else q.shape[1],
                      varlen[3] if varlen else k.shape[1])
        zero_full = torch.zeros(full_shape, dtype=torch.float64, device=q.device, requires_grad=bias_grad)
    total_bias = None if bias is None else heads_to(ref_bias, q.shape[-2], 1) + zero_full
    if varlen is None:
        ref_out, ref_lse = attention_reference(*ref_leaves, mask, total_bias, causal, scale)
    else:
        ref_out, ref_lse = attention_varlen_reference(*ref_leaves, varlen[0], varlen[1], mask,
                                                      total_bias, causal, scale)
    assert out.dtype == q.dtype
    assert_close("out", out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    if not grad:
        return out, None
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves + ([bias_leaf] if bias_grad else []), dout)
    want = torch.autograd.grad(ref_out, ref_leaves + ([ref_bias, zero_full] if bias_grad else []),
                               dout.double())
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.dtype == (q.dtype if name != "dbias" else bias.dtype)
        key_summed = name == "dbias" and bias.shape[3] == 1
        assert_close(name, g, w, dtype, magnitude=want[4].norm().item() if key_summed else None)
    return out, got


SHAPES = [  # (B, Sq, Sk, H, Hk)
    (2, 37, 45, 4, 2),   # odd lengths, GQA, Sq < Sk
    (1, 50, 19, 2, 2),   # Sq > Sk: with causal, the first rows see no key
    (2, 1, 33, 3, 1),    # a single query (decoding), MQA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_plain_attention(shape, causal, dtype):
    B, Sq, Sk, H, Hk = shape
    q, k, v, _, _ = make_inputs(B, Sq, Sk, H, Hk, 32, dtype)
    check_against_reference(q, k, v, None, None, causal, dtype)


@pytest.mark.parametrize("head_dim", [8, 32, 64, 96, 128, 192, 256])
def test_every_head_dim(head_dim):
    dtype = DTYPES[-1]
    q, k, v, mask, bias = make_inputs(1, 21, 35, 2, 1, head_dim, dtype, mask_shape=(1, 2, 21, 35),
                                      bias_shape=(1, 2, 21, 35))
    check_against_reference(q, k, v, mask, bias, True, dtype)


# (mask shape, bias shape) as functions of (B, H, Hk, Sq, Sk); covers every broadcast kind.
BROADCASTS = {
    "full/full": (lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk), lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk)),
    "batch1/kvheads": (lambda B, H, Hk, Sq, Sk: (1, H, Sq, Sk), lambda B, H, Hk, Sq, Sk: (B, Hk, Sq, Sk)),
    "keywise-gather": (lambda B, H, Hk, Sq, Sk: (B, Hk, 1, Sk), lambda B, H, Hk, Sq, Sk: (B, H, 1, Sk)),
    "keywise-perhead": (lambda B, H, Hk, Sq, Sk: (B, H, 1, Sk), lambda B, H, Hk, Sq, Sk: (1, 1, Sq, Sk)),
    "keywise-shared": (lambda B, H, Hk, Sq, Sk: (1, 1, 1, Sk), lambda B, H, Hk, Sq, Sk: (B, 1, 1, Sk)),
    "querywise": (lambda B, H, Hk, Sq, Sk: (B, 1, Sq, 1), lambda B, H, Hk, Sq, Sk: (1, H, Sq, 1)),
    "scalar-per-head": (lambda B, H, Hk, Sq, Sk: (1, Hk, 1, 1), lambda B, H, Hk, Sq, Sk: (1, H, 1, 1)),
    "bias-only": (None, lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk)),
    "mask-only": (lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk), None),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", list(BROADCASTS))
def test_mask_and_bias_broadcasts(kind, causal):
    dtype = DTYPES[-1]
    B, Sq, Sk, H, Hk = 2, 35, 41, 4, 2
    mask_fn, bias_fn = BROADCASTS[kind]
    dims = (B, H, Hk, Sq, Sk)
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype,
                                      mask_fn(*dims) if mask_fn else None,
                                      bias_fn(*dims) if bias_fn else None)
    check_against_reference(q, k, v, mask, bias, causal, dtype)


def test_fp32_bias_and_custom_scale():
    dtype = DTYPES[-1]
    q, k, v, mask, bias = make_inputs(1, 19, 23, 2, 2, 32, dtype, (1, 2, 19, 23), (1, 2, 19, 23),
                                      bias_dtype=torch.float32)
    check_against_reference(q, k, v, mask, bias, False, dtype, scale=0.3)


def test_fully_masked_rows_give_zero_and_no_nan():
    dtype = DTYPES[-1]
    B, Sq, Sk, H = 1, 33, 40, 2
    q, k, v, _, bias = make_inputs(B, Sq, Sk, H, H, 32, dtype, None, (B, H, Sq, Sk))
    mask = torch.rand(B, H, Sq, Sk, device=DEVICE) < 0.5
    mask[:, :, 3] = False          # one empty row per head
    mask[:, 1, 20:] = False        # a run of empty rows in one head (a whole empty tile)
    out, grads = check_against_reference(q, k, v, mask, bias, False, dtype)
    assert (out[:, 3] == 0).all() and (out[:, 20:, 1] == 0).all()
    dq, dbias = grads[0], grads[3]
    assert (dq[:, 3] == 0).all() and (dbias[:, :, 3] == 0).all()


@pytest.mark.parametrize("bias_shape", [(1, 1, 29, 37), (2, 1, 29, 1), (1, 2, 1, 37)])
def test_deterministic_gradients_are_repeatable(bias_shape):
    """deterministic=True: dq (separate kernel, no atomics) and dbias (ordered partials) repeat
    bit for bit."""
    dtype = DTYPES[-1]
    B, Sq, Sk, H, Hk = 2, 29, 37, 4, 2
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, (B, H, Sq, Sk), bias_shape)
    check_against_reference(q, k, v, mask, bias, True, dtype, deterministic=True)
    dout = torch.randn_like(q)
    grads = []
    for _ in range(2):
        leaves = [q.clone().requires_grad_(), bias.clone().requires_grad_()]
        out = flash_dma_func(leaves[0], k, v, attn_mask=mask, attn_bias=leaves[1], is_causal=True,
                             deterministic=True)
        grads.append(torch.autograd.grad(out, leaves, dout))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def varlen_case(lens_q, lens_k, H, Hk, D, dtype, mask_kind, bias_kind):
    N = len(lens_q)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    mq, mk = max(lens_q), max(lens_k)
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lens_k), Hk, D, device=DEVICE, dtype=dtype)
    v = torch.randn(sum(lens_k), Hk, D, device=DEVICE, dtype=dtype)
    shapes = {"full": (N, H, mq, mk), "keywise": (N, Hk, 1, mk), "shared": (1, 1, mq, mk), None: None}
    mask = random_mask(shapes[mask_kind]) if mask_kind else None
    bias = torch.randn(shapes[bias_kind], device=DEVICE, dtype=dtype) if bias_kind else None
    return q, k, v, mask, bias, (cu_q, cu_k, mq, mk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind,bias_kind", [(None, None), ("full", "full"), ("keywise", "shared")])
def test_varlen(mask_kind, bias_kind, causal):
    dtype = DTYPES[-1]
    # lengths 0 and 1, a sequence longer than one tile, and Sq != Sk per sequence
    q, k, v, mask, bias, meta = varlen_case([5, 0, 1, 37], [7, 3, 1, 29], 4, 2, 32, dtype,
                                            mask_kind, bias_kind)
    check_against_reference(q, k, v, mask, bias, causal, dtype, varlen=meta)


def test_varlen_empty_keys_and_empty_everything():
    dtype = DTYPES[-1]
    q, k, v, mask, bias, meta = varlen_case([3, 0, 4], [0, 0, 5], 2, 2, 32, dtype, None, "full")
    out, _ = check_against_reference(q, k, v, mask, bias, False, dtype, varlen=meta)
    assert (out[:3] == 0).all()  # the first sequence has no keys at all


def test_no_grad_path_and_inference_mode():
    dtype = DTYPES[-1]
    q, k, v, mask, bias = make_inputs(1, 17, 17, 2, 2, 32, dtype, (1, 2, 17, 17), (1, 2, 17, 17))
    with torch.inference_mode():
        out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias)
    ref, _ = attention_reference(q, k, v, mask, bias)
    assert_close("out", out, ref, dtype)


def test_no_gradient_reaching_the_output_gives_none():
    """A later op may hand back no gradient for out (lse never carries one): the backward then
    returns no gradients instead of launching kernels on a missing dout."""
    class DropFirst(torch.autograd.Function):
        @staticmethod
        def forward(ctx, ignored, kept):
            ctx.set_materialize_grads(False)
            return kept.clone()

        @staticmethod
        def backward(ctx, grad):
            return None, grad

    q, k, v = (torch.randn(1, 9, 2, 16, device=DEVICE, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    out = flash_dma_func(q, k, v)
    dq, dk, dv = torch.autograd.grad(DropFirst.apply(out, q).sum(), [q, k, v], allow_unused=True)
    assert torch.equal(dq, torch.ones_like(q)) and dk is None and dv is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_real_sizes(head_dim, causal, dtype):
    B, S, H, Hk = 2, 1000, 4, 2
    q, k, v, mask, bias = make_inputs(B, S, S + 24, H, Hk, head_dim, dtype, (B, Hk, S, S + 24),
                                      (B, H, S, S + 24))
    check_against_reference(q, k, v, mask, bias, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_keywise_topk_long(dtype):
    from flash_dma import topk_mask_from_bias
    B, S, H, Hk, D = 1, 4099, 4, 2, 128
    q, k, v, _, _ = make_inputs(B, S, S, H, Hk, D, dtype)
    bias = torch.randn(B, Hk, 1, S, device=DEVICE, dtype=dtype)
    mask = topk_mask_from_bias(bias, 512)
    check_against_reference(q, k, v, mask, bias, True, dtype)


@pytest.mark.gpu
def test_gpu_one_compilation_serves_every_length():
    from flash_dma.ops.dynamic_mask_attention.triton.forward import attn_fwd_kernel
    dtype = torch.bfloat16
    cache = attn_fwd_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    for S in (128, 300, 301, 517, 1000, 1999):  # lengths, not multiples of anything in particular
        q, k, v, mask, bias = make_inputs(2, S, S, 4, 4, 72, dtype, None, (2, 4, S, S))
        flash_dma_func(q, k, v, attn_bias=bias, is_causal=True)
    # lengths are not specialised; the bias strides may take Triton's "divisible by 16" variant
    # or not (S % 16, S * S % 16), and the bias comes by descriptor only when S % 8 == 0
    assert len(cache) - before <= 4, f"{len(cache) - before} compilations for 6 lengths"


@pytest.mark.gpu
def test_gpu_peak_memory_linear_in_length():
    dtype = torch.bfloat16
    extra = []
    for S in (2048, 4096):
        q, k, v, mask, _ = make_inputs(1, S, S, 8, 8, 128, dtype, None, None)
        mask = torch.rand(1, 8, 1, S, device=DEVICE) < 0.25  # key-wise: O(S) bytes
        leaves = [t.requires_grad_() for t in (q, k, v)]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = flash_dma_func(*leaves, attn_mask=mask, is_causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        # beyond inputs: out, dout, dq, dk, dv are each the size of q
        extra.append(torch.cuda.max_memory_allocated() - base - 5 * q.numel() * q.element_size())
    assert extra[1] <= 2.5 * max(extra[0], 1 << 20), f"extra memory {extra} grows faster than S"


@pytest.mark.parametrize("causal", [False, True])
def test_tile_structured_mask_full_and_partial_tiles(causal):
    """Whole kept tiles (walked without mask loads or checks) beside partial ones."""
    dtype = DTYPES[-1]
    B, Sq, Sk, H, Hk = 1, 45, 53, 4, 2
    q, k, v, _, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, None, (B, H, Sq, Sk))
    mask = random_mask((B, Hk, Sq, Sk), density=1.0)  # coarse 16x16 tiles, all-or-nothing
    mask[0, 0, 7, 40] = False  # and one tile that is only partly kept
    check_against_reference(q, k, v, mask, bias, causal, dtype)


def test_mask_edited_in_place_is_replanned():
    dtype = DTYPES[-1]
    q, k, v, mask, _ = make_inputs(1, 33, 33, 2, 2, 32, dtype, (1, 2, 33, 33), None)
    check_against_reference(q, k, v, mask, None, False, dtype, grad=False)
    mask[:, :, :, :20] = False  # the cached tile lists are stale now
    check_against_reference(q, k, v, mask, None, False, dtype, grad=False)


@pytest.mark.parametrize("causal", [False, True])
def test_key_major_pass_with_mask_and_broadcast_bias(causal):
    """The dk/dv kernel with a mask and a full bias (block lists, dbias tile stores), and with a
    bias broadcast along queries (dbias summed over queries in registers)."""
    dtype = DTYPES[-1]
    B, Sq, Sk, H, Hk = 2, 37, 41, 4, 2
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, (B, Hk, Sq, Sk), (B, H, Sq, Sk))
    check_against_reference(q, k, v, mask, bias, causal, dtype)
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, None, (1, H, 1, Sk))
    check_against_reference(q, k, v, mask, bias, causal, dtype)


@pytest.mark.parametrize("list_walk", [False, True])
def test_both_key_major_walks_without_mask(list_walk):
    """Without a mask the key-major pass walks lists of every tile (or, switched off, its dense
    walk); both exact: odd lengths, Sq > Sk with causal (rows that see no key), GQA, MQA, without a
    bias and with a full-shape one (dq by matmul), and with a broadcast bias (dense walk)."""
    dtype = DTYPES[-1]
    with config.overrides(attention_all_tiles_list_walk=list_walk):
        for (B, Sq, Sk, H, Hk), causal in (((2, 45, 37, 4, 2), True), ((1, 33, 50, 3, 1), False),
                                           ((2, 50, 19, 2, 2), True)):
            q, k, v, _, _ = make_inputs(B, Sq, Sk, H, Hk, 32, dtype)
            check_against_reference(q, k, v, None, None, causal, dtype)
        for bias_shape in ((2, 4, 45, 37), (2, 4, 1, 37)):
            q, k, v, _, bias = make_inputs(2, 45, 37, 4, 2, 32, dtype, None, bias_shape)
            check_against_reference(q, k, v, None, bias, True, dtype)


@pytest.mark.parametrize("strategy", ["fused", "atomic", "kernel"])
def test_every_dq_path(strategy):
    """dq added by the key-major kernel (TMA bulk reductions, or element atomics: the interpreter
    has only the latter) or computed by the separate query-major kernel; GQA, causal with Sq > Sk
    (rows that see no key), a mask with empty tiles, varlen."""
    if strategy == "fused" and DEVICE == "cpu":
        pytest.skip("in the interpreter 'fused' is 'atomic'")
    dtype = DTYPES[-1]
    B, Sq, Sk, H, Hk = 2, 45, 37, 4, 2
    with config.overrides(attention_dq_strategy=strategy):
        q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, (B, Hk, Sq, Sk), (1, H, 1, Sk))
        check_against_reference(q, k, v, mask, bias, True, dtype)
        q, k, v, _, _ = make_inputs(B, Sq, Sk, H, Hk, 24, dtype)
        check_against_reference(q, k, v, None, None, False, dtype)
        q, k, v, mask, bias, meta = varlen_case([5, 0, 1, 37], [7, 3, 1, 29], 4, 2, 32, dtype, "full",
                                                None)
        check_against_reference(q, k, v, mask, bias, True, dtype, varlen=meta)


@pytest.mark.parametrize("layout", ["fused-qkv", "token-sliced"])
def test_strided_kv_layouts(layout):
    """k/v as views: a fused qkv projection (described for the tensor-memory accelerator as is)
    and token slices of longer buffers (not describable: the kernels fall back to pointers)."""
    dtype = DTYPES[-1]
    B, S, H, D = 2, 37, 2, 32
    if layout == "fused-qkv":
        qkv = torch.randn(B, S, 3, H, D, device=DEVICE, dtype=dtype)
        q, k, v = qkv.unbind(2)
    else:
        q = torch.randn(B, S, H, D, device=DEVICE, dtype=dtype)
        k = torch.randn(B, S + 9, H, D, device=DEVICE, dtype=dtype)[:, 4:4 + S]
        v = torch.randn(B, S + 9, H, D, device=DEVICE, dtype=dtype)[:, 2:2 + S]
    bias = torch.randn(B, H, S, S, device=DEVICE, dtype=dtype)
    check_against_reference(q, k, v, None, bias, True, dtype)


# Sk a multiple of 16 and of 8 only; each with and without causal on the GPU, one each in the
# (slow) interpreter
BIAS_DESCRIPTOR_CASES = [(37, 48, True), (29, 40, False)] + ([(37, 48, False), (29, 40, True)] if ON_GPU else [])


@pytest.mark.parametrize("Sq,Sk,causal", BIAS_DESCRIPTOR_CASES)
def test_bias_tiles_by_descriptor(Sq, Sk, causal):
    """Sk a multiple of 8 makes the bias describable for the tensor-memory accelerator: whole
    tiles come by descriptor (in all three kernels), the ragged ones by pointers; a full-shape
    dbias goes out by descriptor stores (clipped at the edges)."""
    dtype = DTYPES[-1]
    B, H, Hk = 2, 4, 2
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, None, (B, H, Sq, Sk))
    check_against_reference(q, k, v, None, bias, causal, dtype)  # dq from dS (dense walk)
    mask = random_mask((B, Hk, Sq, Sk), density=1.0)
    check_against_reference(q, k, v, mask, bias, causal, dtype)  # block lists: dq kernel too
    q, k, v, _, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, None, (1, Hk, Sq, Sk))
    check_against_reference(q, k, v, None, bias, causal, dtype)  # shared bias: atomics
    # a key-wise mask walks gathered keys, not contiguous in the bias: dbias by pointer stores
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, 32, dtype, (B, Hk, 1, Sk), (B, H, Sq, Sk))
    check_against_reference(q, k, v, mask, bias, causal, dtype)


def test_transposed_inputs_and_broadcast_output_gradient():
    """q, k, v as [B, H, S, D] tensors transposed to [B, S, H, D] (strided rows, no copy), and an
    output gradient broadcast from one row (`(out * w).sum()` gives strides 0 but a contiguous
    last dim)."""
    dtype = DTYPES[-1]
    B, S, H, D = 2, 37, 3, 32
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=dtype).transpose(1, 2) for _ in range(3))
    bias = torch.randn(B, H, S, S, device=DEVICE, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]  # clone keeps the strides
    assert not any(t.is_contiguous() for t in leaves)
    bias_leaf = bias.clone().requires_grad_()
    out = flash_dma_func(*leaves, attn_bias=bias_leaf, is_causal=True)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_bias = bias.double().requires_grad_()
    ref_out, _ = attention_reference(*ref_leaves, None, ref_bias, True)
    assert_close("out", out, ref_out, dtype)
    weight = torch.randn(D, device=DEVICE, dtype=dtype)
    dout = weight.expand(B, S, H, D)
    got = torch.autograd.grad(out, leaves + [bias_leaf], dout)
    want = torch.autograd.grad(ref_out, ref_leaves + [ref_bias], dout.double())
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(name, g, w, dtype)


def test_global_deterministic_mode_selects_the_deterministic_backward(monkeypatch):
    """torch.use_deterministic_algorithms(True) asks for the deterministic backward without the
    argument, as it does of torch's own kernels."""
    from flash_dma.ops.dynamic_mask_attention import autograd
    seen = []
    real = autograd.plan_backward

    def spy(*args):
        plan = real(*args)
        seen.append(plan.deterministic)
        return plan
    monkeypatch.setattr(autograd, "plan_backward", spy)
    q, k, v, mask, bias = make_inputs(1, 9, 9, 2, 2, 16, DTYPES[-1], None, (1, 2, 9, 9))
    leaves = [q.requires_grad_(), bias.requires_grad_()]
    previous = torch.are_deterministic_algorithms_enabled()
    for flag in (False, True):
        torch.use_deterministic_algorithms(flag)
        try:
            out = flash_dma_func(leaves[0], k, v, attn_bias=leaves[1])
            torch.autograd.grad(out.float().sum(), leaves)
        finally:
            torch.use_deterministic_algorithms(previous)
    assert seen == [False, True]


def test_attention_with_polynomial_exp2():
    """The forward with half of its exponentials on the FMA pipe matches the reference."""
    from dataclasses import replace

    from flash_dma.ops.dynamic_mask_attention.launch_table import select_config
    dtype = DTYPES[-1]
    cfg = select_config("attn_fwd", torch.device(DEVICE), 32, dtype, "bias").value
    with config.overrides(attn_fwd=replace(cfg, exp2_poly=True)):
        q, k, v, mask, bias = make_inputs(2, 37, 45, 4, 2, 32, dtype, (2, 4, 37, 45), (2, 4, 37, 45))
        mask[:, :, 7] = False  # an empty row: still exactly 0, no NaN
        out, _ = check_against_reference(q, k, v, mask, bias, True, dtype)
    assert (out[:, 7] == 0).all()


def test_plan_carries_every_choice_and_the_profile_log_names_it(monkeypatch, caplog):
    """One plan per call: the strategy choices follow config.overrides, and with
    FLASH_DMA_PROFILE=1 each pass logs its choice once per shape class."""
    import logging

    from flash_dma.ops.dynamic_mask_attention import autograd, sparsity
    from flash_dma.runtime import profile
    plans = []
    real = autograd.plan_backward
    monkeypatch.setattr(autograd, "plan_backward", lambda *a: plans.append(real(*a)) or plans[-1])
    monkeypatch.setenv("FLASH_DMA_PROFILE", "1")
    profile.refresh()
    dtype = DTYPES[-1]
    try:
        with caplog.at_level(logging.INFO, logger="flash_dma"):
            q, k, v, _, bias = make_inputs(2, 33, 33, 4, 2, 32, dtype, None, (1, 2, 1, 33))
            leaves = [t.requires_grad_() for t in (q, k, v, bias)]
            for strategy in ("kernel", "atomic"):
                with config.overrides(attention_dq_strategy=strategy,
                                      attention_all_tiles_list_walk=False):
                    for _ in range(2):  # the second call logs nothing new
                        out = flash_dma_func(*leaves[:3], attn_bias=leaves[3], is_causal=True)
                        torch.autograd.grad(out.float().sum(), leaves)
    finally:
        monkeypatch.delenv("FLASH_DMA_PROFILE")
        profile.refresh()
    assert [p.dq_strategy for p in plans[::2]] == [config.Chosen("kernel", "override"),
                                                   config.Chosen("fused", "override")]
    assert plans[0].dq is not None and plans[2].dq is None
    assert plans[0].dkdv.kv_mode == sparsity.KV_DENSE and plans[0].backend.value == "triton"
    assert plans[0].dbias.reduce == "atomic"  # a bias shared by batches and a group's heads
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_dma"]
    passes = [line.split("pass=")[1].split()[0] for line in lines]
    assert passes == ["fwd", "bwd_dkdv", "bwd_dq", "bwd_dkdv"], lines
    assert "backend=triton" in lines[0] and "D=32 Sq=33 Sk=33 B=2 H=4 Hk=2" in lines[0]
    assert "bias=1,Hk,1,Sk" in lines[0]
    assert "source=interpreter" in lines[0] or DEVICE == "cuda"
    assert "dq=kernel" in lines[1] and "dq=fused" in lines[3]


# ---- the CuTe backend (SM90 with the hopper extra) on the same reference comparison ----------

def _cute_status():
    from flash_dma.ops.dynamic_mask_attention.cute import cute_backend_status
    return cute_backend_status(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"


@pytest.fixture
def on_cute(monkeypatch):
    """Forces the CuTe backend and records which backend ran each pass: [(pass, backend)]."""
    status = _cute_status()
    if status is not None:
        pytest.skip(f"CuTe backend unavailable: {status}")
    from flash_dma.ops.dynamic_mask_attention import autograd
    ran = []

    class Recording:
        def __init__(self, name, module):
            self.name, self.module = name, module

        def forward(self, *args):
            ran.append(("fwd", self.name))
            return self.module.forward(*args)

        def backward(self, *args):
            ran.append(("bwd", self.name))
            return self.module.backward(*args)

    monkeypatch.setattr(autograd, "BACKENDS",
                        {name: Recording(name, module) for name, module in autograd.BACKENDS.items()})
    with config.overrides(attention_backend="cute"):
        yield ran


def _expected_cute_backward(mask, bias, B, H, Sq, Sk, head_dim, deterministic=False):
    from flash_dma.ops.dynamic_mask_attention.cute import masked
    if mask is None and bias is None:
        return "cute"
    gap = masked.backward_gap(seqlen_q=Sq, seqlen_k=Sk, batch=B, num_heads=H, mask=mask, bias=bias,
                              want_dbias=bias is not None, deterministic=deterministic,
                              head_dim=head_dim)
    return "cute" if gap is None else "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(2, 4, 300, 257), (1, 2, 300, 257), (2, 4, 1, 257), (2, 1, 300, 1)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_k", [257, 1030, 100])
def test_gpu_cute_bias_forward_direct_and_hook(on_cute, bias_shape, head_dim, seqlen_k):
    """The CuTe forward's bias read from the score fragment (cute/forward_bias.py: each prefetch
    form; an even key count takes the paired loads) and through FA4's score_mod hook: each
    against the fp64 reference (GQA, causal, the bias's key stride 1, 0 and a broadcast along
    keys, several key tiles; Sk 100 < Sq 300 leaves query tiles that see no key, which FA4 runs
    at key tile -1), and the direct outputs against the hook's."""
    dtype = torch.bfloat16
    shape = bias_shape[:3] + ((seqlen_k,) if bias_shape[3] != 1 else (1,))
    q, k, v, _, bias = make_inputs(2, 300, seqlen_k, 4, 2, head_dim, dtype, None, shape)
    outs = {}
    forms = [dict(attention_cute_direct_bias=False)] + [
        dict(attention_cute_direct_bias=True, attention_cute_bias_prefetch=p) for p in ("L2", "none", "registers")]
    for i, form in enumerate(forms):
        with config.overrides(**form):
            check_against_reference(q, k, v, None, bias, True, dtype, grad=False)
            outs[i] = flash_dma_func(q, k, v, attn_bias=bias, is_causal=True)
    assert [p for p in on_cute if p[0] == "fwd"] == [("fwd", "cute")] * (2 * len(forms))
    for i in range(1, len(forms)):
        diff = (outs[i].double() - outs[0].double()).norm() / outs[0].double().norm()
        assert diff < 2e-3, (forms[i], diff)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_batch", ["each", "kv heads, batch broadcast", "shared", "sliced"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_k", [256, 1032, 104])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cute_bias_forward_tma(on_cute, caplog, heads_batch, head_dim, seqlen_k, causal):
    """The CuTe forward with the bias tile loaded by TMA into shared memory
    (cute/forward_bias_tma.py) against the fp64 reference and the direct form's output: bias per
    query head, per kv head and shared across batches, or one shared by all heads, or a slice of
    a wider tensor (strides not the contiguous ones); key counts of whole tiles, of part of a tile
    and below Sq (query tiles that see no key run key tile -1 under causal); GQA; Sq 300 leaves a
    partial query tile. Runs on the TMA path (no fallback logged)."""
    dtype = torch.bfloat16
    B, Sq, H, Hk = 2, 300, 4, 2
    shape = {"each": (B, H, Sq, seqlen_k), "kv heads, batch broadcast": (1, Hk, Sq, seqlen_k),
             "shared": (B, 1, Sq, seqlen_k), "sliced": (B, H, Sq, seqlen_k)}[heads_batch]
    q, k, v, _, bias = make_inputs(B, Sq, seqlen_k, H, Hk, head_dim, dtype, None, shape)
    if heads_batch == "sliced":
        wide = torch.randn(B, H, Sq, seqlen_k + 16, device=bias.device, dtype=dtype)
        bias = wide[..., 8:8 + seqlen_k]
    with caplog.at_level("WARNING", logger="flash_dma"), \
            config.overrides(attention_cute_bias_prefetch="tma"):
        check_against_reference(q, k, v, None, bias, causal, dtype, grad=False)  # a contiguous copy
        out_tma = flash_dma_func(q, k, v, attn_bias=bias, is_causal=causal)  # the bias as it is
    assert not any("TMA bias" in r.getMessage() for r in caplog.records), caplog.text
    with config.overrides(attention_cute_bias_prefetch="L2"):
        out_direct = flash_dma_func(q, k, v, attn_bias=bias, is_causal=causal)
    assert [p for p in on_cute if p[0] == "fwd"] == [("fwd", "cute")] * 3
    diff = (out_tma.double() - out_direct.double()).norm() / out_direct.double().norm()
    assert diff < 2e-3, diff


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(2, 4, 1, 0), (1, 4, 1, 0), (2, 2, 1, 0), (1, 1, 1, 0)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_k", [257, 1030, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cute_dbias_summed_over_queries(on_cute, bias_shape, head_dim, seqlen_k, causal):
    """A bias broadcast along queries ([B|1, H|Hk|1, 1, Sk], Doge's): the CuTe backward sums its
    dbias per key tile in registers (cute/backward_bias.py) at head dims 64 and 128, stored per
    (batch, head) or added in fp32 atomics where shared; D256 runs the Triton backward. Against
    the fp64 reference; Sq 300 leaves a partial query tile, Sk 100 < Sq query tiles with no key
    under causal; GQA."""
    dtype = torch.bfloat16
    shape = bias_shape[:3] + (seqlen_k,)
    q, k, v, _, bias = make_inputs(2, 300, seqlen_k, 4, 2, head_dim, dtype, None, shape)
    check_against_reference(q, k, v, None, bias, causal, dtype)
    expected = "cute" if head_dim in (64, 128) else "triton"
    assert on_cute == [("fwd", "cute"), ("bwd", expected)]
    assert _expected_cute_backward(None, bias, 2, 4, 300, seqlen_k, head_dim) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(2, 4, 1, 257), (1, 2, 1, 257)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cute_key_bias_as_a_constant(on_cute, bias_shape, head_dim, causal):
    """A bias broadcast along queries that asks for no gradient: the CuTe backward reads it per
    key before each round at head dims 64 and 128 (cute/backward_bias.py), per element at 256;
    dq, dk and dv against the fp64 reference, a partial query tile, GQA."""
    dtype = torch.bfloat16
    q, k, v, _, bias = make_inputs(2, 300, 257, 4, 2, head_dim, dtype, None, bias_shape)
    _, grads = check_against_reference(q, k, v, None, bias, causal, dtype, bias_grad=False)
    assert len(grads) == 3
    assert on_cute == [("fwd", "cute"), ("bwd", "cute")]


@pytest.mark.gpu
def test_gpu_cute_dbias_summed_over_queries_is_deterministic(on_cute):
    """One writer per (batch, head, key): the same dbias bit for bit on every run."""
    dtype = torch.bfloat16
    q, k, v, _, bias = make_inputs(2, 300, 1030, 4, 2, 128, dtype, None, (2, 4, 1, 1030))
    grads = []
    for _ in range(2):
        leaf = bias.clone().requires_grad_()
        out = flash_dma_func(q, k, v, attn_bias=leaf, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, leaf, torch.ones_like(out))[0])
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert on_cute.count(("bwd", "cute")) == 2


TMA_BACKWARD_PARTS = {"bias": dict(attention_cute_dbias_tma=False),
                      "dbias": dict(attention_cute_bias_tma_backward=False),
                      "both": {}}
DIRECT_BACKWARD = dict(attention_cute_dbias_tma=False, attention_cute_bias_tma_backward=False)


def _cute_bias_grads(q, k, v, bias, causal, overrides):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    with config.overrides(**overrides):
        out = flash_dma_func(*leaves[:3], attn_bias=leaves[3], is_causal=causal)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))


@pytest.mark.gpu
@pytest.mark.parametrize("parts", list(TMA_BACKWARD_PARTS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_k", [256, 1032, 104])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cute_backward_bias_by_tma(on_cute, caplog, parts, head_dim, seqlen_k, causal):
    """The backward's bias loaded and/or dbias stored by TMA through FA4's shared dS tile
    (cute/backward_bias_tma.py): dq, dk, dv and dbias against the fp64 reference, and equal to
    the per-element path's (the same values reach the same fp32 expressions; dq sums across
    blocks in no fixed order); Sq 300 leaves a partial query tile, Sk 104 < Sq query tiles with
    no key under causal; GQA; no fallback logged."""
    dtype = torch.bfloat16
    B, Sq, H, Hk = 2, 300, 4, 2
    q, k, v, _, bias = make_inputs(B, Sq, seqlen_k, H, Hk, head_dim, dtype, None, (B, H, Sq, seqlen_k))
    with caplog.at_level("WARNING", logger="flash_dma"):
        with config.overrides(**TMA_BACKWARD_PARTS[parts]):
            check_against_reference(q, k, v, None, bias, causal, dtype)
        dq, dk, dv, dbias = _cute_bias_grads(q, k, v, bias, causal, TMA_BACKWARD_PARTS[parts])
    assert "TMA" not in caplog.text, caplog.text
    assert on_cute.count(("bwd", "cute")) == 2
    dq_ref, dk_ref, dv_ref, dbias_ref = _cute_bias_grads(q, k, v, bias, causal, DIRECT_BACKWARD)
    assert torch.equal(dbias, dbias_ref) and torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref)
    assert (dq.double() - dq_ref.double()).norm() <= 1e-2 * dq_ref.double().norm()


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(1, 4, 300, 264), (2, 2, 300, 264), (1, 1, 300, 264)])
def test_gpu_cute_backward_broadcast_bias_by_tma(on_cute, caplog, bias_shape):
    """A bias shared across batches or heads: the backward loads it by TMA (batch and head
    broadcast resolved per tile) while its dbias sums in fp32 atomics; against the reference."""
    dtype = torch.bfloat16
    q, k, v, _, bias = make_inputs(2, 300, 264, 4, 2, 128, dtype, None, bias_shape)
    with caplog.at_level("WARNING", logger="flash_dma"):
        check_against_reference(q, k, v, None, bias, False, dtype)
    assert "TMA" not in caplog.text, caplog.text
    assert on_cute.count(("bwd", "cute")) == 1


@pytest.mark.gpu
def test_gpu_cute_backward_bias_tma_falls_back_for_another_dtype(on_cute, caplog, monkeypatch):
    """An fp32 bias with bf16 q cannot go through FA4's bf16 dS tile: the per-element path runs,
    logged, and the gradients are right."""
    from flash_dma.runtime import profile
    monkeypatch.setattr(profile, "_FALLBACKS_SEEN", set())
    dtype = torch.bfloat16
    q, k, v, _, bias = make_inputs(2, 300, 264, 4, 2, 128, dtype, None, (2, 4, 300, 264),
                                   bias_dtype=torch.float32)
    with caplog.at_level("WARNING", logger="flash_dma"):
        check_against_reference(q, k, v, None, bias, False, dtype)
    assert "FA4's dS tile is torch.bfloat16, the bias is torch.float32" in caplog.text


@pytest.mark.gpu
def test_gpu_cute_bias_forward_tma_falls_back_where_tma_cannot_load(on_cute, caplog, monkeypatch):
    """A key count whose rows are not 16-byte aligned (Sk 257): the direct forward runs instead,
    logged, and the output is right."""
    from flash_dma.runtime import profile
    monkeypatch.setattr(profile, "_FALLBACKS_SEEN", set())
    dtype = torch.bfloat16
    q, k, v, _, bias = make_inputs(2, 300, 257, 4, 2, 128, dtype, None, (2, 4, 300, 257))
    with caplog.at_level("WARNING", logger="flash_dma"), \
            config.overrides(attention_cute_bias_prefetch="tma"):
        check_against_reference(q, k, v, None, bias, False, dtype, grad=False)
    assert "16-byte aligned" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(2, 4, 300, 257), (1, 4, 300, 257), (2, 2, 300, 257), (1, 1, 300, 257)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gpu_cute_bias_backward_direct(on_cute, bias_shape, head_dim, with_mask):
    """The CuTe backward with the bias re-added and dbias written at the score fragments'
    coordinates (cute/backward_bias.py): dq, dk, dv and dbias (stored where each entry has one
    writer, fp32 atomics where batches or heads share it) against the fp64 reference; odd key
    length, GQA, causal, with and without a mask."""
    dtype = torch.bfloat16
    B, Sq, Sk, H, Hk = 2, 300, 257, 4, 2
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, head_dim, dtype,
                                      (B, 1, Sq, Sk) if with_mask else None, bias_shape)
    with config.overrides(attention_cute_direct_bias_backward=True):
        check_against_reference(q, k, v, mask, bias, True, dtype)
    assert on_cute == [("fwd", "cute"), ("bwd", "cute")]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", list(BROADCASTS))
def test_gpu_cute_mask_and_bias_broadcasts(on_cute, kind, causal, head_dim):
    """Every broadcast kind of mask and bias (dbias in each bias shape) on the CuTe backend;
    lengths past one tile and ragged, GQA; the forward runs on CuTe, the backward on CuTe unless
    cute/masked.backward_gap names what it lacks (then Triton)."""
    dtype = torch.bfloat16
    B, Sq, Sk, H, Hk = 2, 300, 257, 4, 2
    mask_fn, bias_fn = BROADCASTS[kind]
    dims = (B, H, Hk, Sq, Sk)
    q, k, v, mask, bias = make_inputs(B, Sq, Sk, H, Hk, head_dim, dtype,
                                      mask_fn(*dims) if mask_fn else None,
                                      bias_fn(*dims) if bias_fn else None)
    check_against_reference(q, k, v, mask, bias, causal, dtype)
    from flash_dma.ops.dynamic_mask_attention import sparsity
    if mask is not None and sparsity.choose_mode(mask, H, Hk) == sparsity.KV_GATHERED:
        assert on_cute == [("fwd", "triton"), ("bwd", "triton")]  # gathered keys stay on Triton
    else:
        assert on_cute == [("fwd", "cute"), ("bwd", _expected_cute_backward(mask, bias, B, H, Sq, Sk,
                                                                            head_dim))]


@pytest.mark.gpu
@pytest.mark.parametrize("bias_shape", [(2, 4, 130, 200), (1, 4, 130, 200), (2, 1, 130, 200),
                                        (2, 2, 130, 200), (1, 1, 130, 200), (1, 2, 130, 200)])
@pytest.mark.parametrize("bias_dtype", [torch.float16, torch.float32])
def test_gpu_cute_dbias_every_head_and_batch_broadcast(on_cute, bias_shape, bias_dtype):
    """dbias stored (one writer per entry) or summed by fp32 atomics (shared by batch or heads,
    per kv head under GQA), in the bias's dtype, fp16 inputs."""
    dtype = torch.float16
    q, k, v, mask, bias = make_inputs(2, 130, 200, 4, 2, 128, dtype, (2, 1, 130, 200), bias_shape,
                                      bias_dtype=bias_dtype)
    check_against_reference(q, k, v, mask, bias, True, dtype)
    assert on_cute == [("fwd", "cute"), ("bwd", _expected_cute_backward(mask, bias, 2, 4, 130, 200, 128))]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_cute_fully_masked_rows_and_empty_tiles(on_cute, head_dim):
    """Empty rows give out 0, lse +inf, zero dq and dbias; whole empty query blocks and key
    blocks (no listed tile) give zeros in every gradient."""
    dtype = torch.bfloat16
    B, Sq, Sk, H = 1, 400, 390, 2
    q, k, v, _, _ = make_inputs(B, Sq, Sk, H, H, head_dim, dtype, None, None)
    bias = None
    mask = torch.rand(B, H, Sq, Sk, device=DEVICE) < 0.5
    mask[:, :, 3] = False            # one empty row per head
    mask[:, 1, 128:256] = False      # a whole empty query block in one head
    mask[:, 0, :, 128:300] = False   # empty key blocks in the other
    out, grads = check_against_reference(q, k, v, mask, bias, False, dtype)
    dq, dk, dv = grads[:3]
    assert (out[:, 3] == 0).all() and (out[:, 128:256, 1] == 0).all()
    assert (dq[:, 3] == 0).all() and (dq[:, 128:256, 1] == 0).all()
    assert (dk[:, 128:300, 0] == 0).all() and (dv[:, 128:300, 0] == 0).all()
    assert on_cute == [("fwd", "cute"), ("bwd", "cute")]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cute_tile_sparse_mask_long(on_cute, causal):
    """1/8 of the tiles kept, 128x128 tiles, S 2000: the lists skip the rest in both passes."""
    dtype = torch.bfloat16
    B, S, H, Hk, D = 1, 2000, 4, 2, 128
    q, k, v, _, bias = make_inputs(B, S, S, H, Hk, D, dtype, None, None)
    n = -(-S // 128)
    tiles = torch.rand(B, H, n, n, device=DEVICE) < 0.125
    tiles |= torch.eye(n, dtype=torch.bool, device=DEVICE)  # every row sees its diagonal tile
    mask = tiles.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :S, :S]
    check_against_reference(q, k, v, mask, bias, causal, dtype)
    assert on_cute == [("fwd", "cute"), ("bwd", "cute")]


@pytest.mark.gpu
def test_gpu_cute_deterministic(on_cute):
    """deterministic=True with a mask: the forward on CuTe, the backward on Triton (FA4's
    ordered mask backward needs write-order metadata not built here); a bias runs on Triton."""
    dtype = torch.bfloat16
    B, Sq, Sk, H, Hk = 2, 200, 300, 4, 2
    q, k, v, mask, _ = make_inputs(B, Sq, Sk, H, Hk, 128, dtype, (B, H, Sq, Sk), None)
    check_against_reference(q, k, v, mask, None, True, dtype, deterministic=True)
    assert on_cute == [("fwd", "cute"), ("bwd", "triton")]


@pytest.mark.gpu
def test_gpu_cute_new_length_compiles_nothing(on_cute):
    """One compilation per feature set: after a first call, new lengths (each above one tile)
    find every FA4 kernel in its cache."""
    from flash_dma.ops.dynamic_mask_attention.cute import plain
    fa4 = plain._fa4()
    caches = (fa4._flash_attn_fwd.compile_cache.cache, fa4._flash_attn_bwd.compile_cache.cache)
    dtype = torch.bfloat16

    def run(S):
        q, k, v, mask, _ = make_inputs(2, S, S + 7, 4, 2, 128, dtype, (2, 1, S, S + 7), None)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flash_dma_func(*leaves, attn_mask=mask, is_causal=True)
        out.backward(torch.randn_like(out))
    run(300)
    before = [len(c) for c in caches]
    for S in (517, 1000, 1999):
        run(S)
    assert [len(c) for c in caches] == before
