"""Forward and backward captured in a CUDA graph (the usual whole-step capture: warm-up calls on
the static tensors first, then capture, then new values copied in before each replay).

What the host derives from a tensor's contents (a mask's tile lists, a varlen chunk layout) is
remembered per tensor for eager calls; in capture it must be built by captured kernels instead, or
every replay would reuse the lists of the warm-up mask. Each test changes that content between
replays and compares with eager calls on the new values."""
import pytest
import torch

from helpers import rel_err
from flash_dma import chunk_gated_delta_rule, flash_dma_func, flash_dma_varlen_func

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16


def _capture(step, leaves):
    """Warm up step() on a side stream (as torch's docs do), then capture it; returns (graph,
    the captured outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def _replay(graph, leaves, new_values, *, also=()):
    """Copy new values into the captured leaves (and each (static, new) pair of `also`), replay,
    and return fresh leaves holding the new values for the eager reference."""
    with torch.no_grad():
        for static, new in also:
            static.copy_(new)
        for leaf, x in zip(leaves, new_values):
            leaf.copy_(x)
    graph.replay()
    return [x.clone().requires_grad_() for x in new_values]


def _assert_matches(names, captured, ref, context=""):
    """Replayed results against eager calls on the new values (NaN never passes: rel_err)."""
    for name, got, want in zip(names, captured, ref):
        err = rel_err(got, want)
        assert err < 1e-2, f"{context}{name} differs from an eager call by {err:.2e}"


def _block_mask(B, H, S, block, density, device):
    n = -(-S // block)
    tiles = torch.rand(B, H, n, n, device=device) < density
    mask = tiles.repeat_interleave(block, 2).repeat_interleave(block, 3)[:, :, :S, :S]
    # some partial tiles too: a few entries hidden inside kept tiles
    return mask & (torch.rand(B, H, S, S, device=device) < 0.97)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_mask_changes_between_replays(causal):
    B, S, H, D = 2, 1000, 4, 128
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
    bias = torch.randn(B, H, S, S, device="cuda", dtype=DTYPE)
    mask = _block_mask(B, H, S, 128, 0.5, "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]

    def step():
        out = flash_dma_func(*leaves[:3], attn_mask=mask, attn_bias=leaves[3], is_causal=causal)
        return (out,) + torch.autograd.grad(out, leaves, dout)

    graph, captured = _capture(step, leaves)
    for density in (0.3, 0.8):
        new_mask = _block_mask(B, H, S, 128, density, "cuda")
        fresh = _replay(graph, leaves, [torch.randn_like(t) for t in (q, k, v, bias)],
                        also=[(mask, new_mask)])
        ref_out = flash_dma_func(*fresh[:3], attn_mask=new_mask.clone(), attn_bias=fresh[3],
                                 is_causal=causal)
        ref = (ref_out,) + torch.autograd.grad(ref_out, fresh, dout)
        _assert_matches(("out", "dq", "dk", "dv", "dbias"), captured, ref, f"density {density}: ")


def test_attention_topk_mask_changes_between_replays():
    """A top-k key-wise mask made before capture, with compaction on: the capture must read the
    mask (the kept keys remembered for it are not replayed), so new top-k rows copied in before a
    replay take effect."""
    from flash_dma import topk_mask_from_bias
    from flash_dma.runtime import config
    B, S, H, D = 2, 2000, 4, 128
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
    mask = topk_mask_from_bias(torch.randn(B, H, 1, S, device="cuda"), 256)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flash_dma_func(*leaves, attn_mask=mask)
        return (out,) + torch.autograd.grad(out, leaves, dout)

    with config.overrides(attention_keywise_compaction="on"):
        graph, captured = _capture(step, leaves)
    new_mask = topk_mask_from_bias(torch.randn(B, H, 1, S, device="cuda"), 256)
    fresh = _replay(graph, leaves, [torch.randn_like(t) for t in (q, k, v)], also=[(mask, new_mask)])
    ref_out = flash_dma_func(*fresh, attn_mask=new_mask.clone())
    ref = (ref_out,) + torch.autograd.grad(ref_out, fresh, dout)
    _assert_matches(("out", "dq", "dk", "dv"), captured, ref)


def test_attention_without_mask_replays():
    """No mask: the backward walks lists of every tile (made per shape, and in capture by captured
    kernels); inputs change between replays."""
    B, S, H, D = 2, 700, 4, 128
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flash_dma_func(*leaves, is_causal=True)
        return (out,) + torch.autograd.grad(out, leaves, dout)

    graph, captured = _capture(step, leaves)
    fresh = _replay(graph, leaves, [torch.randn_like(t) for t in (q, k, v)])
    ref_out = flash_dma_func(*fresh, is_causal=True)
    ref = (ref_out,) + torch.autograd.grad(ref_out, fresh, dout)
    _assert_matches(("out", "dq", "dk", "dv"), captured, ref)


def test_varlen_attention_mask_changes_between_replays():
    lengths, H, D = [300, 0, 517], 4, 64
    cu = torch.tensor([0, 300, 300, 817], device="cuda", dtype=torch.int32)
    q, k, v, dout = (torch.randn(817, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
    mask = _block_mask(3, H, max(lengths), 64, 0.5, "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flash_dma_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), attn_mask=mask,
                                    is_causal=True)
        return (out,) + torch.autograd.grad(out, leaves, dout)

    graph, captured = _capture(step, leaves)
    new_mask = _block_mask(3, H, max(lengths), 64, 0.3, "cuda")
    fresh = _replay(graph, leaves, [q, k, v], also=[(mask, new_mask)])
    ref_out = flash_dma_varlen_func(*fresh, cu, cu, max(lengths), max(lengths),
                                    attn_mask=new_mask.clone(), is_causal=True)
    ref = (ref_out,) + torch.autograd.grad(ref_out, fresh, dout)
    _assert_matches(("out", "dq", "dk", "dv"), captured, ref)


def test_varlen_delta_rule_lengths_change_between_replays():
    T, H, K, V = 3000, 4, 128, 128
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).to(DTYPE)
            for _ in range(2))
    v = torch.randn(1, T, H, V, device="cuda", dtype=DTYPE)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda") + 3)
    beta = torch.rand(1, T, H, device="cuda").to(DTYPE)
    do = torch.randn(1, T, H, V, device="cuda", dtype=DTYPE)
    cu = torch.tensor([0, 700, 1500, 3000], device="cuda", dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]

    def step():
        o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
        return (o,) + torch.autograd.grad(o, leaves, do)

    graph, captured = _capture(step, leaves)
    for bounds in ([0, 64, 2000, 3000], [0, 1, 1301, 3000]):  # same count, same total
        fresh = _replay(graph, leaves, [q, k, v, g, beta],
                        also=[(cu, torch.tensor(bounds, device="cuda", dtype=torch.int32))])
        ref_o, _ = chunk_gated_delta_rule(*fresh, cu_seqlens=cu.clone())
        ref = (ref_o,) + torch.autograd.grad(ref_o, fresh, do)
        _assert_matches(("o", "dq", "dk", "dv", "dg", "dbeta"), captured, ref, f"lengths {bounds}: ")
