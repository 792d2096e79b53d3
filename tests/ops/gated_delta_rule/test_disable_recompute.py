"""disable_recompute: the forward keeps its per-chunk states and v_new, and the backward runs no
state pass of its own; outputs and gradients stay those of the fp64 reference (and of the
recomputing backward)."""
from unittest import mock

import pytest
import torch

from flash_dma import chunk_gated_delta_rule
from flash_dma.ops.gated_delta_rule import autograd, launch_table, tune
from flash_dma.runtime.config import overrides

from conftest import DTYPES

from .cases import DEVICE, GPU_SHAPES, SHAPES, check_errors, cu_from_lengths, make_inputs, run_op, run_reference

STATE_PASSES = ("fwd_h", "fwd_h_from_t")

CASES = {  # name: (B, T, H, HV, K, V, gate, states, lengths, overrides)
    "odd-T": (*SHAPES["odd-T"], None, {}),
    "gk-only": (*SHAPES["gk-only"], None, {}),
    "g+gk-gva": (*SHAPES["g+gk-gva"], None, {}),
    "K64-kept-T": (*SHAPES["K64-kept-T-gva"], None, {}),
    "K64-kept-pairs-g+gk-gva": (*SHAPES["K64-kept-pairs-g+gk-gva"], None, {}),
    "varlen-0-1-gk": (1, 200, 1, 2, 32, 16, "gk", True, [0, 70, 1, 129], {}),
    "varlen-cut": (1, 300, 1, 1, 32, 32, "g", True, [0, 230, 1, 69], {"gdn_chunks_per_segment": 1}),
}


def _results(inputs, cotangents, states, reference=False, **kwargs):
    """o, the final state and every gradient of the op (kwargs its options) or the reference,
    with the passes the op launched forward and backward."""
    run = run_reference if reference else run_op
    kept = []
    real = autograd.forward

    def forward(*args, **kw):  # records what the forward handed to the backward
        out = real(*args, **kw)
        kept.append(out[-1])
        return out
    with tune._PassRecorder() as forward_passes, mock.patch.object(autograd, "forward", forward):
        leaves, o, final = run(inputs, output_final_state=states, **kwargs)
    forward_passes.kept = any(k is not None for k in kept)
    # w kept, and with gk the gated q and k: the backward need not recompute them
    forward_passes.kept_wy = any(k is not None and k[2] is not None and (inputs.get("gk") is None or k[4] is not None)
                                 for k in kept)
    forward_passes.kept_any_wy = any(k is not None and any(t is not None for t in k[2:]) for k in kept)
    outputs = [o] + ([final] if states else [])
    with tune._PassRecorder() as backward_passes:
        grads = torch.autograd.grad(outputs, list(leaves.values()), cotangents[:len(outputs)])
    out = {"o": o, **({"final_state": final} if states else {})}
    out.update({"d" + name: grad for name, grad in zip(leaves, grads)})
    return out, forward_passes, backward_passes.seen


def _inputs(case):
    B, T, H, HV, K, V, gate, states, lengths, _ = case
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, DTYPES[-1], gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    cotangents = [torch.randn_like(inputs["v"])]
    if states:
        cotangents.append(torch.randn_like(inputs["initial_state"]))
    return inputs, kwargs, cotangents


def _check(case, dtype):
    inputs, kwargs, cotangents = _inputs(case)
    states, extra = case[7], case[9]
    with overrides(**extra):
        kept, forward_passes, kept_passes = _results(inputs, cotangents, states, disable_recompute=True, **kwargs)
        recomputed, _, recomputed_passes = _results(inputs, cotangents, states, **kwargs)
    reference, *_ = _results(inputs, [c.double() for c in cotangents], states, reference=True, **kwargs)
    # the recomputing backward runs a state pass; where the forward ran a Triton one (the fused
    # SM90 forward writes no states), its states are kept and the backward runs none
    assert any(p in recomputed_passes for p in STATE_PASSES), recomputed_passes
    if DEVICE == "cpu":
        assert forward_passes.kept
    # (a fused forward with a cut launches a state pass for the segments' starts, yet keeps nothing)
    assert any(p in kept_passes for p in STATE_PASSES) != forward_passes.kept, kept_passes
    if forward_passes.kept_wy:
        assert "recompute_wu" not in kept_passes, kept_passes
    if forward_passes.kept and not launch_table._recompute_tiles_whole(case[4], case[5]):
        # T not kept: the backward prepares again, which forms w and the gated q, k itself
        assert not forward_passes.kept_any_wy, "w or the gated q, k kept where the backward cannot use them"
    assert kept.keys() == reference.keys()
    check_errors({name: (kept[name], reference[name]) for name in kept}, dtype)
    check_errors({name: (kept[name], recomputed[name]) for name in kept}, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_kept_states_match_reference_and_recompute(name):
    _check(CASES[name], DTYPES[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gva-kda-128", "gk-K64-V128", "K256-V256", "h4-128"])
def test_gpu_kept_states(shape):
    _check((*GPU_SHAPES[shape], None, {}), torch.bfloat16)


def test_no_states_kept_without_a_backward():
    """Without a backward (no grad wanted) nothing is kept: the flag changes nothing."""
    inputs, kwargs, _ = _inputs(CASES["gk-only"])
    real, kept = autograd.forward, []
    with torch.no_grad(), mock.patch.object(autograd, "forward",
                                            lambda *a, **kw: kept.append(real(*a, **kw)) or kept[-1]):
        _, o_kept, _ = run_op(inputs, leaves_wanted=False, disable_recompute=True, **kwargs)
        _, o, _ = run_op(inputs, leaves_wanted=False, **kwargs)
    assert kept and all(out[-1] is None for out in kept)
    assert torch.equal(o_kept, o)


@pytest.mark.parametrize("name", ["odd-T", "gk-only", "K64-kept-pairs-g+gk-gva", "varlen-0-1-gk", "varlen-cut"])
def test_kept_states_under_torch_compile(name):
    """torch.compile's custom ops keep what the eager Function keeps (autograd.kept_states_form,
    sized by the forward op's fake function): the compiled backward runs no state pass (nor
    recompute_wu where w is kept), and the compiled call (fullgraph, AOTAutograd) returns what
    the eager one does, gradients included."""
    case = CASES[name]
    inputs, kwargs, cotangents = _inputs(case)
    states, extra = case[7], case[9]
    names = [n for n, t in inputs.items() if t is not None]

    def call(*leaves):
        x = dict(zip(names, leaves))
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x.get("g"), x["beta"],
                                      initial_state=x.get("initial_state"), gk=x.get("gk"),
                                      output_final_state=states, disable_recompute=True, **kwargs)

    with overrides(**extra):
        eager, forward_passes, _ = _results(inputs, cotangents, states, disable_recompute=True, **kwargs)
        torch._dynamo.reset()
        compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
        leaves = [inputs[n].clone().requires_grad_() for n in names]
        o, final = compiled(*leaves)
        outputs = [o] + ([final] if states else [])
        with tune._PassRecorder() as backward_passes:
            grads = torch.autograd.grad(outputs, leaves, cotangents[:len(outputs)])
    if DEVICE == "cpu":
        assert forward_passes.kept
    assert any(p in backward_passes.seen for p in STATE_PASSES) != forward_passes.kept, backward_passes.seen
    if forward_passes.kept_wy:
        assert "recompute_wu" not in backward_passes.seen, backward_passes.seen
    got = {"o": o, **({"final_state": final} if states else {}), **{"d" + n: g for n, g in zip(names, grads)}}
    assert got.keys() == eager.keys()
    for key in got:
        assert not torch.isnan(got[key]).any(), key
        assert torch.equal(got[key], eager[key]), f"{key}: the compiled call differs from the eager one"
