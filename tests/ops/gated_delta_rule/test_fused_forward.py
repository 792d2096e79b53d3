"""The fused SM90 forward (gluon/: state pass and output in one kernel, with warp roles or in one
role): output, final state and every gradient against the fp64 reference, every form, whole and cut
into segments (of one chunk; a last segment shorter than a chunk), fixed lengths and varlen
with empty and single-token sequences, GQA, K != V, no gate; and the rule that picks it. The same
for the warp-role forward with the per-key gate gk (gluon/forward_ws_gk.py), forced on."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule import launch_table
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides

from .cases import (
    FUSED_CASES, ON_SM90, assert_choice_refused_where_it_cannot_run, assert_mma_not_serialised,
    check_against_reference, compile_for_sm90, cu_from_lengths, make_inputs, poison_allocator
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
    """Few (chain, V tile) programs: the Triton passes; up to four a SM: warp roles; more: the
    one-role kernel with 128-wide tiles; never with gk, fp32 or K = 256."""
    dev = torch.device(DEVICE)
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    tile = launch_table.fused_forward_tile
    assert tile(128, 128, 4, torch.bfloat16, False, dev) is None
    assert tile(128, 128, sm // 4, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, sm // 2, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, sm, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, 2 * sm, torch.bfloat16, False, dev) == "ws"
    assert tile(128, 128, 4 * sm, torch.bfloat16, False, dev) == 128
    assert tile(128, 128, 4 * sm, torch.bfloat16, False, dev, varlen=True) == "ws"  # packed: warp roles
    assert tile(128, 192, 2 * sm, torch.bfloat16, False, dev) == 64
    assert tile(128, 128, 2 * sm, torch.bfloat16, True, dev) is None
    assert tile(128, 128, 2 * sm, torch.float32, False, dev) is None
    assert tile(256, 128, 2 * sm, torch.bfloat16, False, dev) is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused forward runs on SM90 GPUs")
@pytest.mark.parametrize("longest_first", [True, False])
@pytest.mark.parametrize("form", ["ws", 64, 128])
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[-1] is not None])
def test_gpu_fused_forward_takes_packed_sequences_longest_first(name, form, longest_first):
    """gdn_longest_first: the fused forward maps its programs to the packed sequences longest
    first (or as given); every output and gradient against fp64."""
    _check_case(name, 64 if form == "ws" else form, {"gdn_fused_forward": form, "gdn_longest_first": longest_first},
                lambda plan: plan.longest_first.value == longest_first and plan.fused_forward.value == form)


def test_longest_first_order():
    """The packed sequences' indices by length, longest first, ties in the given order, int32,
    computed once per cu_seqlens object."""
    from flash_dma.ops.gated_delta_rule.layout import longest_first
    cu = torch.tensor([0, 3, 3, 10, 11, 18], dtype=torch.int32, device=DEVICE)  # lengths 3, 0, 7, 1, 7
    order = longest_first(cu)
    assert order.dtype == torch.int32 and order.tolist() == [2, 4, 0, 3, 1]
    assert longest_first(cu) is order


@pytest.mark.parametrize("form, K, has_g, varlen", [(64, 128, True, False), (128, 128, True, True),
                                                   (64, 64, False, True), ("ws", 128, True, False),
                                                   ("ws", 64, False, True)])
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
        kernel, options = f"{gluon}.forward_fused.gdn_fwd_fused_kernel", {"num_warps": form // 16}
        constants = {**constants, "BV": form}
    compiled = compile_for_sm90(kernel, pointers, {"T": "i32", "scale": "fp32"}, constants, options)
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert_mma_not_serialised(compiled)


GK_CASES = {  # name: (B, T, H, HV, K, V, states, dtype, varlen lengths or None, gk's shift); gate gk alone
    "gk-h0-K128": (2, 1000, 2, 2, 128, 128, True, torch.bfloat16, None, 5.0),
    "gk-one-chunk": (1, 64, 1, 1, 128, 128, False, torch.bfloat16, None, 5.0),
    "gk-65-tokens-fp16": (1, 65, 1, 1, 128, 128, True, torch.float16, None, 5.0),
    "gk-gqa-K64-V128": (3, 333, 1, 2, 64, 128, False, torch.bfloat16, None, 5.0),
    "gk-K64-V64": (2, 200, 2, 2, 64, 64, True, torch.bfloat16, None, 5.0),
    "gk-varlen-empty-single": (1, 1000, 1, 2, 128, 128, True, torch.bfloat16, [1, 299, 0, 700], 5.0),
    # per-key decays far from 1 over a chunk: a decay applied along the wrong axis of the state shows
    "gk-strong-decays": (1, 300, 2, 2, 128, 128, True, torch.bfloat16, None, 1.0),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="the fused forward runs on SM90 GPUs")
@pytest.mark.parametrize("final_state", [True, False])
@pytest.mark.parametrize("keep_states", [False, True])
@pytest.mark.parametrize("name", list(GK_CASES))
def test_gpu_fused_forward_gk(name, keep_states, final_state, monkeypatch):
    """gdn_fused_forward_gk forced on: the kernel runs (once a call; with disable_recompute the
    forward keeps its states, so the Triton passes run instead), and every output and gradient
    matches fp64, with and without the final state."""
    from flash_dma.ops.gated_delta_rule.gluon import forward_ws_gk as module
    B, T, H, HV, K, V, states, dtype, lengths, shift = GK_CASES[name]
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, dtype, "gk", states, n_seqs=None if lengths is None else len(lengths),
                         shifts=(5.0, shift))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    if keep_states:
        kwargs["disable_recompute"] = True
    calls = []
    real = module.forward_ws_gk
    monkeypatch.setattr(module, "forward_ws_gk", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    with overrides(gdn_fused_forward_gk=True):
        plan = plan_call(inputs["q"], inputs["v"], False, True, chunk_layout(B, T, kwargs.get("cu_seqlens")))
        assert plan.fused_forward_gk.value
        poison_allocator(B * T * HV * V, dtype)
        check_against_reference(inputs, dtype, output_final_state=final_state, **kwargs)
    assert len(calls) == (0 if keep_states else 1)


def test_fused_forward_gk_choice():
    """Off by default until measured; forced where it cannot run (no SM90 GPU here, or a scalar
    gate beside gk), an error naming the choice."""
    assert launch_table.FUSED_FORWARD_GK_BY_DEFAULT is False
    assert not launch_table.fused_forward_gk_fits(128, 128, torch.bfloat16, True, True, torch.device(DEVICE))
    assert_choice_refused_where_it_cannot_run("gdn_fused_forward_gk", "fused_forward_gk")
    q = torch.empty(1, 128, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    with overrides(gdn_fused_forward_gk=True), pytest.raises(ValueError, match="gdn_fused_forward_gk=True"):
        plan_call(q, q, True, True, chunk_layout(1, 128, None))  # g beside gk


@pytest.mark.parametrize("K, varlen, h0, final", [(128, False, True, True), (64, True, False, True),
                                                  (128, True, False, True), (128, False, True, False)])
def test_fused_forward_gk_compiles_for_sm90(K, varlen, h0, final):
    """The warp-role forward with gk compiles for sm_90a without a GPU, within shared memory and
    with its warpgroup MMAs in flight (not serialised)."""
    pointers = {"q_gated": "*bf16", "k_gated": "*bf16", "w": "*bf16", "u": "*bf16", "aqk": "*bf16",
                "gk_cum": "*fp32", "o": "*bf16", "ht": "*fp32", "cu_seqlens": "*i32", "order": "*i32"}
    constants = {"HV": 4, "K": K, "V": 128, "STAGES": 2, "HAS_H0": h0, "STORE_HT": final, "IS_VARLEN": varlen}
    if h0:
        pointers["h0"] = "*fp32"
    else:
        constants["h0"] = None
    if not final:
        del pointers["ht"]
        constants["ht"] = None
    compiled = compile_for_sm90("flash_dma.ops.gated_delta_rule.gluon.forward_ws_gk.gdn_fwd_ws_gk_kernel", pointers,
                                {"T": "i32", "scale": "fp32"}, constants, {"num_warps": 4, "maxnreg": 160})
    assert compiled["cubin"], "no cubin"
    assert 0 < compiled["shared"] <= 227 * 1024, f"shared memory {compiled['shared']} B"
    assert compiled["spill_bytes"] <= 64, compiled
    assert_mma_not_serialised(compiled)

