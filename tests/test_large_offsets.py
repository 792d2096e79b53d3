"""Tensors past 2^31 elements: every offset that can pass int32 must be computed in int64.

The kernels index token rows as (first row of a sequence or batch) x (row stride); at H = 16,
D = 128 a [tokens, H, D] tensor passes 2^31 elements at 2^20 tokens. Each test packs cheap filler
sequences in front, so that the sequences it checks start at or past element 2^31 of q, k, v, the
outputs and every gradient (and, for the delta rule, of the per-chunk state tensors), and compares
those sequences, plus the first one, with the fp64 reference run on them alone (sequences are
independent). GPU only: each needs tens of GB of device memory, so they take a file lock, one at
a time across pytest-xdist workers, and skip where the GPU is too small.
"""
import contextlib
import fcntl
import os
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from helpers import assert_close, assert_lse_close
from flash_dma import chunk_gated_delta_rule, flash_dma_func, flash_dma_varlen_func
from flash_dma.ops.dynamic_mask_attention import attention_reference
from flash_dma.ops.gated_delta_rule.reference import gated_delta_rule_reference

pytestmark = pytest.mark.gpu

H, D = 16, 128  # 2048 elements per token: 2^20 tokens is 2^31 elements
PAST = 1 << 20  # tokens (or batch x length) in front of the checked sequences
GIB = 1 << 30


# How long a large test waits for other processes (xdist workers beside it) to free the memory
# it needs before it skips, saying so
FREE_MEMORY_WAIT_S = 120


def _wait_for_free_memory(gib_needed: int) -> None:
    deadline = time.monotonic() + FREE_MEMORY_WAIT_S
    while True:
        free = torch.cuda.mem_get_info()[0]
        if free >= gib_needed * GIB:
            return
        if time.monotonic() > deadline:
            pytest.skip(f"needs about {gib_needed} GiB of free GPU memory; other processes left "
                        f"{free / GIB:.0f} GiB for {FREE_MEMORY_WAIT_S} s (run it alone)")
        time.sleep(2)


@contextlib.contextmanager
def large_memory(gib_needed: int):
    """One large-memory test at a time on this machine; skip where the GPU cannot hold it, or
    where other processes keep the memory it needs."""
    total = torch.cuda.get_device_properties(0).total_memory
    if total < gib_needed * GIB:
        pytest.skip(f"needs about {gib_needed} GiB of GPU memory, this GPU has {total / GIB:.0f}")
    path = os.path.join(tempfile.gettempdir(), "flash_dma_large_gpu_tests.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            torch.cuda.empty_cache()
            _wait_for_free_memory(gib_needed)
            torch.cuda.reset_peak_memory_stats()
            yield
            print(f"peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.1f} GiB")
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_attention_sequence(got, q, k, v, dout, start, length, mask, bias, causal):
    """got: (out, lse, dq, dk, dv, dbias-or-None) of the whole call; the reference on one
    sequence [start, start + length) of a packed layout (mask/bias rows: that sequence's)."""
    out, lse, dq, dk, dv, dbias = got
    rows = slice(start, start + length)
    leaves = [t[rows][None].detach().double().requires_grad_() for t in (q, k, v)]
    ref_bias = bias.detach().double().requires_grad_() if bias is not None else None
    ref_out, ref_lse = attention_reference(*leaves, mask, ref_bias, causal)
    dtype = q.dtype
    assert_close("out", out[rows], ref_out[0], dtype)
    assert_lse_close(lse[:, rows], ref_lse[0])
    wanted = torch.autograd.grad(ref_out, leaves + ([ref_bias] if bias is not None else []),
                                 dout[rows][None].double())
    for name, g, w in zip(("dq", "dk", "dv"), (dq, dk, dv), wanted):
        assert_close(name, g[rows], w[0], dtype)
    if bias is not None:
        assert_close("dbias", dbias, wanted[3], dtype)


@pytest.mark.parametrize("kind", ["varlen-causal", "varlen-keywise-mask-bias", "batch"])
def test_attention_offsets_past_2_31(kind):
    dtype = torch.bfloat16
    with large_memory(48):
        if kind == "batch":  # the batch offset: b x (S H D) passes 2^31 from batch PAST / S on
            S = 1024
            B = PAST // S + 3
            q, k, v, dout = (torch.randn(B, S, H, D, device=DEVICE, dtype=dtype) for _ in range(4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out, lse = flash_dma_func(*leaves, return_lse=True)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
            flat = [t.view(B * S, H, D) for t in (q, k, v, dout, out, dq, dk, dv)]
            lse_rows = lse.permute(1, 0, 2).reshape(H, B * S)
            for b in (0, PAST // S, B - 1):
                check_attention_sequence(
                    (flat[4], lse_rows, flat[5], flat[6], flat[7], None), *flat[:3], flat[3],
                    b * S, S, None, None, False)
            return
        # packed sequences: 1024 of 1024 tokens, then the checked ones from token 2^20 on
        lengths = [1024] * (PAST // 1024) + [37, 1000, 300]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEVICE,
                          dtype=torch.int32)
        total, n, longest = sum(lengths), len(lengths), max(lengths)
        q, k, v, dout = (torch.randn(total, H, D, device=DEVICE, dtype=dtype) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        causal = kind == "varlen-causal"
        mask = bias = None
        if not causal:  # a key-wise keep-set per sequence (the gathered-key path) and its bias
            mask = torch.rand(n, 1, 1, longest, device=DEVICE) < 0.3
            bias = torch.randn(n, H, 1, longest, device=DEVICE, dtype=dtype).requires_grad_()
        out, lse = flash_dma_varlen_func(*leaves, cu, cu, longest, longest, attn_mask=mask,
                                         attn_bias=bias, is_causal=causal, return_lse=True)
        grads = torch.autograd.grad(out, leaves + ([bias] if bias is not None else []), dout)
        dbias = grads[3] if bias is not None else None
        starts = cu.tolist()
        for i in (0, n - 3, n - 2, n - 1):
            start, length = starts[i], lengths[i]
            seq_mask = mask[i:i + 1, :, :, :length] if mask is not None else None
            seq_bias = bias[i:i + 1, :, :, :length] if bias is not None else None
            got_dbias = dbias[i:i + 1, :, :, :length] if dbias is not None else None
            check_attention_sequence((out, lse, *grads[:3], got_dbias), q, k, v, dout, start,
                                     length, seq_mask, seq_bias, causal)


def test_gated_delta_rule_offsets_past_2_31():
    """Varlen forward and backward with the checked sequences past token 2^20: q, k, v, o and
    their gradients pass 2^31 elements there, and the per-chunk states ([chunks, H, K, V], twice
    q's size at K = V = 128) from about token 2^19 on."""
    dtype = torch.bfloat16
    with large_memory(90):
        lengths = [4096] * (PAST // 4096) + [200, 300]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEVICE,
                          dtype=torch.int32)
        total, n = sum(lengths), len(lengths)
        q = torch.randn(1, total, H, D, device=DEVICE, dtype=dtype)
        k = F.normalize(torch.randn(1, total, H, D, device=DEVICE, dtype=dtype), dim=-1)
        v = torch.randn(1, total, H, D, device=DEVICE, dtype=dtype)
        g = F.logsigmoid(torch.randn(1, total, H, device=DEVICE) + 5.0)
        beta = torch.sigmoid(torch.randn(1, total, H, device=DEVICE)).to(dtype)
        h0 = torch.randn(n, H, D, D, device=DEVICE)
        leaves = [t.requires_grad_() for t in (q, k, v, g, beta, h0)]
        o, final = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                          output_final_state=True, cu_seqlens=cu)
        do, dfinal = torch.randn_like(o), torch.randn_like(final)
        grads = torch.autograd.grad([o, final], leaves, [do, dfinal])
        starts = cu.tolist()
        for i in (0, n - 2, n - 1):
            rows = slice(starts[i], starts[i] + lengths[i])
            ref = [t[:, rows].detach().double().requires_grad_() for t in (q, k, v, g, beta)]
            ref_h0 = h0[i:i + 1].detach().double().requires_grad_()
            ref_o, ref_final = gated_delta_rule_reference(*ref, initial_state=ref_h0,
                                                          output_final_state=True)
            assert_close("o", o[:, rows], ref_o, dtype)
            assert_close("final_state", final[i:i + 1], ref_final, dtype)
            wanted = torch.autograd.grad([ref_o, ref_final], ref + [ref_h0],
                                         [do[:, rows].double(), dfinal[i:i + 1].double()])
            for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, wanted):
                assert_close(name, got[:, rows], want, dtype, scale=1.5 if name == "dg" else 1.0)
            assert_close("dh0", grads[5][i:i + 1], wanted[5], dtype)
