"""Dynamic mask attention under torch.compile(fullgraph=True, dynamic=True): the public functions
trace as the custom ops flash_dma::attention_fwd/bwd (custom_op.py) and give the eager results,
gradients included; eagerly the autograd Function runs. opcheck tests the ops' registrations
(schema, fake implementations against the real ones, autograd, AOT dispatch with dynamic shapes).

aot_eager (AOTAutograd, no code generation) runs the real kernels, so compiled and eager results
are bitwise equal (deterministic=True fixes the reduction order of the backward)."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import assert_compiled_matches_eager, assert_same
from conftest import DEVICE, ON_GPU
from flash_dma import flash_dma_func, flash_dma_varlen_func
from flash_dma.ops.dynamic_mask_attention.custom_op import attention_fwd

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
D = 16


def _leaf(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=True)


def test_fixed_length_fullgraph_dynamic():
    """Mask, bias (per kv head, a gradient through dbias), causal, GQA; then a second length runs
    through the same graph (dynamic shapes: no recompilation)."""
    B, H, Hk = 1, 2, 1

    def loss(q, k, v, bias, mask):
        out, lse = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True,
                                  return_lse=True, deterministic=True)
        return (out.float() ** 2).sum() + lse.masked_fill(lse.isinf(), 0).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for S in (9, 14):
        q, k, v = _leaf(B, S, H, D), _leaf(B, S + 3, Hk, D), _leaf(B, S + 3, Hk, D)
        bias = _leaf(B, Hk, S, S + 3)
        mask = torch.rand(B, 1, S, S + 3, device=DEVICE) < 0.7
        mask[:, :, :, 0] = True
        leaves = [q, k, v, bias]
        assert_compiled_matches_eager(lambda *t: compiled(*t, mask), lambda *t: loss(*t, mask), leaves)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for two lengths"


def test_varlen_fullgraph_dynamic():
    """Packed sequences (one empty) with a per-sequence padded mask and bias, causal."""
    H, Hk = 2, 1

    def loss(q, k, v, bias, mask, cu, max_len):
        out = flash_dma_varlen_func(q, k, v, cu, cu, max_len, max_len, attn_mask=mask, attn_bias=bias,
                                    is_causal=True, deterministic=True)
        return out.float().sin().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([5, 0, 9], [3, 12]):
        total, longest = sum(lengths), max(lengths)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEVICE, dtype=torch.int32)
        q, k, v = _leaf(total, H, D), _leaf(total, Hk, D), _leaf(total, Hk, D)
        bias = _leaf(len(lengths), H, longest, longest)
        mask = torch.rand(len(lengths), 1, longest, longest, device=DEVICE) < 0.8
        assert_compiled_matches_eager(lambda *t: compiled(*t, mask, cu, longest), lambda *t: loss(*t, mask, cu, longest),
               [q, k, v, bias])
    assert counter.frame_count <= 2  # (the number of sequences may specialise once)


def test_custom_op_traced_only_under_compile():
    """Eagerly the autograd Function runs (its plan is kept for the backward); the graph that
    torch.compile captures holds the custom op."""
    q, k, v = _leaf(1, 8, 2, D), _leaf(1, 8, 2, D), _leaf(1, 8, 2, D)
    assert type(flash_dma_func(q, k, v).grad_fn).__name__ == "DynamicMaskAttentionFunctionBackward"
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda q, k, v: flash_dma_func(q, k, v, is_causal=True), backend=recording_backend,
                  fullgraph=True)(q, k, v)
    assert "flash_dma.attention_fwd.default" in targets, targets


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck(varlen):
    if varlen:
        cu = torch.tensor([0, 3, 10], device=DEVICE, dtype=torch.int32)
        q, k, v = _leaf(10, 2, D), _leaf(10, 1, D), _leaf(10, 1, D)
        bias, mask = _leaf(2, 2, 7, 7), torch.rand(2, 1, 7, 7, device=DEVICE) < 0.8
        args = (q, k, v, mask, bias, cu, cu, 7, 7, True, None, True, True)
    else:
        q, k, v = _leaf(2, 9, 2, D), _leaf(2, 11, 1, D), _leaf(2, 11, 1, D)
        bias, mask = _leaf(1, 2, 9, 11), torch.rand(2, 1, 9, 11, device=DEVICE) < 0.8
        mask[..., 0] = True
        args = (q, k, v, mask, bias, None, None, 0, 0, False, 0.3, False, True)
    # (the full set once; the AOT dispatch test, the slowest in the interpreter, not twice)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") if varlen else \
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(attention_fwd, args, test_utils=utils)
