"""Chunked gated delta rule against the fp64 reference: output, final state and every gradient,
each strategy of the plan, bad inputs."""
import pytest
import torch

from conftest import DTYPES
from helpers import TOLERANCE, rel_err
from flash_dma import chunk_gated_delta_rule
from flash_dma.ops.gated_delta_rule.reference import gated_delta_rule_reference
from flash_dma.runtime.config import overrides

from .cases import (GPU_SHAPES, SHAPES, bound, check_against_reference, check_errors, cu_from_lengths, make_inputs,
                    run_op)


# ---------------------------------------------------------------------------------------------
# the op against the reference

@pytest.mark.parametrize("shape", list(SHAPES))
def test_against_reference(shape):
    B, T, H, HV, K, V, gate, states = SHAPES[shape]
    dtype = DTYPES[-1]
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states)
    check_against_reference(inputs, dtype, output_final_state=states)


@pytest.mark.parametrize("from_inverse", [True, False], ids=["wu-from-T", "wu-recomputed"])
@pytest.mark.parametrize("shape", [s for s in SHAPES if "kept-T" in s])
def test_both_ways_of_forming_w_and_u(shape, from_inverse):
    """Where T is kept, the state passes (forward, and the backward's recompute) form w and u from
    it, or a kernel writes them first (in the backward w only, then): both must match the
    reference whichever the launch rule picks on this machine."""
    B, T, H, HV, K, V, gate, states = SHAPES[shape]
    dtype = DTYPES[-1]
    with overrides(gdn_states_from_inverse=from_inverse, gdn_backward_states_from_inverse=from_inverse):
        check_against_reference(make_inputs(B, T, H, HV, K, V, dtype, gate, states), dtype,
                                output_final_state=states)


@pytest.mark.parametrize("shape", [s for s in SHAPES if "kept-T" in s])
def test_unsplit_prepare(shape):
    """Where T is kept, prepare may also write w and u itself (gdn_split_prepare=False)."""
    B, T, H, HV, K, V, gate, states = SHAPES[shape]
    dtype = DTYPES[-1]
    with overrides(gdn_split_prepare=False):
        check_against_reference(make_inputs(B, T, H, HV, K, V, dtype, gate, states), dtype,
                                output_final_state=states)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype(dtype):
    inputs = make_inputs(1, 67, 1, 1, 16, 16, dtype, "g", True)
    check_against_reference(inputs, dtype)


def test_fp32_inputs():
    dtype = torch.float32
    inputs = make_inputs(1, 67, 1, 1, 16, 16, dtype, "g+gk", True)
    inputs["beta"] = inputs["beta"].float()
    check_against_reference(inputs, dtype)


@pytest.mark.parametrize("local_dv", [True, False], ids=["dhu-forms-dv", "dv-pass"])
def test_strong_scalar_decay_with_a_short_last_chunk(local_dv):
    """A scalar log decay of about -1.8 a token (a chunk's cumsum near -115) and a last chunk of
    44 rows: rows past its end must not raise e^(-B_j) (inf, then NaN in their zero products:
    once in the local dv pass and in the backward's pair products on the GPU)."""
    dtype = torch.float32
    torch.manual_seed(3)
    inputs = make_inputs(2, 300, 1, 2, 16, 16, dtype, "g", True, shifts=(-1.5, 5.0))
    with overrides(gdn_dhu_local_dv=local_dv):
        check_against_reference(inputs, dtype)


# per-token log decays on half the key channels: the whole-chunk products near their limit (a
# chunk's range up to about 115 of 120), the 16-row blocks factorised, the blocks' exact per-row form
STRONG_DECAYS = {"whole-chunk-near-limit": (1.3, 1.8), "blocks": (2.5, 4.0), "blocks-exact-rows": (12.0, 20.0)}


def blocks_flags(monkeypatch, inputs, **kwargs):
    """Runs the op against the reference (after a first call: its compile-ahead dry run, where
    one runs, launches nothing) and returns the needs_blocks flags of the whole-chunk kernels,
    {"forward": [B * HV, chunk slots], "backward": [B * HV, chunk slots, K tiles]} (bool)."""
    from flash_dma.ops.gated_delta_rule.triton import gate_pairs
    run_op(inputs, **kwargs)
    flags, real = {}, gate_pairs.launch
    whole_chunk = {gate_pairs.gdn_gated_pairs_kernel: "forward", gate_pairs.gdn_gated_pair_grad_kernel: "backward"}

    def spy(kernel, grid, *args, **launch_kwargs):
        real(kernel, grid, *args, **launch_kwargs)
        if kernel in whole_chunk:
            needs = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int8)
            flags[whole_chunk[kernel]] = needs.view(grid[1], grid[0]).bool().cpu()
    monkeypatch.setattr(gate_pairs, "launch", spy)
    check_against_reference(inputs, inputs["q"].dtype, **kwargs)
    slots = flags["forward"].shape[1]
    flags["backward"] = flags["backward"].view(flags["backward"].shape[0], slots, -1)
    return flags


# the strong keys: the first K tile's (16-wide in the interpreter), the second's (the forward's
# whole-chunk kernel accumulates the first tile, then drops it), or every third key (a few in
# every K tile)
STRONG_KEYS = {"first-half": slice(0, 16), "second-half": slice(16, 32), "every-third": slice(1, None, 3)}


@pytest.mark.parametrize("keys", list(STRONG_KEYS))
@pytest.mark.parametrize("decays", list(STRONG_DECAYS))
@pytest.mark.parametrize("gate", ["gk", "g+gk"])
def test_strong_per_key_decay(gate, decays, keys, monkeypatch):
    """Kimi Delta Attention with a strong per-key log decay per token on some key channels (the
    others ordinary). Past a span of 120 over a chunk the whole-chunk gate products would
    overflow fp32, and past about e^-10 per token so would a 16-row block's: those chunks and K
    tiles take the blockwise and then the exact per-row forms (the 6-row last chunk's span stays
    within the whole-chunk form). K = 32 makes the kinds meet in one call."""
    dtype = torch.float32
    inputs = make_inputs(1, 70, 1, 1, 32, 16, dtype, gate, True)
    inputs["beta"] = inputs["beta"].float()
    gk = inputs["gk"]
    low, high = STRONG_DECAYS[decays]
    strong = STRONG_KEYS[keys]
    gk[..., strong] = -torch.empty_like(gk[..., strong]).uniform_(low, high)
    flags = blocks_flags(monkeypatch, inputs)
    for direction, flagged in flags.items():
        if decays == "whole-chunk-near-limit":
            assert not flagged.any(), direction
        else:
            assert flagged[0, 0].any() and not flagged[0, 1].any(), (direction, flagged)


def test_fp16_with_wide_whole_chunk_decays():
    """fp16 inputs whose per-key decays span up to about 115 over a chunk: still the whole-chunk
    gate products, with factors up to e^58, past fp16's range (e^11): the pair gradients must not
    multiply such factors in fp16 (bf16, with fp32's range, may)."""
    dtype = torch.float16
    inputs = make_inputs(1, 70, 1, 1, 32, 16, dtype, "gk", True)
    low, high = STRONG_DECAYS["whole-chunk-near-limit"]
    inputs["gk"][..., :16] = -torch.empty_like(inputs["gk"][..., :16]).uniform_(low, high)
    check_against_reference(inputs, dtype)


@pytest.mark.parametrize("layout", ["fixed", "varlen"])
def test_strong_decay_in_one_chunk_only(layout, monkeypatch):
    """A strong per-key decay on every key of one chunk of one (batch or sequence, value head)
    alone, grouped value heads: that chunk takes the blockwise form, every other the whole-chunk
    products, in one call (forward and backward)."""
    dtype = torch.float32
    if layout == "fixed":
        inputs = make_inputs(2, 150, 1, 2, 32, 16, dtype, "gk", True)
        rows, kwargs = (1, slice(64, 128)), {}
    else:  # the 130-token sequence's second chunk; an empty and a one-token sequence beside it
        lengths = [0, 70, 1, 130, 44]
        inputs = make_inputs(1, sum(lengths), 1, 2, 32, 16, dtype, "gk", True, n_seqs=len(lengths))
        rows, kwargs = (0, slice(71 + 64, 71 + 128)), {"cu_seqlens": cu_from_lengths(lengths)}
    inputs["beta"] = inputs["beta"].float()
    inputs["gk"][rows[0], rows[1], 1] = -torch.empty_like(inputs["gk"][rows[0], rows[1], 1]).uniform_(2.5, 4.0)
    flags = blocks_flags(monkeypatch, inputs, **kwargs)
    heads = flags["forward"].any(dim=1)
    assert heads.tolist() == ([False, False, False, True] if layout == "fixed" else [False, True]), heads
    assert flags["forward"].sum() == 1 and flags["backward"].any(dim=2).sum() == 1, flags


def test_fp32_beta_with_half_inputs():
    dtype = DTYPES[-1]
    inputs = make_inputs(1, 40, 1, 1, 16, 16, dtype, "g", False)
    inputs["beta"] = inputs["beta"].float()
    check_against_reference(inputs, dtype, output_final_state=False)


def test_qk_l2norm_in_kernel():
    """The kernels round the normalised q and k to the input dtype, which the fp64 reference
    does not: the gate gradient, a sum whose terms cancel, feels that rounding most (bf16 on an
    H200 over 150 seeds, dev/gpu/gdn_error_spread.py --l2norm: dg median 4.6e-3, 99th percentile
    1.6e-2, largest 2.6e-2; without the normalisation largest 1.2e-2), so dg gets 2.5 times its
    usual bound here."""
    dtype = DTYPES[-1]
    inputs = make_inputs(1, 67, 1, 1, 32, 32, dtype, "g", False, normalize_k=False)
    inputs["q"] = inputs["q"] * 3  # far from unit norm, so the normalisation matters
    bounds = {"dg": 2.5 * bound("dg", dtype)} if dtype == torch.bfloat16 else None
    check_against_reference(inputs, dtype, bounds=bounds, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("initial,final", [(True, False), (False, True)])
def test_custom_scale_and_one_state(initial, final):
    dtype = DTYPES[-1]
    inputs = make_inputs(2, 40, 1, 1, 16, 16, dtype, "g", initial)
    check_against_reference(inputs, dtype, output_final_state=final, scale=0.3)


VARLEN_LENGTHS = [1, 64, 0, 20, 50]  # a single token, exactly one chunk, an empty sequence


# grouped value heads with the scalar gate; the per-key gate (three times the interpreter's time)
# on one value head
@pytest.mark.parametrize("gate,cu_dtype,HV,K,V", [("g", torch.int32, 2, 16, 32), ("g+gk", torch.int64, 1, 16, 32),
                                                  ("g", torch.int32, 2, 64, 64), ("gk", torch.int32, 1, 64, 64)])
def test_varlen(gate, cu_dtype, HV, K, V):
    dtype = DTYPES[-1]
    cu = cu_from_lengths(VARLEN_LENGTHS, cu_dtype)
    inputs = make_inputs(1, sum(VARLEN_LENGTHS), 1, HV, K, V, dtype, gate, True,
                         n_seqs=len(VARLEN_LENGTHS))
    check_against_reference(inputs, dtype, cu_seqlens=cu)


def test_gradients_repeat():
    """Two backward passes over the same inputs agree (bit equality is not required)."""
    dtype = DTYPES[-1]
    inputs = make_inputs(1, 67, 1, 1, 16, 16, dtype, "g+gk", True)
    results = []
    for _ in range(2):
        leaves, o, final = run_op(inputs, output_final_state=True)
        torch.manual_seed(1)
        do, dht = torch.randn_like(o), torch.randn_like(final)
        results.append((o, final) + torch.autograd.grad((o, final), list(leaves.values()), (do, dht)))
    names = ["o", "final_state"] + ["d" + n for n in leaves]
    for name, first, second in zip(names, *results):
        assert rel_err(second, first) <= TOLERANCE[dtype] / 10, name


def test_kept_gated_pairs_are_not_formed_again(monkeypatch):
    """With gk at whole 64-wide tiles the forward keeps T and the gated pair products: the
    backward forms neither again (no gated_pairs or prepare launch), and its gradients still
    match the reference (test_against_reference[K64-kept-pairs-g+gk-gva])."""
    from flash_dma.ops.gated_delta_rule.triton import gate_pairs, wy_prepare
    inputs = make_inputs(1, 70, 1, 1, 64, 64, DTYPES[-1], "gk", False)
    leaves, o, _ = run_op(inputs)  # a first call (and its compile-ahead dry run, where it runs)
    calls = []
    for module, name in ((gate_pairs, "gated_pairs"), (wy_prepare, "prepare")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    leaves, o, _ = run_op(inputs)
    assert calls == ["gated_pairs", "prepare"], calls
    torch.autograd.grad(o, list(leaves.values()), torch.randn_like(o))
    assert calls == ["gated_pairs", "prepare"], f"formed again in the backward: {calls}"


def test_failed_compile_ahead_leaves_the_call_working(monkeypatch):
    """Compiling ahead is a speed-up only: if its dry run fails, the call warns and runs as usual."""
    import contextlib
    from flash_dma.ops.gated_delta_rule import autograd

    @contextlib.contextmanager
    def broken():
        raise RuntimeError("no compiler here")
        yield  # pragma: no cover

    monkeypatch.setattr(autograd, "compile_ahead_enabled", lambda: True)
    monkeypatch.setattr(autograd, "compile_ahead", broken)
    monkeypatch.setattr(autograd, "_COMPILED_AHEAD", set())
    monkeypatch.setattr(autograd, "_CHECKED_CALLS", set())
    inputs = make_inputs(1, 67, 2, 2, 16, 16, DTYPES[-1], "g", True)
    with pytest.warns(RuntimeWarning, match="compiling ahead failed"):
        check_against_reference(inputs, DTYPES[-1], output_final_state=True)


def test_inference_mode_forward():
    dtype = DTYPES[-1]
    inputs = make_inputs(2, 67, 1, 2, 16, 16, dtype, "g", True)
    with torch.inference_mode():
        o, final = chunk_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                          inputs["beta"], initial_state=inputs["initial_state"],
                                          output_final_state=True)
        ref_o, ref_final = gated_delta_rule_reference(inputs["q"], inputs["k"], inputs["v"],
                                                      inputs["g"], inputs["beta"],
                                                      initial_state=inputs["initial_state"],
                                                      output_final_state=True)
    check_errors({"o": (o, ref_o), "final_state": (final, ref_final)}, dtype)


# ---------------------------------------------------------------------------------------------
# bad inputs

def _bad(case):
    dtype = DTYPES[-1]
    B, T, H, HV, K, V = 1, 8, 1, 2, 16, 16
    kw = {}
    if case == "cu_seqlens-with-batch":
        B = 2
        kw["cu_seqlens"] = cu_from_lengths([4, 4])
    if case == "heads":
        H, HV = 2, 3
    if case == "K-too-large":
        K = 272
    if case == "V-too-large":
        V = 272
    x = make_inputs(B, T, H, HV, K, V, dtype, "g", True)
    if case == "initial_state-shape":
        x["initial_state"] = x["initial_state"][:, :1]
    if case == "initial_state-dtype":
        x["initial_state"] = x["initial_state"].to(dtype)
    if case == "g-shape":
        x["g"] = x["g"][:, :-1]
    if case == "beta-shape":
        x["beta"] = torch.cat([x["beta"], x["beta"][:, :, :1]], 2)
    return x, kw


BAD = {  # case: what the message must name
    "cu_seqlens-with-batch": "cu_seqlens",
    "heads": r"\bv\b",
    "K-too-large": r"\b[qk]\b|256|272",
    "V-too-large": r"\bv\b|256|272",
    "initial_state-shape": "initial_state",
    "initial_state-dtype": "initial_state",
    "g-shape": r"\bg\b",
    "beta-shape": "beta",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case):
    x, kw = _bad(case)
    with pytest.raises((ValueError, TypeError), match=BAD[case]):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                               initial_state=x["initial_state"], output_final_state=True, **kw)


# ---------------------------------------------------------------------------------------------
# real sizes (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_real_sizes(shape, dtype):
    if dtype != torch.bfloat16 and shape != "h4-128":
        pytest.skip("fp16 at one real size only")
    B, T, H, HV, K, V, gate, states = GPU_SHAPES[shape]
    inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states)
    check_against_reference(inputs, dtype, output_final_state=states)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("decays", list(STRONG_DECAYS))
@pytest.mark.parametrize("K", [64, 128, 256])
def test_gpu_strong_per_key_decay(K, decays, dtype):
    """The strong per-key decays of test_strong_per_key_decay on the Hopper table's tiles (K a
    multiple of 64: 32-wide pair-gradient tiles, the whole-chunk and blockwise kernels side by
    side), on the first quarter of the key channels of every other chunk; in fp16 the whole-chunk
    factors pass fp16's range."""
    inputs = make_inputs(2, 300, 2, 2, K, 128, dtype, "gk", True)
    low, high = STRONG_DECAYS[decays]
    strong = inputs["gk"][:, :, :, : K // 4]
    for start in range(0, 300, 128):
        strong[:, start:start + 64] = -torch.empty_like(strong[:, start:start + 64]).uniform_(low, high)
    check_against_reference(inputs, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("from_inverse", [True, False], ids=["wu-from-T", "wu-recomputed"])
@pytest.mark.parametrize("shape", ["h16-128", "K256-V256", "gva-128", "no-gate-gva-K64-V128", "varlen"])
def test_gpu_both_ways_of_forming_w_and_u(shape, from_inverse):
    dtype = torch.bfloat16
    with overrides(gdn_states_from_inverse=from_inverse, gdn_backward_states_from_inverse=from_inverse):
        if shape == "varlen":
            lengths = [1, 64, 0, 1000, 2500, 31, 500]
            inputs = make_inputs(1, sum(lengths), 4, 8, 128, 128, dtype, "g", True, n_seqs=len(lengths))
            check_against_reference(inputs, dtype, cu_seqlens=cu_from_lengths(lengths))
            return
        B, T, H, HV, K, V, gate, states = GPU_SHAPES[shape]
        inputs = make_inputs(B, T, H, HV, K, V, dtype, gate, states)
        check_against_reference(inputs, dtype, output_final_state=states)


@pytest.mark.gpu
@pytest.mark.parametrize("gate,K", [("g", 96), ("gk", 96), ("gk", 192)])
def test_gpu_first_call_compiles_every_kernel_ahead(gate, K, monkeypatch):
    """The first call's dry run (compiling and loading in parallel) must cover every launch of
    its forward and backward: nothing may compile or load once the real call runs. Head count 3
    and K = 96 or 192 are constants no other test uses, so the kernels are new here (K = 192
    with gk: the backward from the kept T and gated pair products)."""
    import triton
    from flash_dma.runtime import launch as launch_mod
    from flash_dma.ops.gated_delta_rule import interface
    if not launch_mod.compile_ahead_enabled():
        pytest.skip("compile-ahead is off here (Triton version or FLASH_DMA_COMPILE_AHEAD=0)")
    late = []
    original = interface.compile_ahead_of_first_call

    def then_watch(args, backward, **kwargs):
        original(args, backward, **kwargs)
        monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                            lambda *a, **kw: late.append(("compiled", kw.get("repr", "?"))))
        monkeypatch.setattr(triton.knobs.runtime, "kernel_load_start_hook",
                            lambda module, function, name, *a: late.append(("loaded", name)))

    monkeypatch.setattr(interface, "compile_ahead_of_first_call", then_watch)
    inputs = make_inputs(1, 300, 3, 3, K, 64, torch.bfloat16, gate, True)
    check_against_reference(inputs, torch.bfloat16, output_final_state=True)
    assert not late, f"during the real call: {late}"


@pytest.mark.gpu
@pytest.mark.parametrize("K, dtype, local_dv", [(16, torch.float32, False), (64, torch.bfloat16, False),
                                                (64, torch.bfloat16, True), (128, torch.bfloat16, None)])
def test_gpu_strong_scalar_decay_with_a_short_last_chunk(K, dtype, local_dv):
    """As test_strong_scalar_decay_with_a_short_last_chunk, compiled; in 16 bits at a GDN layer's
    strongest decays (-16 softplus(x) a token) and with the Hopper kernels the plan picks at
    K = 128. (fp32 there, with tf32 products, puts dg's error near 4e-2: its row sums cancel.)"""
    torch.manual_seed(3)
    inputs = make_inputs(2, 4000, 2, 2, K, K, dtype, "g", True, shifts=(-1.5, 5.0))
    if dtype != torch.float32:
        inputs["g"] = -16 * torch.nn.functional.softplus(torch.randn_like(inputs["g"]))
    with overrides(**({} if local_dv is None else {"gdn_dhu_local_dv": local_dv})):
        check_against_reference(inputs, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["g", "g+gk", "none"])
def test_gpu_backward_is_repeatable(gate):
    """The same inputs give bitwise the same gradients: a race in a pipelined loop once made dg and
    dbeta change from run to run (and raised their errors against fp64 fourfold)."""
    inputs = make_inputs(2, 2048, 4, 4, 128, 128, torch.bfloat16, gate, True)
    cotangents = None
    runs = []
    for _ in range(3):
        leaves, o, final = run_op(inputs, output_final_state=True)
        if cotangents is None:
            cotangents = [torch.randn_like(o), torch.randn_like(final)]
        runs.append(torch.autograd.grad([o, final], list(leaves.values()), cotangents))
    for name, first, *others in zip(leaves, *runs):
        for other in others:
            assert torch.equal(first, other), f"d{name} differs between runs of the same backward"


@pytest.mark.gpu
def test_gpu_qk_l2norm_in_kernel():
    dtype = torch.bfloat16
    inputs = make_inputs(2, 4096, 4, 4, 128, 128, dtype, "g", True, normalize_k=False)
    check_against_reference(inputs, dtype, use_qk_l2norm_in_kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["g", "g+gk"])
def test_gpu_varlen(gate):
    dtype = torch.bfloat16
    lengths = [1, 64, 0, 1000, 2500, 31, 500]
    cu = cu_from_lengths(lengths)
    inputs = make_inputs(1, sum(lengths), 4, 8, 128, 128, dtype, gate, True, n_seqs=len(lengths))
    check_against_reference(inputs, dtype, cu_seqlens=cu)
