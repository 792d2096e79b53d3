"""The fused SM90 forward (gluon/: state pass and output in one kernel, with warp roles or in one
role): output, final state and every gradient against the fp64 reference, every form, whole and cut
into segments (of one chunk; a last segment shorter than a chunk), fixed lengths and varlen
with empty and single-token sequences, GQA, K != V, no gate; and the rule that picks it."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule import launch_table
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides

from .cases import (
    FUSED_CASES, ON_SM90, assert_mma_not_serialised, check_against_reference, compile_for_sm90, cu_from_lengths,
    make_inputs, poison_allocator
)

CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None)
    **FUSED_CASES,
    "varlen-V256-gqa": (1, 777, 1, 2, 128, 256, "g", False, torch.bfloat16, [128, 1, 648]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused forward runs on SM90 GPUs")
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("form", ["ws", 64, 128])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_fused_forward(name, form, split):
    chosen = {"gdn_fused_forward": form}
    if split is not None:
        chosen["gdn_chunks_per_segment"] = split
    _check_case(name, 64 if form == "ws" else form, chosen,
                lambda plan: plan.fused_forward.value == form and plan.segment_chunks() == split)


def _check_case(name, tile, chosen, planned):
    """CASES[name] under the overrides `chosen`, every output and gradient against fp64 (skipped
    where V is not a multiple of the kernel's tile); planned(plan): the plan took them."""
    B, T, H, HV, K, V, gate, states, dtype, lengths = CASES[name]
    if V % tile:
        pytest.skip(f"V {V} is not a multiple of the tile of {tile}")
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    with overrides(**chosen):
        plan = plan_call(inputs["q"], inputs["v"], gate != "none", False, chunk_layout(B, T, kwargs.get("cu_seqlens")))
        assert planned(plan)
        poison_allocator(B * T * HV * V, dtype)
        check_against_reference(inputs, dtype, **kwargs)


def test_fused_forward_rule():
    """Picked only on an SM90 GPU for what the kernel computes, where enough programs run; a
    forced tile the call cannot take is an error naming the choice."""
    cpu = torch.device("cpu")
    assert launch_table.fused_forward_tile(128, 128, 1024, torch.bfloat16, False, cpu) is None
    assert not launch_table.fused_forward_fits(128, 128, torch.bfloat16, False, cpu)
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16)
    layout = chunk_layout(1, 128, None)
    if not ON_SM90:
        with overrides(gdn_fused_forward=64), pytest.raises(ValueError, match="gdn_fused_forward=64"):
            plan_call(q, q, True, False, layout)
    with overrides(gdn_fused_forward=0):
        assert plan_call(q, q, True, False, layout).fused_forward.value is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused forward runs on SM90 GPUs")
def test_gpu_fused_forward_rule_by_programs():
    """Few (chain, V tile) programs: the Triton passes; about a wave: warp roles; more: the
    one-role kernel with 128-wide tiles; never with gk, fp32 or K = 256."""
    dev = torch.device(DEVICE)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    tile = launch_table.fused_forward_tile
    assert tile(128, 128, 4, torch.bfloat16, False, dev) is None
    assert tile(128, 128, sm // 4, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, sm // 2, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, sm, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, 2 * sm, torch.bfloat16, False, dev) == 128
    assert tile(128, 128, 4 * sm, torch.bfloat16, False, dev, varlen=True) == "ws"  # packed: warp roles
    assert tile(128, 192, 2 * sm, torch.bfloat16, False, dev) == 64
    assert tile(128, 128, 2 * sm, torch.bfloat16, True, dev) is None
    assert tile(128, 128, 2 * sm, torch.float32, False, dev) is None
    assert tile(256, 128, 2 * sm, torch.bfloat16, False, dev) is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused recompute runs on SM90 GPUs")
@pytest.mark.parametrize("split", [None, 1, 3])
@pytest.mark.parametrize("form", [64, 128])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_fused_recompute(name, form, split):
    """The backward's states, v_new and intra-chunk dv from the one-role kernel's recompute
    form (whole, and over segments from the forward's starts): every gradient against fp64."""
    chosen = {"gdn_fused_recompute": form}
    if split is not None:
        chosen["gdn_chunks_per_segment"] = split
    _check_case(name, form, chosen, lambda plan: (plan.fused_recompute.value == form and not plan.dhu_local_dv.value
                                                  and plan.segment_chunks() == split))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused forward runs on SM90 GPUs")
@pytest.mark.parametrize("recompute", [0, 64])
@pytest.mark.parametrize("form", ["ws", 64, 128])
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[-1] is not None])
def test_gpu_fused_kernels_take_packed_sequences_longest_first(name, form, recompute):
    """gdn_longest_first: the fused forward (and the fused recompute) map their programs to the
    packed sequences longest first; every output and gradient against fp64."""
    _check_case(name, 64 if form == "ws" else form,
                {"gdn_fused_forward": form, "gdn_fused_recompute": recompute, "gdn_longest_first": True},
                lambda plan: (plan.longest_first.value and plan.fused_forward.value == form
                              and plan.fused_recompute.value == (recompute or None)))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused recompute runs on SM90 GPUs")
def test_gpu_fused_recompute_finds_the_segments_again():
    """A cut backward given no segments (the custom op re-plans after overrides changed) finds
    the segments' starts again before its recompute: the same gradients as with the forward's."""
    from flash_dma.ops.gated_delta_rule.autograd import run_backward, run_forward
    B, T, H, HV, K, V, gate, states, dtype, lengths = CASES["g-h0-K128"]
    torch.manual_seed(0)
    x = make_inputs(B, T, H, HV, K, V, dtype, gate, states)
    with overrides(gdn_fused_recompute=64, gdn_chunks_per_segment=3):
        args = (x["q"], x["k"], x["v"], x["g"], None, x["beta"], K ** -0.5, x["initial_state"])
        o, _, g_cum, ai, segments, layout, plan = run_forward(*args, False, None)
        assert segments is not None and plan.fused_recompute.value == 64
        do = torch.randn_like(o)
        kept = run_backward(plan, layout, *args, g_cum, ai, do, None, segments)
        found = run_backward(plan, layout, *args, g_cum, ai, do, None, None)
    for a, b in zip(kept, found):
        if a is not None:
            assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)


def test_longest_first_order():
    """The packed sequences' indices by length, longest first, ties in the given order, int32,
    computed once per cu_seqlens object."""
    from flash_dma.ops.gated_delta_rule.layout import longest_first
    cu = torch.tensor([0, 3, 3, 10, 11, 18], dtype=torch.int32, device=DEVICE)  # lengths 3, 0, 7, 1, 7
    order = longest_first(cu)
    assert order.dtype == torch.int32 and order.tolist() == [2, 4, 0, 3, 1]
    assert longest_first(cu) is order


def test_fused_recompute_rule(monkeypatch):
    """Off by default (measured no faster); switched on, only where the forward runs the one-role
    kernel (its tile), T kept, on an SM90 GPU; a forced tile the call cannot take is an error
    naming the choice."""
    cpu = torch.device("cpu")
    assert launch_table.fused_recompute_tile(128, 128, 4096, torch.bfloat16, False, True, cpu) is None
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16)
    layout = chunk_layout(1, 128, None)
    if not ON_SM90:
        with overrides(gdn_fused_recompute=64), pytest.raises(ValueError, match="gdn_fused_recompute=64"):
            plan_call(q, q, True, False, layout)
    else:
        dev = torch.device(DEVICE)
        sm = torch.cuda.get_device_properties(dev).multi_processor_count
        rule = launch_table.fused_recompute_tile
        assert rule(128, 128, 4 * sm, torch.bfloat16, False, True, dev) is None
        monkeypatch.setattr(launch_table, "FUSED_RECOMPUTE_BY_DEFAULT", True)
        assert rule(128, 128, 4 * sm, torch.bfloat16, False, True, dev) == 128
        assert rule(128, 128, 4 * sm, torch.bfloat16, False, False, dev) is None  # T not kept
        assert rule(128, 128, sm, torch.bfloat16, False, True, dev) is None  # warp roles forward
    with overrides(gdn_fused_recompute=0):
        assert plan_call(q, q, True, False, layout).fused_recompute.value is None


@pytest.mark.parametrize("form, K, has_g, varlen", [(64, 128, True, False), (128, 128, True, True),
                                                   (64, 64, False, True), ("ws", 128, True, False),
                                                   ("ws", 64, False, True), ("recompute-64", 128, True, False),
                                                   ("recompute-128", 128, True, True),
                                                   ("recompute-64", 64, False, True)])
def test_fused_forward_compiles_for_sm90(form, K, has_g, varlen):
    """The Gluon kernels compile for sm_90a without a GPU (Triton's compiler and bundled ptxas):
    CI catches a kernel that no longer builds, or that outgrows shared memory, before a GPU run."""
    pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "ai": "*bf16", "g_cum": "*fp32",
                "h0": "*fp32", "o": "*bf16", "ht": "*fp32", "cu_seqlens": "*i32", "order": "*i32"}
    constants = {"HQ": 2, "HV": 4, "K": K, "V": 256, "STAGES": 2, "HAS_G": has_g, "HAS_H0": True,
                 "STORE_HT": True, "IS_VARLEN": varlen}
    gluon = "flash_dma.ops.gated_delta_rule.gluon"
    if form == "ws":
        kernel, options = f"{gluon}.forward_ws.gdn_fwd_ws_kernel", {"num_warps": 4, "maxnreg": 160}
    else:
        tile = int(str(form).split("-")[-1])
        kernel, options = f"{gluon}.forward_fused.gdn_fwd_fused_kernel", {"num_warps": tile // 16}
        # the recompute form's tensors (passed in both forms here: unread by the forward's)
        pointers.update({"do": "*bf16", "h": "*bf16", "v_new": "*bf16", "chunk_offsets": "*i32"})
        recompute = str(form).startswith("recompute")
        constants = {**constants, "BV": tile, "STORE_HT": not recompute, "RECOMPUTE": recompute}
    compiled = compile_for_sm90(kernel, pointers, {"T": "i32", "scale": "fp32"}, constants, options)
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)
