"""Gradients taken with create_graph=True: first-order values unchanged, and a second derivative
through them raises (the kernels' gradients carry no graph, so it would otherwise be silently
wrong: they would act as constants)."""
import pytest
import torch

from conftest import DEVICE
from flash_dma import chunk_gated_delta_rule, flash_dma_func

DTYPE = torch.float16


def _attention(q, k, v, bias):
    return flash_dma_func(q, k, v, attn_bias=bias, is_causal=True, deterministic=True).float().sum()


def _delta_rule(q, k, v, g, beta):
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    return o.float().sum() + final.sum()


def _inputs(op):
    if op is _attention:
        shapes = [(1, 20, 2, 16)] * 3 + [(1, 2, 20, 20)]
        return [torch.randn(*s, device=DEVICE, dtype=DTYPE, requires_grad=True) for s in shapes]
    q, k = (torch.nn.functional.normalize(torch.randn(1, 30, 2, 16, device=DEVICE), dim=-1)
            .to(DTYPE).requires_grad_() for _ in range(2))
    v = torch.randn(1, 30, 2, 32, device=DEVICE, dtype=DTYPE, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 30, 2, device=DEVICE)).requires_grad_()
    beta = torch.rand(1, 30, 2, device=DEVICE, requires_grad=True)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("op", [_attention, _delta_rule], ids=["attention", "delta-rule"])
def test_create_graph_gives_first_order_and_refuses_second(op):
    leaves = _inputs(op)
    plain = torch.autograd.grad(op(*leaves), leaves)
    graphed = torch.autograd.grad(op(*leaves), leaves, create_graph=True)
    for a, b in zip(graphed, plain):
        assert torch.equal(a, b)
    assert all(g.requires_grad for g in graphed)
    penalty = sum(g.float().square().sum() for g in graphed)
    with pytest.raises(RuntimeError, match="second derivatives"):
        penalty.backward()


@pytest.mark.parametrize("others_need_grad", [False, True], ids=["gk-alone", "all-inputs"])
def test_create_graph_where_the_forward_keeps_the_key_gate_cumsums(others_need_grad):
    """With the per-key gate at head dims a multiple of 64 the forward keeps gk's cumsums in place
    of gk (autograd.kept_gate): where gk alone requires grad it is still there to anchor the
    refusal of a second derivative."""
    torch.manual_seed(0)
    B, T, H, D = 1, 70, 2, 64
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, device=DEVICE), dim=-1).to(DTYPE)
            .requires_grad_(others_need_grad) for _ in range(2))
    v = torch.randn(B, T, H, D, device=DEVICE, dtype=DTYPE, requires_grad=others_need_grad)
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device=DEVICE) + 3).requires_grad_()
    beta = torch.rand(B, T, H, device=DEVICE, requires_grad=others_need_grad)
    leaves = [t for t in (q, k, v, gk, beta) if t.requires_grad]

    def op():
        return chunk_gated_delta_rule(q, k, v, None, beta, gk=gk)[0].float().sum()
    plain = torch.autograd.grad(op(), leaves)
    graphed = torch.autograd.grad(op(), leaves, create_graph=True)
    for a, b in zip(graphed, plain):
        assert torch.equal(a, b)
    assert all(g.requires_grad for g in graphed)
    with pytest.raises(RuntimeError, match="second derivatives"):
        sum(g.float().square().sum() for g in graphed).backward()
