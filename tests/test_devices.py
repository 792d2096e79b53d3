"""Tensors on a GPU other than the current one: the ops launch on the tensors' device (as
FlashAttention and FLA do), forward and backward. Needs two GPUs."""
import pytest
import torch

from flash_dma import (chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu, flash_dma_func,
                       flash_dma_varlen_func)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _results(device, seed):
    """Every op, forward and backward, on `device`; returns everything it computed (on the CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    B, S, H, D = 2, 300, 4, 64
    q, k, v = (rnd(B, S, H, D).requires_grad_() for _ in range(3))
    bias = rnd(B, H, S, S).requires_grad_()
    mask = (torch.rand(B, 1, S, S, generator=gen) < 0.6).to(device)
    out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, deterministic=True)
    results = [out, *torch.autograd.grad(out, (q, k, v, bias), rnd(*out.shape))]
    cu = torch.tensor([0, 100, 600], device=device, dtype=torch.int32)
    qp, kp, vp = (x.detach().reshape(600, H, D).requires_grad_() for x in (q, k, v))
    out = flash_dma_varlen_func(qp, kp, vp, cu, cu, 500, 500, deterministic=True)
    results += [out, *torch.autograd.grad(out, (qp, kp, vp), rnd(*out.shape))]
    T, K = 200, 64
    gq, gk_, gv = (rnd(1, T, H, K).requires_grad_() for _ in range(3))
    g = torch.nn.functional.logsigmoid(rnd(1, T, H, dtype=torch.float32)).requires_grad_()
    beta = torch.sigmoid(rnd(1, T, H, dtype=torch.float32)).requires_grad_()
    o, final = chunk_gated_delta_rule(gq, gk_, gv, g, beta, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    results += [o, final, *torch.autograd.grad((o.float().sum() + final.sum()), (gq, gk_, gv, g, beta))]
    dh, _, dv2 = chunk_gated_delta_rule_bwd_dhu(*(rnd(1, T, H, K) for _ in range(5)))
    results += [dh, dv2]
    torch.cuda.synchronize(device)
    return [r.detach().float().cpu() for r in results]


def test_tensors_on_another_gpu_than_the_current():
    with torch.cuda.device(1):
        expected = _results(torch.device("cuda:1"), 7)
    with torch.cuda.device(0):
        got = _results(torch.device("cuda:1"), 7)
        assert torch.cuda.current_device() == 0  # the ops restore it
    for i, (x, want) in enumerate(zip(got, expected)):
        assert not torch.isnan(x).any(), f"result {i}: NaN"
        assert torch.equal(x, want), f"result {i} differs from the same call made on its own device"
