"""The backward after the state pass as one warp-role kernel (gluon/backward_ws.py,
`gdn_backward_warp_roles`: bwd_dhu, its intra-chunk dv and the chunk gradients fused): every
gradient of the op against the fp64 reference, fixed lengths and varlen with empty and
single-token sequences, GQA, K != V, K = V = 64, no gate, fp16, one chunk and a lone partial
chunk, whole and cut into segments; the same gradients as the passes it replaces; the rule, and
where it can be forced; and that it compiles for sm_90a on the CPU."""
import math

import pytest
import torch

from flash_dma.ops.gated_delta_rule import launch_table
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call

from .cases import (
    FUSED_CASES, ON_SM90, assert_choice_refused_where_it_cannot_run, assert_mma_not_serialised,
    assert_same_gradients_as, check_case_with_choices, compile_for_sm90
)

CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None)
    **FUSED_CASES,
    "K128-V64-gqa": (1, 300, 1, 2, 128, 64, "g", True, torch.bfloat16, None),
    "varlen-many-short": (1, 900, 2, 2, 128, 128, "none", True, torch.bfloat16, [64, 1, 63, 0, 129, 643]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role backward runs on SM90 GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_backward_warp_roles(name):
    check_case_with_choices(CASES[name], {"gdn_backward_warp_roles": True, "gdn_chunks_per_segment": 0},
                            lambda plan: plan.backward_warp_roles_on() and plan.segment_chunks("bwd_dhu") is None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role backward runs on SM90 GPUs")
@pytest.mark.parametrize("name", ["g-h0-K128", "no-gate-gqa-K64", "varlen-empty-single", "K64-V64"])
def test_gpu_backward_warp_roles_matches_passes(name):
    """The warp-role kernel and the passes it replaces (local_dv, bwd_dhu, the chunk backward)
    give the same gradients."""
    assert_same_gradients_as(CASES[name], "gdn_backward_warp_roles", "the warp-role backward and the passes")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role backward runs on SM90 GPUs")
def test_gpu_backward_warp_roles_rule_by_programs():
    """From the card's bound of (sequence, value head) programs a SM (a wave on an H200, half a
    wave on an H100); fewer: the passes."""
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    bound = launch_table.backward_warp_roles_bound(dev)
    assert 0 < bound <= 1
    assert launch_table.backward_warp_roles_rule(math.ceil(bound * sm), dev)
    assert not launch_table.backward_warp_roles_rule(math.ceil(bound * sm) - 1, dev)
    q = torch.empty(8, 4096, 32, 128, dtype=torch.bfloat16, device=dev)
    assert plan_call(q, q, True, False, chunk_layout(8, 4096, None)).backward_warp_roles.value is True
    q = torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16, device=dev)  # 32 programs
    assert plan_call(q, q, True, False, chunk_layout(2, 8192, None)).backward_warp_roles.value is False


def test_backward_warp_roles_forced_where_it_cannot_run():
    assert_choice_refused_where_it_cannot_run("gdn_backward_warp_roles", "backward_warp_roles")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role backward runs on SM90 GPUs")
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("name", ["g-h0-K128", "varlen-empty-single", "K128-V64-gqa", "no-gate-gqa-K64"])
def test_gpu_backward_warp_roles_over_segments(name, split):
    """Cut into segments (of one chunk, and a last segment shorter than the others): each segment
    runs from the state gradient at its end (bwd_dhu's local pass and the reverse join), every
    gradient and dh0 against fp64."""
    check_case_with_choices(CASES[name], {"gdn_backward_warp_roles": True, "gdn_chunks_per_segment": split},
                            lambda plan: plan.backward_warp_roles_on() and plan.segment_chunks("bwd_dhu") == split)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role backward runs on SM90 GPUs")
def test_gpu_backward_warp_roles_takes_the_forwards_cut():
    """One long sequence: the rule cuts the forward into segments, and the warp-role backward runs
    over the same segments (bwd_dhu cut alike)."""
    dev = torch.device("cuda")
    q = torch.empty(1, 32768, 16, 128, dtype=torch.bfloat16, device=dev)
    plan = plan_call(q, q, True, False, chunk_layout(1, 32768, None))
    assert plan.segment_chunks() is not None
    assert plan.backward_warp_roles.value is True
    assert plan.segment_chunks("bwd_dhu") == plan.segment_chunks()


@pytest.mark.parametrize("K, has_g, varlen, gqa", [(128, True, False, False), (128, True, True, True),
                                                   (64, False, True, False)])
def test_backward_warp_roles_compiles_for_sm90(K, has_g, varlen, gqa):
    """The kernel compiles for sm_90a without a GPU, within shared memory and without
    serialised warpgroup MMAs."""
    grad = "*fp32" if gqa else "*bf16"
    pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "v_new": "*bf16", "h": "*bf16", "do": "*bf16",
                "ai": "*bf16", "g_cum": "*fp32", "beta": "*bf16", "dht": "*fp32", "dq": grad, "dk": grad,
                "dv": "*bf16", "dbeta": "*fp32", "dg": "*fp32", "dh0": "*fp32", "cu_seqlens": "*i32",
                "chunk_offsets": "*i32"}
    constants = {"HQ": 2 if gqa else 4, "HV": 4, "K": K, "V": K, "HAS_G": has_g, "HAS_DHT": True,
                 "STORE_DH0": True, "IS_VARLEN": varlen}
    compiled = compile_for_sm90("flash_dma.ops.gated_delta_rule.gluon.backward_ws.gdn_bwd_ws_kernel", pointers,
                                {"T": "i32", "scale": "fp32"}, constants, {"num_warps": 4, "maxnreg": 168})
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)
