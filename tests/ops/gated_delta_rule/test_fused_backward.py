"""The fused SM90 chunk backward (gluon/backward_chunk.py: the Triton bwd_dqkw and bwd_wy passes
in one kernel): every gradient against the fp64 reference, fixed lengths and varlen with empty and
single-token sequences, GQA, K != V, no gate, the state passes whole and cut, beside each fused
forward form; the same gradients as the Triton passes; the rule that picks it; and that it
compiles for sm_90a on the CPU."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule import launch_table

from .cases import (
    FUSED_CASES, ON_SM90, assert_choice_refused_where_it_cannot_run, assert_mma_not_serialised, assert_same_gradients_as,
    check_case_with_choices, compile_for_sm90
)

CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None)
    **FUSED_CASES,
    "K128-V64-gqa": (1, 300, 2, 4, 128, 64, "g", True, torch.bfloat16, None),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused backward runs on SM90 GPUs")
@pytest.mark.parametrize("forward, split", [(0, None), ("ws", None), (128, 3), (0, 1)])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_fused_backward(name, forward, split):
    if forward == 128 and CASES[name][5] % 128:
        pytest.skip("V is not a multiple of the one-role forward's tile")
    chosen = {"gdn_fused_backward": True, "gdn_fused_forward": forward}
    if split is not None:
        chosen["gdn_chunks_per_segment"] = split
    check_case_with_choices(CASES[name], chosen,
                            lambda plan: plan.fused_backward_on() and plan.segment_chunks() == split)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused backward runs on SM90 GPUs")
@pytest.mark.parametrize("name", ["g-h0-K128", "no-gate-gqa-K64", "varlen-empty-single"])
def test_gpu_fused_backward_matches_triton_passes(name):
    """The fused kernel and the Triton passes it replaces give the same gradients (both against
    each other, tighter than either against fp64 would show)."""
    assert_same_gradients_as(CASES[name], "gdn_fused_backward", "the fused kernel and the Triton passes")


def test_fused_backward_rule():
    """Picked only on an SM90 GPU for what the kernel computes; forced where it cannot run, an
    error naming the choice."""
    cpu = torch.device("cpu")
    assert not launch_table.fused_backward_fits(128, 128, torch.bfloat16, False, cpu)
    assert_choice_refused_where_it_cannot_run("gdn_fused_backward", "fused_backward")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused backward runs on SM90 GPUs")
def test_gpu_fused_backward_rule():
    dev = torch.device(DEVICE)
    fits = launch_table.fused_backward_fits
    assert fits(128, 128, torch.bfloat16, False, dev) and fits(64, 64, torch.float16, False, dev)
    assert not fits(128, 128, torch.bfloat16, True, dev)
    assert not fits(128, 128, torch.float32, False, dev)
    assert not fits(256, 128, torch.bfloat16, False, dev) and not fits(128, 192, torch.bfloat16, False, dev)


@pytest.mark.parametrize("K, V, has_g, varlen, gqa", [(128, 128, True, False, False), (64, 128, False, True, True),
                                                      (128, 64, True, True, False), (64, 64, True, False, True)])
def test_fused_backward_compiles_for_sm90(K, V, has_g, varlen, gqa):
    """The kernel compiles for sm_90a without a GPU (Triton's compiler and bundled ptxas), within
    shared memory: CI catches a kernel that no longer builds."""
    names = ["q", "k", "v", "v_new", "h", "dh", "do", "dv2", "ai", "g_cum", "beta", "dq", "dk", "dv", "dbeta",
             "dg", "chunk_map", "cu_seqlens"]
    pointers = {n: "*bf16" for n in names}
    pointers.update(g_cum="*fp32", dbeta="*fp32", dg="*fp32", chunk_map="*i32", cu_seqlens="*i32")
    if gqa:
        pointers.update(dq="*fp32", dk="*fp32")
    constants = {"HQ": 2 if gqa else 4, "HV": 4, "K": K, "V": V, "HAS_G": has_g, "IS_VARLEN": varlen}
    compiled = compile_for_sm90("flash_dma.ops.gated_delta_rule.gluon.backward_chunk.gdn_bwd_chunk_kernel", pointers,
                                {"T": "i32", "scale": "fp32"}, constants, {"num_warps": 8})
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)
