"""The chunked gated delta rule under torch.compile(fullgraph=True, dynamic=True): the public
functions trace as the custom ops flash_dma::gated_delta_rule_fwd/bwd and
flash_dma::gated_delta_rule_bwd_dhu (custom_op.py) and give the eager results, gradients
included; eagerly the autograd Function runs. opcheck tests the ops' registrations.

aot_eager (AOTAutograd, no code generation) runs the real kernels: compiled and eager results
are bitwise equal. fp32 inputs (the interpreter's 16-bit products are slow and bf16 wrong)."""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import assert_compiled_matches_eager, assert_same
from conftest import DEVICE
from flash_dma import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu
from flash_dma.ops.gated_delta_rule.custom_op import gated_delta_rule_fwd
from flash_dma.ops.gated_delta_rule.launch_table import keeps_gated_pairs, keeps_inverse

from .cases import cu_from_lengths


def _leaf(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32, requires_grad=True)


def test_gates_and_states_fullgraph_dynamic():
    """Scalar gate, initial and final state, qk l2norm, grouped value heads; K = V = 64, where the
    forward keeps T and the gate cumsums for the backward (extra outputs of the forward op). A
    second length runs through the same graph."""
    B, H, HV, K, V = 1, 1, 2, 64, 64
    assert keeps_inverse(K, V, False)

    def loss(q, k, v, g_raw, beta_raw, h0):
        o, final = chunk_gated_delta_rule(q, k, v, F.logsigmoid(g_raw), torch.sigmoid(beta_raw),
                                          initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        return (o ** 2).sum() + (final * 0.5).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for T in (9, 14):
        leaves = [_leaf(B, T, H, K), _leaf(B, T, H, K), _leaf(B, T, HV, V), _leaf(B, T, HV),
                  _leaf(B, T, HV), _leaf(B, HV, K, V)]
        assert_compiled_matches_eager(compiled, loss, leaves)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for two lengths"


def test_per_key_gate_varlen_fullgraph():
    """Per-key gate gk alone (Kimi Delta Attention), packed sequences (cu_seqlens, one empty),
    initial and final state; K = V = 64, where the forward keeps T and the gated pair products
    for the backward (extra outputs of the forward op)."""
    H, K, V = 1, 64, 64
    assert keeps_gated_pairs(K, V, True)
    lengths = [7, 0, 5]
    T, n = sum(lengths), len(lengths)
    cu = torch.tensor([0, 7, 7, 12], device=DEVICE, dtype=torch.int32)

    def loss(q, k, v, gk_raw, beta_raw, h0):
        o, final = chunk_gated_delta_rule(q, k, v, None, torch.sigmoid(beta_raw), initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu, gk=F.logsigmoid(gk_raw))
        return o.sin().sum() + final.square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=True)
    leaves = [_leaf(1, T, H, K), _leaf(1, T, H, K), _leaf(1, T, H, V), _leaf(1, T, H, K), _leaf(1, T, H),
              _leaf(n, H, K, V)]
    assert_compiled_matches_eager(compiled, loss, leaves)


def test_bwd_dhu_fullgraph_varlen():
    """The public state-gradient pass with cu_seqlens: its chunk count is data-dependent (an
    unbacked size in the fake implementation)."""
    H, K, V = 1, 16, 16
    cu = torch.tensor([0, 70, 75, 90], device=DEVICE, dtype=torch.int32)
    T = 90
    q, k, w = (torch.randn(1, T, H, K, device=DEVICE) for _ in range(3))
    do, dv = (torch.randn(1, T, H, V, device=DEVICE) for _ in range(2))
    h0 = torch.randn(3, H, K, V, device=DEVICE)

    def run(q):
        dh, dh0, dv2 = chunk_gated_delta_rule_bwd_dhu(q * 0.5, k, w, do, dv, h0=h0, cu_seqlens=cu)
        return dh.sum(), dh0, dv2

    ref = run(q)
    torch._dynamo.reset()
    got = torch.compile(run, backend="aot_eager", fullgraph=True, dynamic=True)(q)
    for name, x, r in zip(("dh", "dh0", "dv2"), got, ref):
        assert_same(name, x, r)


def test_custom_op_traced_only_under_compile():
    # V = 32: narrower values are zero-padded on the GPU, and the slice would hide the op's node
    q, k, v = _leaf(1, 8, 1, 16), _leaf(1, 8, 1, 16), _leaf(1, 8, 1, 32)
    beta = torch.rand(1, 8, 1, device=DEVICE)
    o, _ = chunk_gated_delta_rule(q, k, v, None, beta)
    assert type(o.grad_fn).__name__ == "ChunkGatedDeltaRuleFunctionBackward"
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda q, k, v: chunk_gated_delta_rule(q, k, v, None, beta)[0],
                  backend=recording_backend, fullgraph=True)(q, k, v)
    assert "flash_dma.gated_delta_rule_fwd.default" in targets, targets


def test_opcheck():
    B, T, H, K, V = 1, 11, 1, 16, 16
    q, k, v = _leaf(B, T, H, K), _leaf(B, T, H, K), _leaf(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H, device=DEVICE)).requires_grad_()
    beta = torch.rand(B, T, H, device=DEVICE).requires_grad_()
    h0 = _leaf(B, H, K, V)
    torch.library.opcheck(gated_delta_rule_fwd, (q, k, v, g, None, beta, 0.25, h0, True, None, True))


def test_sequence_split_segments_cross_the_op_boundary(monkeypatch):
    """With the state pass cut into segments (forced here: two segments of one chunk for T = 70),
    the forward op returns each segment's start and transition, sized as its fake function says
    (opcheck), and the backward op hands them back to the backward, whose recompute then runs
    only the last pass, as the eager Function's does; compiled results equal eager ones."""
    from flash_dma.ops.gated_delta_rule.segments import segment_bound
    from flash_dma.ops.gated_delta_rule.triton import state_pass
    from flash_dma.runtime.config import overrides

    B, T, H, K, V = 1, 70, 1, 16, 16
    known_in_backward = []
    real_states = state_pass.states

    def spy(*args, known=None, **kwargs):
        known_in_backward.append(known is not None)
        return real_states(*args, known=known, **kwargs)

    monkeypatch.setattr(state_pass, "states", spy)

    def loss(q, k, v, g_raw, beta_raw, h0):
        o, final = chunk_gated_delta_rule(q, k, v, F.logsigmoid(g_raw), torch.sigmoid(beta_raw),
                                          initial_state=h0, output_final_state=True)
        return (o ** 2).sum() + final.sum()

    leaves = [_leaf(B, T, H, K), _leaf(B, T, H, K), _leaf(B, T, H, V), _leaf(B, T, H), _leaf(B, T, H),
              _leaf(B, H, K, V)]
    with overrides(gdn_chunks_per_segment=1):
        outputs = gated_delta_rule_fwd(*(x.detach() for x in leaves[:3]), F.logsigmoid(leaves[3]).detach(), None,
                                       torch.sigmoid(leaves[4]).detach(), K ** -0.5, leaves[5].detach(), True,
                                       None, False)
        slots = segment_bound(B, T, None, 1)
        assert outputs[6].shape == (slots, H, K, V) and outputs[7].shape == (slots, H, K, K)
        q, k, v, g_raw, beta_raw, h0 = leaves
        torch.library.opcheck(gated_delta_rule_fwd, (q, k, v, F.logsigmoid(g_raw), None, torch.sigmoid(beta_raw),
                                                     0.25, h0, True, None, True))
        torch._dynamo.reset()
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
        known_in_backward.clear()
        assert_compiled_matches_eager(compiled, loss, leaves)
    # every forward (compiled, eager; on the GPU also the first call's compile-ahead dry run) cuts,
    # and every backward's recompute is given the forward's segments
    assert known_in_backward.count(True) == known_in_backward.count(False) >= 2, known_in_backward


def test_fake_forward_keeps_what_the_forward_keeps():
    """The forward op's fake outputs have the kept tensors' shapes and dtypes (bf16 inputs): with
    gk T and the gated query-key products in bf16 (wy_prepare.inverse_buffer, gate_pairs.gated_pairs)
    and the per-key gate cumsums in fp32 (and the scalar one with g beside); with the scalar gate
    alone T in bf16 and its cumsums, no pair products."""
    from flash_dma.ops.gated_delta_rule.custom_op import _gated_delta_rule_fwd_fake
    from flash_dma.ops.gated_delta_rule.triton.wy_prepare import inverse_buffer
    B, T, H, K = 1, 70, 2, 64
    q = torch.empty(B, T, H, K, device="meta", dtype=torch.bfloat16)
    gate = torch.empty(B, T, H, K, device="meta", dtype=torch.float32)
    beta = torch.empty(B, T, H, device="meta", dtype=torch.bfloat16)
    o, _, g_cum, gk_cum, ai, aqk, *_ = _gated_delta_rule_fwd_fake(q, q, q, None, gate, beta, 0.125, None, False,
                                                                  None, False)
    assert o.shape == (B, T, H, K) and g_cum.numel() == 0
    assert gk_cum.dtype == torch.float32 and gk_cum.shape == (B, T, H, K)
    assert ai.dtype == inverse_buffer(q, H).dtype == torch.bfloat16 and ai.shape == (B, T, H, 64)
    assert aqk.dtype == q.dtype and aqk.shape == (B, T, H, 64)
    _, _, g_cum, gk_cum, *_ = _gated_delta_rule_fwd_fake(q, q, q, gate[..., 0], gate, beta, 0.125, None, False,
                                                         None, False)
    assert g_cum.shape == (B, T, H) and gk_cum.shape == (B, T, H, K)
    _, _, g_cum, gk_cum, ai, aqk, *_ = _gated_delta_rule_fwd_fake(q, q, q, gate[..., 0], None, beta, 0.125, None,
                                                                  False, None, False)
    assert g_cum.shape == (B, T, H) and g_cum.dtype == torch.float32 and gk_cum.numel() == 0
    assert ai.dtype == inverse_buffer(q, H).dtype == torch.bfloat16 and aqk.numel() == 0


def test_kept_states_fullgraph_dynamic_varlen(monkeypatch):
    """disable_recompute under torch.compile(dynamic=True): both gates, packed sequences (one
    empty), K = V = 64 where w and the gated q, k are kept beside the states. What is kept
    follows the plan, so the forward op's fake function specialises the sizes the plan reads: a
    second total length compiles again (and is planned for its own size); opcheck compares the
    fake function's outputs with the real ones."""
    from flash_dma.ops.gated_delta_rule import plan as plan_module
    H, K, V = 1, 64, 64
    assert keeps_gated_pairs(K, V, True)
    real_build = plan_module._build

    def build(*key, **kwargs):  # on a GPU the launch table memoises on the sizes: no symbols there
        assert all(not isinstance(x, torch.SymInt) for x in key), key
        return real_build(*key, **kwargs)
    monkeypatch.setattr(plan_module, "_build", build)

    def loss(q, k, v, g_raw, gk_raw, beta_raw, cu):
        o, _ = chunk_gated_delta_rule(q, k, v, F.logsigmoid(g_raw), torch.sigmoid(beta_raw), cu_seqlens=cu,
                                      gk=F.logsigmoid(gk_raw), disable_recompute=True)
        return o.sin().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([7, 0, 5], [3, 66, 0]):
        T = sum(lengths)
        cu = cu_from_lengths(lengths)
        leaves = [_leaf(1, T, H, K), _leaf(1, T, H, K), _leaf(1, T, H, V), _leaf(1, T, H), _leaf(1, T, H, K),
                  _leaf(1, T, H)]
        want = loss(*leaves, cu)
        want_grads = torch.autograd.grad(want, leaves)
        got = compiled(*leaves, cu)
        assert_same(f"loss {lengths}", got, want)
        for i, (a, b) in enumerate(zip(torch.autograd.grad(got, leaves), want_grads)):
            assert_same(f"grad of input {i} {lengths}", a, b)
    assert counter.frame_count == 2, f"{counter.frame_count} compilations for two total lengths"
    q, k, v, g_raw, gk_raw, beta_raw = (x.detach() for x in leaves)
    torch.library.opcheck(gated_delta_rule_fwd, (q, k, v, F.logsigmoid(g_raw), F.logsigmoid(gk_raw),
                                                 torch.sigmoid(beta_raw), 0.125, None, False, cu, True, True))


@pytest.mark.parametrize("case", ["tokens-past-the-last-offset", "kept-pairs-past-the-last-offset",
                                  "cut-empty"])
def test_opcheck_keeping_states(case):
    """The forward op with disable_recompute: its fake function's kept outputs match the real
    ones, which are reproducible (opcheck runs the op several times and compares): rows no
    kernel writes (packed tokens past cu_seqlens[-1], chunk slots past the sequences' chunks)
    are zeroed; with a forced cut and no tokens the fake keeps no segment starts either."""
    from flash_dma.runtime.config import overrides

    K, lengths, T, gate, extra = {
        "tokens-past-the-last-offset": (16, [3, 0], 130, "g", {}),
        "kept-pairs-past-the-last-offset": (64, [7, 60], 100, "gk", {}),
        "cut-empty": (16, None, 0, "g", {"gdn_chunks_per_segment": 1}),
    }[case]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, 1, K, device=DEVICE) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, T, 1, device=DEVICE))
    gk = F.logsigmoid(torch.randn(1, T, 1, K, device=DEVICE)) if gate == "gk" else None
    beta = torch.rand(1, T, 1, device=DEVICE)
    cu = None if lengths is None else cu_from_lengths(lengths)
    with overrides(**extra):
        outputs = gated_delta_rule_fwd(q, k, v, g, gk, beta, 0.25, None, False, cu, True, True)
        assert outputs[8].numel() or T == 0, "no states kept"
        torch.library.opcheck(gated_delta_rule_fwd, (q, k, v, g, gk, beta, 0.25, None, False, cu, True, True))
