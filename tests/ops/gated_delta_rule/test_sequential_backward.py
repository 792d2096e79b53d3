"""The sequential SM90 backward (gluon/backward_sequential.py: local_dv, bwd_dhu and the chunk
passes in one kernel per (sequence, value head)): every gradient against the fp64 reference,
fixed lengths and varlen with empty and single-token sequences (longest first), GQA, no gate,
initial and final states, K = V = 64 and 128; the same gradients as the separate passes; the rule
that keeps it off and refuses what it cannot run; and that it compiles for sm_90a on the CPU."""
import pytest
import torch

from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides

from .cases import (
    FUSED_CASES, ON_SM90, assert_choice_keeps_gradients, assert_mma_not_serialised, check_against_reference, compile_for_sm90,
    cu_from_lengths,
    make_inputs, poison_allocator
)

CASES = {name: case for name, case in FUSED_CASES.items() if case[4] == case[5]}  # K == V
CASES["gqa-K128"] = (2, 300, 2, 4, 128, 128, "g", True, torch.bfloat16, None)
CASES["no-gate-varlen"] = (1, 700, 2, 2, 128, 128, "none", False, torch.float16, [300, 0, 1, 399])


def _inputs(name, seed=0):
    B, T, H, HV, K, V, gate, states, dtype, lengths = CASES[name]
    torch.manual_seed(seed)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    return inputs, kwargs


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the sequential backward runs on SM90 GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_sequential_backward(name):
    B, T, H, HV, K, V, gate, states, dtype, lengths = CASES[name]
    inputs, kwargs = _inputs(name)
    with overrides(gdn_sequential_backward=True):
        plan = plan_call(inputs["q"], inputs["v"], gate != "none", False, chunk_layout(B, T, kwargs.get("cu_seqlens")))
        assert plan.sequential_backward_on()
        poison_allocator(B * T * HV * max(K, V), dtype)
        check_against_reference(inputs, dtype, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the sequential backward runs on SM90 GPUs")
@pytest.mark.parametrize("name", ["g-h0-K128", "gqa-K128", "varlen-empty-single"])
def test_gpu_sequential_backward_matches_the_passes(name):
    """The one kernel and the passes it replaces give the same gradients (tighter than either
    against fp64 would show)."""
    inputs, kwargs = _inputs(name, seed=1)
    dtype = CASES[name][8]
    assert_choice_keeps_gradients(inputs, dtype, kwargs, "gdn_sequential_backward", 1e-2,
                                  "the sequential kernel and the passes")


def test_sequential_backward_rule():
    """Off by default; forced where it cannot run (here: no SM90 GPU, or a sequence split), an
    error naming the choice."""
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16)
    layout = chunk_layout(1, 128, None)
    assert plan_call(q, q, True, False, layout).sequential_backward.value is False
    if not ON_SM90:
        with overrides(gdn_sequential_backward=True), pytest.raises(ValueError, match="gdn_sequential_backward"):
            plan_call(q, q, True, False, layout)
    with overrides(gdn_sequential_backward=True, gdn_chunks_per_segment=1), \
            pytest.raises(ValueError, match="gdn_sequential_backward"):
        plan_call(q, q, True, False, layout)


@pytest.mark.parametrize("K, has_g, varlen, gqa", [(128, True, False, False), (128, False, True, True),
                                                   (64, True, True, False)])
def test_sequential_backward_compiles_for_sm90(K, has_g, varlen, gqa):
    """The kernel compiles for sm_90a without a GPU, within shared memory, its warpgroup MMAs
    not serialised."""
    pointers = {n: "*bf16" for n in ("q", "k", "v", "v_new", "h", "do", "ai")}
    pointers.update({"g_cum": "*fp32", "beta": "*bf16", "dht": "*fp32", "dq": "*fp32" if gqa else "*bf16",
                     "dk": "*fp32" if gqa else "*bf16", "dv": "*bf16", "dbeta": "*fp32", "dg": "*fp32", "dh0": "*fp32",
                     "scratch": "*fp32", "cu_seqlens": "*i32", "chunk_offsets": "*i32", "order": "*i32"})
    constants = {"HQ": 2 if gqa else 4, "HV": 4, "K": K, "V": K, "HAS_G": has_g, "HAS_DHT": True, "STORE_DH0": True,
                 "IS_VARLEN": varlen}
    compiled = compile_for_sm90("flash_dma.ops.gated_delta_rule.gluon.backward_sequential.gdn_bwd_sequential_kernel",
                                pointers, {"T": "i32", "scale": "fp32"}, constants, {"num_warps": 8})
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)
