"""The public ops inside torch.compile'd code: each op traces as a torch.library custom op (one
graph node, ops/<op>/custom_op.py), so the whole function compiles with fullgraph=True, and the
compiled function returns what the eager one returns, gradients included.

aot_eager (AOTAutograd, no code generation) runs everywhere, the interpreter included; on the GPU
the default backend (Inductor) runs too."""
import pytest
import torch

from conftest import DEVICE, ON_GPU
from helpers import rel_err
from flash_dma import (chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu, flash_dma_func,
                       flash_dma_varlen_func, topk_mask_from_bias)

DTYPE = torch.bfloat16 if ON_GPU else torch.float16
BACKENDS = ["aot_eager", "inductor"] if ON_GPU else ["aot_eager"]


def _leaves(*shapes, dtype=DTYPE):
    return [torch.randn(*s, device=DEVICE, dtype=dtype, requires_grad=True) for s in shapes]


def _compare(fn, leaves, backend):
    """fn(*leaves) -> scalar loss, eager vs compiled: losses and gradients. Tensor ops around the
    op are traced and compiled; Inductor may fuse them differently, hence a tolerance there."""
    torch._dynamo.reset()
    ref = fn(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    out = compiled(*leaves)
    grads = torch.autograd.grad(out, leaves)
    exact = backend == "aot_eager"
    for name, x, r in [("loss", out, ref)] + [(f"grad {i}", g, r_) for i, (g, r_)
                                               in enumerate(zip(grads, ref_grads))]:
        assert not torch.isnan(x).any(), f"{name}: NaN"
        if exact:
            assert torch.equal(x, r), f"{name}: differs from the eager call"
        else:
            err = rel_err(x, r)
            assert err < 1e-2, f"{name}: relative difference {err:.2e} from the eager call"


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_in_compiled_code(backend):
    # what is checked is the tracing and the custom op's registration, not the numerics: a small
    # shape (odd length, GQA) keeps the interpreter's two runs (eager and compiled) short
    B, S, H, Hk, D = 1, 21, 2, 1, 16
    q, k, v = _leaves((B, S, H, D), (B, S, Hk, D), (B, S, Hk, D))
    bias, = _leaves((B, H, S, S))
    mask = torch.rand(B, 1, S, S, device=DEVICE) < 0.7

    def loss(q, k, v, bias):
        out = flash_dma_func(torch.tanh(q), k * 2, v, attn_mask=mask, attn_bias=bias - 1,
                             is_causal=True, deterministic=True)
        return (out.float() ** 2).sum()
    _compare(loss, [q, k, v, bias], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_attention_in_compiled_code(backend):
    lengths = [5, 0, 19]
    cu = torch.tensor([0, 5, 5, 24], device=DEVICE, dtype=torch.int32)
    H, D = 2, 16
    q, k, v = _leaves((sum(lengths), H, D), (sum(lengths), H, D), (sum(lengths), H, D))

    def loss(q, k, v):
        out = flash_dma_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), deterministic=True)
        return (out.float().sin()).sum()
    _compare(loss, [q, k, v], backend)


@pytest.mark.parametrize("gate", ["g", "gk"])
@pytest.mark.parametrize("disable_recompute", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_delta_rule_in_compiled_code(backend, disable_recompute, gate):
    """With disable_recompute the forward op also returns the kept states (autograd.kept_states_form)."""
    B, T, H, K, V = 1, 21, 1, 16, 16
    q, k, v = _leaves((B, T, H, K), (B, T, H, K), (B, T, H, V))
    gate_shape = (B, T, H) if gate == "g" else (B, T, H, K)
    g_raw, beta_raw = _leaves(gate_shape, (B, T, H), dtype=torch.float32)

    def loss(q, k, v, g_raw, beta_raw):
        decay = torch.nn.functional.logsigmoid(g_raw)
        o, final = chunk_gated_delta_rule(q, k, v, decay if gate == "g" else None,
                                          torch.sigmoid(beta_raw), gk=decay if gate == "gk" else None,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          disable_recompute=disable_recompute)
        return (o.float() ** 2).sum() + final.sum()
    _compare(loss, [q, k, v, g_raw, beta_raw], backend)


def test_bwd_dhu_in_compiled_code():
    B, T, H, K, V = 1, 70, 1, 16, 16
    q, k, w, do, dv = (torch.randn(B, T, H, d, device=DEVICE, dtype=DTYPE) for d in (K, K, K, V, V))
    torch._dynamo.reset()

    def run(q):
        dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(q * 0.5, k, w, do, dv)
        return dh.float().sum(), dv2
    ref_sum, ref_dv2 = run(q)
    got_sum, got_dv2 = torch.compile(run, backend="aot_eager", fullgraph=True)(q)
    assert torch.equal(got_sum, ref_sum) and torch.equal(got_dv2, ref_dv2)


def test_topk_mask_compiles_whole():
    bias = torch.randn(2, 3, 1, 50, device=DEVICE)
    pad = torch.rand(2, 50, device=DEVICE) < 0.9
    torch._dynamo.reset()
    for kw in ({"is_causal": True}, {"key_padding_mask": pad, "block_size": 8}):
        ref = topk_mask_from_bias(bias, 7, **kw)
        got = torch.compile(lambda b: topk_mask_from_bias(b, 7, **kw), backend="aot_eager",
                            fullgraph=True)(bias)
        assert torch.equal(got, ref)
