"""The state passes with every sequence cut into segments (gdn_chunks_per_segment): outputs,
final state and every gradient equal the unsplit call and match the fp64 reference, for every
split count (segments of one chunk, a last segment shorter than a chunk), every gate, initial
and final states, fixed-length batches and varlen with long, short and empty sequences."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.runtime.config import overrides

from .cases import bound, check_dhu, check_errors, cu_from_lengths, dhu_inputs, make_inputs, run_op, run_reference

CASES = {  # name: (B, T, H, HV, K, V, gate, states, dtype, varlen lengths or None, extra overrides, split counts)
    # Split counts: 1, segments of one chunk; 3, a last segment shorter than a chunk (where a
    # sequence has more than three chunks). The interpreter is slow (a per-key gate triples the
    # cost): features share cases, and the GPU runs every case at more split counts.
    "g-h0-gva-K!=V-fp32": (2, 200, 1, 2, 16, 32, "g", True, torch.float32, None, {}, (1, 3)),
    "gk-fp16": (1, 130, 1, 1, 16, 16, "gk", True, torch.float16, None, {}, (1,)),
    "g+gk-gva-fp32": (1, 200, 1, 2, 16, 16, "g+gk", True, torch.float32, None, {}, (3,)),
    "no-gate-no-states-fp16": (1, 130, 1, 1, 16, 16, "none", False, torch.float16, None, {}, (1, 3)),
    # long, exactly-one-chunk, single-token and empty sequences
    "varlen-g+gk-fp32": (1, 328, 1, 1, 16, 16, "g+gk", True, torch.float32, [70, 0, 1, 64, 193], {}, (1, 3)),
    # the state passes reading w and u of the recompute kernel instead of forming them from T
    "K64-wu-recomputed-fp16": (1, 140, 1, 1, 64, 64, "g", True, torch.float16, None,
                               {"gdn_states_from_inverse": False, "gdn_backward_states_from_inverse": False},
                               (1,)),
}
_UNSPLIT: dict = {}


def _grads(outputs, leaves, cotangents, names):
    got = torch.autograd.grad(outputs, list(leaves.values()), cotangents)
    return {names.get(n, "d" + n): g for n, g in zip(leaves, got)}


def _results(inputs, cotangents, states, reference=False, **kwargs):
    """{name: tensor} of o, the final state and every gradient, of the op or the reference."""
    run = run_reference if reference else run_op
    leaves, o, final = run(inputs, output_final_state=states, **kwargs)
    outputs = [o] + ([final] if states else [])
    cots = [c.double() for c in cotangents] if reference else cotangents
    out = {"o": o, **({"final_state": final} if states else {})}
    out.update(_grads(outputs, leaves, cots[:len(outputs)], {"initial_state": "dh0"}))
    return out


def _case(name):
    """Inputs, cotangents, the unsplit op's results and the reference's (once per case)."""
    if name not in _UNSPLIT:
        B, T, H, HV, K, V, gate, states, dtype, lengths, extra, _ = CASES[name]
        torch.manual_seed(0)
        n_seqs = None if lengths is None else len(lengths)
        inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states, n_seqs=n_seqs)
        kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
        cotangents = [torch.randn(B, T, HV, V, device=DEVICE, dtype=dtype)]
        if states:
            cotangents.append(torch.randn_like(inputs["initial_state"]))
        with overrides(**extra):
            unsplit = _results(inputs, cotangents, states, **kwargs)
        reference = _results(inputs, cotangents, states, reference=True, **kwargs)
        _UNSPLIT[name] = (inputs, cotangents, kwargs, unsplit, reference)
    return _UNSPLIT[name]


# under pytest-xdist (--dist loadgroup) a case's split counts share one worker: _case runs once
@pytest.mark.parametrize("name, chunks_per_segment", [
    pytest.param(name, per, marks=pytest.mark.xdist_group(f"segments-{name}"), id=f"{name}-{per}")
    for name, case in CASES.items() for per in case[-1]])
def test_split_equals_unsplit_and_reference(name, chunks_per_segment):
    states, dtype, extra = CASES[name][7], CASES[name][8], CASES[name][10]
    inputs, cotangents, kwargs, unsplit, reference = _case(name)
    with overrides(gdn_chunks_per_segment=chunks_per_segment, **extra):
        split = _results(inputs, cotangents, states, **kwargs)
    assert split.keys() == unsplit.keys()
    for key in split:
        assert split[key].dtype == unsplit[key].dtype, key
    check_errors({k: (split[k], reference[k]) for k in split}, dtype)
    # split against unsplit: the same bound as against fp64 (both round the same way)
    check_errors({k: (split[k], unsplit[k].double()) for k in split}, dtype)


@pytest.mark.parametrize("chunks_per_segment", [1, 2])
@pytest.mark.parametrize("mode,varlen", [("A", False), ("B", False), ("E+states", False), ("E+states", True)])
def test_public_bwd_dhu_split(mode, varlen, chunks_per_segment):
    """The public state-gradient pass takes the same split, dht in and dh0 out."""
    torch.manual_seed(1)
    lengths = [150, 0, 1, 70]
    cu = cu_from_lengths(lengths) if varlen else None
    B, T = (1, sum(lengths)) if varlen else (2, 150)
    x = dhu_inputs(B, T, 1, 2, 16, 16, torch.float32, mode, cu)
    with overrides(gdn_chunks_per_segment=chunks_per_segment):
        check_dhu(x, torch.float32, None, cu)


@pytest.mark.parametrize("value", [-1, -2, 2.0, True, "4"])  # 0 means whole (test_zero_forces_whole)
def test_bad_chunks_per_segment(value):
    q = torch.zeros(1, 64, 1, 16, device=DEVICE)
    with overrides(gdn_chunks_per_segment=value), pytest.raises(ValueError, match="gdn_chunks_per_segment"):
        plan_call(q, q, True, False, chunk_layout(1, 64, None))


def test_zero_forces_whole():
    q = torch.zeros(1, 64, 1, 16, device=DEVICE)
    with overrides(gdn_chunks_per_segment=0):
        plan = plan_call(q, q, True, False, chunk_layout(1, 64, None))
    assert plan.chunks_per_segment == plan.dhu_chunks_per_segment
    assert (plan.chunks_per_segment.value, plan.chunks_per_segment.source) == (None, "override")


def test_plan_default_is_unsplit():
    q = torch.zeros(1, 64, 1, 16, device=DEVICE)
    plan = plan_call(q, q, True, False, chunk_layout(1, 64, None))
    assert plan.chunks_per_segment.value is None
    with overrides(gdn_chunks_per_segment=4):
        assert plan_call(q, q, True, False, chunk_layout(1, 64, None)).chunks_per_segment.value == 4


def test_rule_cuts_long_sequences_with_few_chains_fixed_or_packed(monkeypatch):
    """launch_table.forward_segments on a 132-SM GPU (faked): one long sequence is cut, fixed or
    packed (packed ones go by their mean length); short ones and many chains are not."""
    from types import SimpleNamespace
    from flash_dma.ops.gated_delta_rule import launch_table
    monkeypatch.setattr(launch_table, "device_info", lambda device: SimpleNamespace(sm_count=132))
    monkeypatch.setattr(launch_table, "interpreter_active", lambda: False)
    cuda = torch.device("cuda")
    rule = launch_table.forward_segments
    assert rule(16, 32768, False, cuda) == launch_table.SEGMENT_CHUNKS
    assert rule(16, 32768, True, cuda, num_seqs=1) == launch_table.SEGMENT_CHUNKS
    assert rule(16, 8192, False, cuda) is None  # too short
    assert rule(2 * 16, 2 * 8192, True, cuda, num_seqs=2) is None  # mean length too short
    assert rule(20 * 16, 20 * 32768, True, cuda, num_seqs=20) is None  # chains fill the GPU
    assert rule(16, 32768, False, torch.device("cpu")) is None


def test_context_parallel_plan_always_cuts_and_carries_its_joins():
    """plan_context_parallel: both passes cut (segments of SEGMENT_CHUNKS, an override's count,
    or with 0 one segment per sequence), the given joins in the plan, the cached base untouched."""
    from flash_dma.ops.gated_delta_rule import launch_table
    from flash_dma.ops.gated_delta_rule.plan import plan_context_parallel
    q = torch.zeros(1, 640, 1, 16, device=DEVICE)
    cu = torch.tensor([0, 100, 640], dtype=torch.int32, device=DEVICE)
    layout = chunk_layout(1, 640, cu)

    def fwd(*a):
        return "fwd"

    def bwd(*a):
        return "bwd"
    plan = plan_context_parallel(q, q, True, False, layout, fwd, bwd)
    assert plan.chunks_per_segment.value == plan.dhu_chunks_per_segment.value == launch_table.SEGMENT_CHUNKS
    assert plan.forward_join is fwd and plan.backward_join is bwd
    assert plan.join(None, None, None, None) == "fwd" and plan.join(None, None, None, None, reverse=True) == "bwd"
    again = plan_context_parallel(q, q, True, False, layout, None, None)
    assert again.forward_join is None and again.backward_join is None
    with overrides(gdn_chunks_per_segment=2):
        assert plan_context_parallel(q, q, True, False, layout, fwd, bwd).chunks_per_segment.value == 2
    with overrides(gdn_chunks_per_segment=0):
        assert plan_context_parallel(q, q, True, False, layout, fwd, bwd).chunks_per_segment.value == 10


# ---------------------------------------------------------------------------------------------
# GPU, real size

GPU_CASES = {  # name: (B, T, H, K, V, gate, states, varlen lengths or None)
    "B1-T8192-H16-g": (1, 8192, 16, 128, 128, "g", True, None),
    "B1-T8192-H16-g+gk": (1, 8192, 16, 128, 128, "g+gk", True, None),
    "B1-T8192-H16-none": (1, 8192, 16, 128, 128, "none", False, None),
    "varlen-T8192-H16-g": (1, 8192, 16, 128, 128, "g", True, [5000, 1, 0, 64, 1000, 2127]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("chunks_per_segment", [1, 4, 16])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_split_equals_unsplit(name, chunks_per_segment):
    B, T, H, K, V, gate, states, lengths = GPU_CASES[name]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    n_seqs = None if lengths is None else len(lengths)
    inputs = make_inputs(B, T, H, H, K, V, dtype, gate, states, n_seqs=n_seqs)
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    cotangents = [torch.randn(B, T, H, V, device=DEVICE, dtype=dtype)]
    if states:
        cotangents.append(torch.randn_like(inputs["initial_state"]))
    unsplit = _results(inputs, cotangents, states, **kwargs)
    with overrides(gdn_chunks_per_segment=chunks_per_segment):
        split = _results(inputs, cotangents, states, **kwargs)
    errors = check_errors({k: (split[k], unsplit[k].double()) for k in split}, dtype)
    assert all(e <= bound(k, dtype) for k, e in errors.items())


def test_profile_log_names_the_split(monkeypatch, caplog):
    import logging

    from flash_dma.runtime import profile
    monkeypatch.setenv("FLASH_DMA_PROFILE", "1")
    profile.refresh()
    try:
        inputs = make_inputs(1, 40, 1, 1, 16, 16, torch.float16, "g", False)
        with caplog.at_level(logging.INFO, logger="flash_dma"):
            run_op(inputs, leaves_wanted=False)
            with overrides(gdn_chunks_per_segment=2):
                run_op(inputs, leaves_wanted=False)
    finally:
        monkeypatch.delenv("FLASH_DMA_PROFILE")
        profile.refresh()
    lines = [r.getMessage() for r in caplog.records if r.name == "flash_dma" and "pass=fwd_h.segments" in r.getMessage()]
    assert any("choice=unsplit" in line for line in lines), lines
    assert any("choice=chunks_per_segment=2" in line and "source=override" in line for line in lines), lines
