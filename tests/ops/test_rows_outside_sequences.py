"""Packed buffers longer than their sequences (cu_seqlens[-1] < total rows, as a fixed-size
packing buffer gives): the rows that belong to no sequence come back as 0 in the outputs and in
every gradient, never as whatever their memory held (which would flow into the caller's
gradients)."""
import torch

from flash_dma import chunk_gated_delta_rule, flash_dma_varlen_func

from conftest import DEVICE

# (conftest.py poisons every torch.empty with NaN: an unwritten row cannot pass for 0)


def test_attention_rows_past_the_last_offset_are_zero():
    torch.manual_seed(0)
    total, used = 40, 29
    q, k, v = (torch.randn(total, 2, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, 13, used], device=DEVICE, dtype=torch.int32)
    out, lse = flash_dma_varlen_func(q, k, v, cu, cu, 16, 16, is_causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name}: NaN"
        assert t[used:].abs().max() == 0, f"{name}: rows past the last offset are not 0"
    assert torch.isinf(lse[:, used:]).all() and (lse[:, used:] > 0).all()


def test_delta_rule_rows_past_the_last_offset_are_zero():
    torch.manual_seed(0)
    T, used, H, K, V = 80, 57, 2, 16, 16
    q = torch.randn(1, T, H, K, device=DEVICE, dtype=torch.float32, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=DEVICE), dim=-1).requires_grad_()
    v = torch.randn(1, T, H, V, device=DEVICE, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device=DEVICE) + 4).requires_grad_()
    beta = torch.rand(1, T, H, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 30, used], device=DEVICE, dtype=torch.int32)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    grads = torch.autograd.grad(o, (q, k, v, g, beta), torch.randn_like(o))
    for name, t in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), (o,) + grads):
        assert not torch.isnan(t).any(), f"{name}: NaN"
        assert t[:, used:].abs().max() == 0, f"{name}: rows past the last offset are not 0"
