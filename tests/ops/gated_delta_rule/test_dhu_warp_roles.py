"""bwd_dhu with warp roles (gluon/bwd_dhu_ws.py, `gdn_dhu_warp_roles`), which forms the
intra-chunk dv and w itself: every gradient of the op against the fp64 reference, fixed lengths
and varlen with empty and single-token sequences, GQA, K != V, no gate, with and without the
fused chunk backward, whole sequences; the same gradients as the Triton passes it replaces;
where it can be forced; and that it compiles for sm_90a on the CPU."""
import pytest
import torch

from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call

from .cases import (
    FUSED_CASES, ON_SM90, assert_choice_refused_where_it_cannot_run, assert_mma_not_serialised, assert_refuses_a_cut,
    assert_same_gradients_as, check_case_with_choices, compile_for_sm90
)

CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None)
    **FUSED_CASES,
    "V256-gqa": (1, 300, 1, 2, 128, 256, "g", True, torch.bfloat16, None),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role bwd_dhu runs on SM90 GPUs")
@pytest.mark.parametrize("fused_backward", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_dhu_warp_roles(name, fused_backward):
    if fused_backward and CASES[name][5] not in (64, 128):
        pytest.skip("the fused chunk backward takes V 64 or 128")
    chosen = {"gdn_dhu_warp_roles": True, "gdn_fused_backward": fused_backward, "gdn_chunks_per_segment": 0}
    check_case_with_choices(CASES[name], chosen,
                            lambda plan: plan.dhu_warp_roles_on() and plan.segment_chunks("bwd_dhu") is None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role bwd_dhu runs on SM90 GPUs")
@pytest.mark.parametrize("name", ["g-h0-K128", "no-gate-gqa-K64", "varlen-empty-single"])
def test_gpu_dhu_warp_roles_matches_triton_passes(name):
    """The warp-role kernel and the Triton passes it replaces (local_dv, the recompute of w,
    bwd_dhu) give the same gradients."""
    assert_same_gradients_as(CASES[name], "gdn_dhu_warp_roles", "the warp-role bwd_dhu and the Triton passes")


def test_dhu_warp_roles_forced_where_it_cannot_run():
    assert_choice_refused_where_it_cannot_run("gdn_dhu_warp_roles", "dhu_warp_roles")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role bwd_dhu runs on SM90 GPUs")
def test_gpu_dhu_warp_roles_refuses_a_cut():
    assert_refuses_a_cut("gdn_dhu_warp_roles")


@pytest.mark.parametrize("K, has_g, varlen", [(128, True, False), (64, False, True)])
def test_dhu_warp_roles_compiles_for_sm90(K, has_g, varlen):
    """The kernel compiles for sm_90a without a GPU, within shared memory and without
    serialised warpgroup MMAs."""
    pointers = {"q": "*bf16", "k": "*bf16", "do": "*bf16", "ai": "*bf16", "beta": "*bf16", "g_cum": "*fp32",
                "dht": "*fp32", "dh": "*bf16", "dh0": "*fp32", "dv2": "*bf16", "cu_seqlens": "*i32",
                "chunk_offsets": "*i32"}
    constants = {"HQ": 2, "HV": 4, "K": K, "V": 128, "STAGES": 2, "HAS_G": has_g, "HAS_DHT": True,
                 "STORE_DH0": True, "IS_VARLEN": varlen}
    compiled = compile_for_sm90("flash_dma.ops.gated_delta_rule.gluon.bwd_dhu_ws.gdn_bwd_dhu_ws_kernel", pointers,
                                {"T": "i32", "scale": "fp32"}, constants, {"num_warps": 4, "maxnreg": 144})
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the warp-role bwd_dhu runs on SM90 GPUs")
def test_gpu_dhu_warp_roles_rule_by_programs():
    """From about a wave of (chain, V tile) programs of 64 columns; fewer: the Triton passes."""
    from flash_dma.ops.gated_delta_rule import launch_table
    dev = torch.device("cuda")
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    assert launch_table.dhu_warp_roles_rule(128, sm, dev)
    assert launch_table.dhu_warp_roles_rule(128, sm // 2, dev)
    assert not launch_table.dhu_warp_roles_rule(128, sm // 4, dev)
    q = torch.empty(4, 4096, 16, 128, dtype=torch.bfloat16, device=dev)
    assert plan_call(q, q, True, False, chunk_layout(4, 4096, None)).dhu_warp_roles.value is True
    q = torch.empty(1, 8192, 16, 128, dtype=torch.bfloat16, device=dev)
    assert plan_call(q, q, True, False, chunk_layout(1, 8192, None)).dhu_warp_roles.value is False
