"""The state passes with every sequence cut into segments (gdn_chunks_per_segment): outputs,
final state and every gradient equal the unsplit call and match the fp64 reference, for every
split count (segments of one chunk, a last segment shorter than a chunk), every gate, initial
and final states, fixed-length batches and varlen with long, short and empty sequences."""
import pytest
import torch

from conftest import DEVICE
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.runtime.config import Chosen, overrides

from .cases import (bound, check_dhu, check_errors, compile_for_sm90, cu_from_lengths, dhu_inputs, make_inputs, run_op,
                    run_reference)

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


# ---------------------------------------------------------------------------------------------
# Decayed segments (segments.py): transitions dropped where the gates provably decay them away

def _reach_spy(monkeypatch):
    """The reaches the cut state passes found inline, as (forward reach, backward reach) pairs
    (a list, filled as they run): the forward's from segment_reach (the state pass keeps no
    array of it), checked against its effect (a decayed segment's transition is stored zero),
    and the backward's as the local pass stored it, checked against
    segment_reach's."""
    from flash_dma.ops.gated_delta_rule.segments import segment_reach
    from flash_dma.ops.gated_delta_rule.triton import state_pass
    seen = []

    def spy(plan, seg, run, HV, K, V, initial_state, decay_bound=None):
        starts, transition, final, reach_back = real(plan, seg, run, HV, K, V, initial_state, decay_bound)
        if decay_bound is not None:
            reach = segment_reach(decay_bound, seg)
            zero = (transition == 0).flatten(2).all(-1)
            assert zero[reach >= 0].all(), (zero, reach)
            want_back = segment_reach(decay_bound, seg, reverse=True)
            if plan.dhu_chunks_per_segment.value == seg.chunks_per_segment:
                assert reach_back is not None and torch.equal(reach_back, want_back), (reach_back, want_back)
            else:
                assert reach_back is None  # it serves only a bwd_dhu cut alike
            seen.append((reach, want_back))
        return starts, transition, final, reach_back
    real = state_pass._join
    monkeypatch.setattr(state_pass, "_join", spy)
    return seen


@pytest.mark.parametrize("lengths", [None, [70, 0, 1, 64, 400]], ids=["fixed", "varlen"])
def test_decayed_segments_equal_unsplit_and_reference(monkeypatch, lengths):
    """Strong decays (about e^-110 a chunk): every segment of two chunks runs its local pass
    from its last chunk with no transition; outputs, final states and gradients still equal the
    unsplit call and the fp64 reference. Keys of norm about 4 (|1 - beta |k|^2| up to 15 a
    token) outgrow the same decays: no segment is dropped there."""
    dtype = torch.float32
    B, T = (1, sum(lengths)) if lengths else (2, 300)
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    for normalize_k, dropped in ((True, True), (False, False)):
        torch.manual_seed(3)
        inputs = make_inputs(B, T, 1, 2, 16, 16, dtype, "g", True, n_seqs=None if lengths is None else len(lengths),
                             normalize_k=normalize_k, shifts=(-1.5, 5.0))
        cotangents = [torch.randn(B, T, 2, 16, device=DEVICE, dtype=dtype), torch.randn_like(inputs["initial_state"])]
        with overrides(gdn_chunks_per_segment=0):
            unsplit = _results(inputs, cotangents, True, **kwargs)
        reference = _results(inputs, cotangents, True, reference=True, **kwargs)
        seen = _reach_spy(monkeypatch)
        with overrides(gdn_chunks_per_segment=2):
            split = _results(inputs, cotangents, True, **kwargs)
        monkeypatch.undo()
        assert len(seen) == 1, "the cut forward found no reach"
        reach, reach_back = seen[0]
        if dropped:  # forward: from the last chunk; backward: the first chunk alone
            assert (reach >= 0).any() and not (reach > 1).any(), reach
            assert (reach_back == 1).any() and ((reach_back == 1) | (reach_back == -1)).all(), reach_back
        else:
            assert (reach == -1).all() and (reach_back == -1).all(), (reach, reach_back)
        check_errors({k: (split[k], reference[k]) for k in split}, dtype)
        check_errors({k: (split[k], unsplit[k].double()) for k in split}, dtype)


def test_state_pass_finds_the_reach_itself():
    """The cut state pass finds each segment's reach inline from the bounds it is given: with
    made-up bounds that call every segment of two chunks decayed (the gates are mild, so the
    transitions are far from zero), those transitions are stored zero, and the backward's reach
    stored beside them is segment_reach's."""
    from flash_dma.ops.gated_delta_rule.autograd import _prepare
    from flash_dma.ops.gated_delta_rule.segments import segment_reach, segments_of
    from flash_dma.ops.gated_delta_rule.triton import state_pass
    torch.manual_seed(5)
    dtype = torch.float32
    x = make_inputs(1, 64 * 4 + 9, 1, 2, 16, 16, dtype, "g", False)  # segments of 2, 2 and 1 chunks
    layout = chunk_layout(1, x["q"].shape[1], None)
    with overrides(gdn_chunks_per_segment=2):
        plan = plan_call(x["q"], x["v"], True, False, layout)
        g_cum, _, _, _, ai, _, _, _ = _prepare(plan, layout, x["q"], x["k"], x["v"], x["beta"], x["g"], None,
                                               16 ** -0.5)
        seg = segments_of(1, layout.seq_len, None, 2, x["q"].device)
        # per chunk -50, -100, ...: two chunks are below NEGLIGIBLE_LOG_GAIN, the lone last one not
        bound = torch.tensor([-50.0, -100.0] * 3, device=DEVICE)[:layout.num_chunk_states, None].repeat(1, 2)
        args = (plan, layout, x["k"], x["v"], x["beta"], ai, g_cum, None, 2)
        _, _, transition, _, _ = state_pass.segment_starts(*args)
        _, _, dropped, _, reach_back = state_pass.segment_starts(*args, bound)
    decayed = segment_reach(bound, seg) >= 0
    assert decayed[:2].all() and not decayed[2].any()
    assert (transition[:2].abs().amax((-1, -2)) > 1e-3).all()
    assert (dropped[decayed] == 0).all() and torch.equal(dropped[2], transition[2])
    assert torch.equal(reach_back, segment_reach(bound, seg, reverse=True))


def test_segment_reach_finds_the_latest_decayed_chunk():
    """segment_reach_kernel against the rule it implements, on made-up chunk bounds: -1 where a
    segment's whole bound is not below NEGLIGIBLE_LOG_GAIN, else the latest chunk whose bound to
    the segment's end is (a growth in the middle can push an earlier chunk back above it), and
    for the backward the fewest leading chunks whose bound is."""
    from flash_dma.ops.gated_delta_rule.segments import NEGLIGIBLE_LOG_GAIN, segment_layout, segment_reach
    lengths = [64 * 7, 64 * 3 + 5, 0, 1]
    cu = cu_from_lengths(lengths)
    seg = segment_layout(1, sum(lengths), cu, 3, torch.device(DEVICE))
    torch.manual_seed(4)
    chunks = sum(-(-n // 64) for n in lengths)
    decay_bound = torch.randn(chunks, 3, device=DEVICE) * 60 - 30
    got = segment_reach(decay_bound, seg).cpu()
    got_back = segment_reach(decay_bound, seg, reverse=True).cpu()
    seg_cu, offsets = seg.cu_seqlens.cpu().tolist(), seg.chunk_offsets.cpu().tolist()
    b = decay_bound.cpu().double()
    for slot in range(seg.num_slots):
        n = -(-(seg_cu[slot + 1] - seg_cu[slot]) // 64)
        for hv in range(3):
            rows = b[offsets[slot]:offsets[slot] + n, hv] if n else b[:0, hv]
            want = want_back = -1
            if n and sum(rows.tolist()) < NEGLIGIBLE_LOG_GAIN:
                want = max(j for j in range(n) if float(rows[j:].sum()) < NEGLIGIBLE_LOG_GAIN)
                want_back = min(j + 1 for j in range(n) if float(rows[:j + 1].sum()) < NEGLIGIBLE_LOG_GAIN)
            assert int(got[slot, hv]) == want, (slot, hv, rows.tolist())
            assert int(got_back[slot, hv]) == want_back, (slot, hv, rows.tolist())
    assert (got >= 0).any() and (got == -1).any()  # the draw exercises both
    assert (got_back > 0).any() and ((got_back > 0) != (got >= 0)).sum() == 0


@pytest.mark.parametrize("kernel", ["reach", "reach-back", "prepare", "local", "transition", "dhu-local"])
def test_decayed_segment_kernels_compile_for_sm90(kernel):
    """What the interpreter lets pass (globals, a runtime loop start) compiles for sm_90a: the
    reach kernel, prepare storing the bounds, the state pass's local and transition runs from
    the reach, bwd_dhu's local pass from its reach."""
    seg = {"seg_cu": "*i32", "seg_chunk_offsets": "*i32"}
    if kernel.startswith("reach"):
        args = ("segments.segment_reach_kernel", {"decay_bound": "*fp32", **seg, "reach": "*i32"}, {},
                {"HV": 4, "BLOCK": 64, "REVERSE": kernel == "reach-back"})
    elif kernel == "dhu-local":
        pointers = {n: "*bf16" for n in ("q", "k", "w", "beta", "do", "dv")}
        pointers.update({"g_cum": "*fp32", "gk_cum": "*fp32", "dht": "*fp32", "dh": "*bf16", "dh0": "*fp32",
                         "dv2": "*bf16", "reach": "*i32", "cu_seqlens": "*i32", "chunk_offsets": "*i32"})
        args = ("triton.bwd_dhu.gdn_bwd_dhu_kernel", pointers, {"T": "i32", "scale": "fp32"},
                {"HQ": 2, "HV": 4, "K": 128, "V": 128, "BK": 128, "BV": 64, "HAS_G": True, "HAS_GK": False,
                 "HAS_DHT": False, "STORE_DH0": True, "IS_VARLEN": True, "STORE_STATES": False,
                 "USE_REACH": True})
    elif kernel == "prepare":
        pointers = {n: "*bf16" for n in ("k", "v", "beta")}
        pointers.update({"g": "*fp32", "g_cum": "*fp32", "gk_cum": "*fp32", "w": "*bf16", "u": "*bf16",
                         "ai": "*bf16", "a_raw": "*fp32", "decay_bound": "*fp32", "chunk_map": "*i32",
                         "cu_seqlens": "*i32"})
        args = ("triton.wy_prepare.gdn_prepare_kernel", pointers, {"T": "i32"},
                {"H": 2, "HV": 4, "K": 128, "V": 128, "BK": 64, "BV": 64, "HAS_G": True, "HAS_GK": False,
                 "IS_VARLEN": False, "STORE_WU": False, "INVERSE_PRECISION": "ieee", "STORE_BOUND": True})
    else:
        pointers = {n: "*bf16" for n in ("k", "w", "u", "v", "beta", "ai")}
        pointers.update({"g_cum": "*fp32", "gk_cum": "*fp32", "h0": "*fp32", "h": "*bf16", "v_new": "*bf16",
                         "ht": "*fp32", "decay_bound": "*fp32", "reach_back": "*i32", "cu_seqlens": "*i32",
                         "chunk_offsets": "*i32"})
        args = ("triton.state_pass.gdn_fwd_h_kernel", pointers, {"T": "i32"},
                {"H": 2, "HV": 4, "K": 128, "V": 128, "BK": 128, "BV": 64, "HAS_G": True, "HAS_GK": False,
                 "HAS_H0": False, "STORE_HT": True, "WU_FROM_T": True, "IS_VARLEN": True, "STORE_STATES": False,
                 "CONSTANT_TERMS": kernel == "local", "H0_IDENTITY": kernel == "transition", "USE_REACH": True,
                 "REACH_BLOCK": 64, "STORE_REACH_BACK": kernel == "local"})
    name, pointers, scalars, constants = args
    compiled = compile_for_sm90(f"flash_dma.ops.gated_delta_rule.{name}", pointers, scalars, constants,
                                {"num_warps": 4}, gluon=False)
    assert compiled["cubin"]


def test_decay_reach_plan():
    """On wherever a cut has a scalar gate and no gk; forcing it elsewhere is an error."""
    q = torch.zeros(1, 256, 1, 16, device=DEVICE)
    layout = chunk_layout(1, 256, None)
    with overrides(gdn_chunks_per_segment=2):
        assert plan_call(q, q, True, False, layout).decay_reach.value is True
        assert plan_call(q, q, False, False, layout).decay_reach.value is False
        assert plan_call(q, q, True, True, layout).decay_reach.value is False
        with overrides(gdn_decay_reach=False):
            assert plan_call(q, q, True, False, layout).decay_reach == Chosen(False, "override")
    assert plan_call(q, q, True, False, layout).decay_reach.value is False  # not cut
    with overrides(gdn_decay_reach=True), pytest.raises(ValueError, match="gdn_decay_reach"):
        plan_call(q, q, True, False, layout)


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


def test_rule_cuts_bwd_dhu_alike_only_where_decayed_segments_shorten_it(monkeypatch):
    """plan._segments and _dhu_cut_alike on a 132-SM GPU (faked): bwd_dhu takes the forward's
    rule cut for sequences of 512 chunks and more with a scalar gate and no gk, unless decayed
    segments are turned off; an override cuts both."""
    from types import SimpleNamespace
    from flash_dma.ops.gated_delta_rule import launch_table
    from flash_dma.ops.gated_delta_rule.plan import _decay_reach, _dhu_cut_alike, _segments
    monkeypatch.setattr(launch_table, "device_info", lambda device: SimpleNamespace(sm_count=132))
    monkeypatch.setattr(launch_table, "interpreter_active", lambda: False)
    cuda = torch.device("cuda")
    per = launch_table.SEGMENT_CHUNKS

    def cut(T, has_g=True, has_gk=False, **over):
        with overrides(**over):
            fwd, dhu = _segments(1, T, 16, 1, False, cuda)
            dhu = _dhu_cut_alike(fwd, dhu, _decay_reach(has_g, has_gk, fwd.value), T, False, 1)
        return fwd.value, dhu.value
    assert cut(32768) == (per, per)
    assert cut(16384) == (per, None)  # long enough to cut the forward, not bwd_dhu
    assert cut(32768, has_gk=True) == (per, None)
    assert cut(32768, has_g=False) == (per, None)
    assert cut(32768, gdn_decay_reach=False) == (per, None)
    assert cut(8192, gdn_chunks_per_segment=4) == (4, 4)


def test_context_parallel_plan_always_cuts_and_carries_its_joins():
    """plan_context_parallel: both passes cut (segments of SEGMENT_CHUNKS, an override's count,
    or with 0 one segment per sequence), the given joins in the plan, the cached base untouched."""
    from flash_dma.ops.gated_delta_rule import launch_table
    from flash_dma.ops.gated_delta_rule.plan import plan_context_parallel
    q = torch.zeros(1, 640, 1, 16, device=DEVICE)
    cu = torch.tensor([0, 100, 640], dtype=torch.int32, device=DEVICE)
    layout = chunk_layout(1, 640, cu)

    def fwd(*a, transposed=False):
        return "fwd"

    def bwd(*a, transposed=False):
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
    # the widest head dims, and K != V: the segment passes' transitions are [K, K]
    "B2-T2048-H4-K256-g": (2, 2048, 4, 256, 256, "g", True, None),
    "B1-T3000-H4-K64-V256-g": (1, 3000, 4, 64, 256, "g", True, None),
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


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [2.0, -1.0], ids=["bench-decay", "strong-decay"])
def test_gpu_rule_cut_with_decayed_segments_equals_unsplit(monkeypatch, shift):
    """One long sequence cut by the rule, bf16, at the benchmark's decays (about e^-10 a chunk)
    and stronger: its decayed segments drop their transitions, and every result still equals the
    unsplit call."""
    B, T, H, K = 1, 32768, 16, 128
    dtype = torch.bfloat16
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, H, K, K, dtype, "g", True, shifts=(shift, 5.0))
    cotangents = [torch.randn(B, T, H, K, device=DEVICE, dtype=dtype), torch.randn_like(inputs["initial_state"])]
    with overrides(gdn_chunks_per_segment=0):
        unsplit = _results(inputs, cotangents, True)
    seen = _reach_spy(monkeypatch)
    split = _results(inputs, cotangents, True)
    assert seen and (seen[0][0] >= 0).any(), "the rule's cut dropped no transition"
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


@pytest.mark.parametrize("chunks_per_segment", [1, 3])
@pytest.mark.parametrize("lengths", [None, [70, 0, 1, 200]], ids=["batch", "varlen"])
def test_segment_end_gradients_are_the_uncut_pass_states(lengths, chunks_per_segment):
    """bwd_dhu's local pass and reverse join alone (triton/bwd_dhu.segment_end_gradients, which
    the warp-role backward runs each segment from): the state gradient at each segment's end is
    the uncut pass's at that chunk, and dh0 is its dh0."""
    from flash_dma.ops.gated_delta_rule.autograd import _prepare
    from flash_dma.ops.gated_delta_rule.triton.bwd_dhu import bwd_dhu, segment_end_gradients

    torch.manual_seed(0)
    dtype = torch.float32
    B, T = (2, 200) if lengths is None else (1, sum(lengths))
    x = make_inputs(B, T, 1, 2, 16, 16, dtype, "g", True, n_seqs=None if lengths is None else len(lengths))
    cu = None if lengths is None else cu_from_lengths(lengths)
    layout = chunk_layout(B, T, cu)
    scale = 16 ** -0.5
    do = torch.randn_like(x["v"])
    dht = torch.randn_like(x["initial_state"])
    whole = plan_call(x["q"], x["v"], True, False, layout)
    g_cum, _, _, _, ai, _, _, _ = _prepare(whole, layout, x["q"], x["k"], x["v"], x["beta"], x["g"], None, scale)
    with overrides(gdn_chunks_per_segment=0):
        dh, dh0, _ = bwd_dhu(plan_call(x["q"], x["v"], True, False, layout), layout, x["q"], x["k"], None, do, None,
                             g_cum, None, dht, True, scale, local_dv_dtype=dtype, inverse=(ai, x["beta"]))
    with overrides(gdn_chunks_per_segment=chunks_per_segment):
        cut = plan_call(x["q"], x["v"], True, False, layout)
        seg, ends, cut_dh0 = segment_end_gradients(cut, layout, x["q"], x["k"], do, g_cum, (ai, x["beta"]), dht, scale)
    tokens = (seg.cu_seqlens[1:] - seg.cu_seqlens[:-1]).tolist()
    first = seg.chunk_offsets.tolist()
    used = [s for s in range(seg.num_slots) if tokens[s] > 0]
    assert used
    last_chunk = torch.tensor([first[s] + (tokens[s] + 63) // 64 - 1 for s in used], device=DEVICE)
    check_errors({"segment ends": (ends[used], dh[last_chunk].double()), "dh0": (cut_dh0, dh0.double())}, dtype)
