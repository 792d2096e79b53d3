"""Backend selection and the CuTe backend's availability checks, on CPU: the device and the
installed software are monkeypatched, so these run (and must pass) without the CuTe stack."""
import math
import subprocess
import sys

import pytest
import torch

from flash_dma.ops.dynamic_mask_attention.cute import availability, plain
from flash_dma.runtime import config
from flash_dma.ops.dynamic_mask_attention.cute.select import (BACKEND_ENV, CuteBackendUnavailable,
                                                              choose_backend, requested_backend)

PLAIN = dict(has_mask=False, has_bias=False, head_dim=128, dtype=torch.bfloat16, varlen=False)
NO_CUTE = "nvidia-cutlass-dsl is not installed. Install the Hopper extra: " + availability.INSTALL_HINT


@pytest.fixture
def status(monkeypatch):
    """Set the CuTe status the selection sees: status(None) = usable, status("why") = not."""
    def set_status(value):
        monkeypatch.setattr(availability, "cute_backend_status", lambda device: value)
    return set_status


@pytest.fixture
def status_never_asked(monkeypatch):
    def fail(device):
        raise AssertionError("the CuTe status was consulted")
    monkeypatch.setattr(availability, "cute_backend_status", fail)


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


@pytest.mark.parametrize("value, expected", [("", "auto"), ("auto", "auto"), ("CUTE", "cute"),
                                             (" triton ", "triton")])
def test_requested_backend_reads_the_environment(value, expected):
    assert requested_backend({BACKEND_ENV: value}) == expected
    assert requested_backend({}) == "auto"


def test_requested_backend_refuses_unknown_names():
    with pytest.raises(ValueError, match=BACKEND_ENV + ".*'cudnn'"):
        requested_backend({BACKEND_ENV: "cudnn"})
    with pytest.raises(ValueError, match="requested"):
        choose_backend("cuda", requested="fast", **PLAIN)


def test_triton_requested_never_consults_cute(status_never_asked):
    assert choose_backend("cuda", requested="triton", **PLAIN) == ("triton", f"{BACKEND_ENV}=triton")


def test_auto_picks_cute_for_plain_attention_where_it_runs(status):
    status(None)
    for varlen in (False, True):
        backend, reason = choose_backend("cuda", requested="auto", **{**PLAIN, "varlen": varlen})
        assert backend == "cute", reason
        assert ("varlen" if varlen else "fixed-length") in reason


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_masks_and_biases_stay_on_triton_under_auto_and_go_to_cute_when_forced(status, head_dim):
    """Measured on the H200: the CuTe mask and bias paths are slower than Triton's (auto keeps
    Triton; forcing CuTe takes them, the bias path unless turned off)."""
    status(None)
    for change, words in ((dict(has_mask=True), "masks run on Triton"), (dict(has_bias=True), "bias runs on Triton"),
                          (dict(has_mask=True, has_bias=True), "masks run on Triton"),
                          (dict(has_mask=True, has_bias=True, bias_kind="per_key"), "masks run on Triton"),
                          (dict(has_mask=True, has_bias=True, bias_kind="dense"), "masks run on Triton")):
        backend, reason = choose_backend("cuda", requested="auto",
                                         **{**PLAIN, "head_dim": head_dim, **change})
        assert backend == "triton" and words in reason, reason
        assert choose_backend("cuda", requested="cute", **{**PLAIN, "head_dim": head_dim, **change})[0] == "cute"
    with config.overrides(attention_cute_bias=False):
        backend, reason = choose_backend("cuda", requested="cute", **{**PLAIN, "head_dim": head_dim, "has_bias": True})
        assert backend == "triton" and "attention_cute_bias" in reason, reason


@pytest.mark.parametrize("bias_kind", ["per_key", "dense", "dense_tma", None])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_sends_a_bias_to_cute_where_its_forward_measured_faster(status, head_dim, bias_kind):
    """A 16-bit bias without a mask takes the CuTe forward under auto at the layouts and head dims
    where that forward measured ahead of Triton (select.CUTE_BIAS_FORWARD_HEAD_DIMS), only with
    the direct-bias forward; elsewhere (an fp32 bias: bias_kind None) Triton, saying why."""
    from flash_dma.ops.dynamic_mask_attention.cute.select import CUTE_BIAS_FORWARD_HEAD_DIMS
    status(None)
    call = {**PLAIN, "head_dim": head_dim, "has_bias": True, "bias_kind": bias_kind}
    backend, reason = choose_backend("cuda", requested="auto", **call)
    if head_dim in CUTE_BIAS_FORWARD_HEAD_DIMS.get(bias_kind, ()):
        assert backend == "cute" and "biased" in reason, reason
        with config.overrides(attention_cute_direct_bias=False):  # the hook path measured slower
            backend, reason = choose_backend("cuda", requested="auto", **call)
    assert backend == "triton" and "leads with a 16-bit per key bias at head dim 64, 128, 256" in reason, reason


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_auto_keeps_a_biased_backward_on_cute_only_where_it_measured_faster(head_dim):
    from flash_dma.ops.dynamic_mask_attention.cute.select import (
        CUTE_BIAS_BACKWARD_ATOMIC_KINDS, CUTE_BIAS_BACKWARD_HEAD_DIMS, auto_backward_on_triton)
    for kind in ("dense", "dense_tma", "per_key", None):
        for reduce in ("store", "atomic", None):
            why = auto_backward_on_triton(False, head_dim, kind, reduce)
            keep = (head_dim in CUTE_BIAS_BACKWARD_HEAD_DIMS.get(kind, ())
                    and (reduce != "atomic" or kind in CUTE_BIAS_BACKWARD_ATOMIC_KINDS))
            assert (why is None) == keep, (kind, reduce, why)
            if why is not None:
                assert "Triton backward leads" in why and "FLASH_DMA_BACKEND=cute" in why
    assert auto_backward_on_triton(True, head_dim, "dense", "store") is None  # masks: not this rule
    # with the TMA parts turned off the backward reads the bias per element: Triton leads below D256
    with config.overrides(attention_cute_bias_tma_backward=False):
        assert (auto_backward_on_triton(False, head_dim, "dense_tma", "store") is None) == (head_dim == 256)
    with config.overrides(attention_cute_dbias_tma=False):
        assert (auto_backward_on_triton(False, head_dim, "dense_tma", "store") is None) == (head_dim == 256)
        assert auto_backward_on_triton(False, head_dim, "dense_tma", None) is None


def test_bias_layout_names_the_layouts_auto_reads():
    from flash_dma.ops.dynamic_mask_attention.cute.select import bias_layout
    bf16 = dict(dtype=torch.bfloat16)
    assert bias_layout(None) is None
    assert bias_layout(torch.zeros(2, 4, 1, 64, **bf16)) == "per_key"
    assert bias_layout(torch.zeros(1, 1, 1, 64, dtype=torch.float16)) == "per_key"
    assert bias_layout(torch.zeros(2, 4, 32, 64, **bf16)) == "dense_tma"
    assert bias_layout(torch.zeros(2, 1, 32, 64, **bf16)) == "dense_tma"
    assert bias_layout(torch.zeros(2, 4, 32, 60, **bf16)) == "dense"  # rows not 16-byte aligned
    assert bias_layout(torch.zeros(2, 4, 32, 64, **bf16).expand(2, 4, 32, 64)) == "dense_tma"
    assert bias_layout(torch.zeros(1, 1, 32, 1, **bf16).expand(2, 4, 32, 64)) == "dense"  # stride 0 keys
    assert bias_layout(torch.zeros(2, 4, 32, 1, **bf16)) is None  # broadcast along keys
    assert bias_layout(torch.zeros(2, 4, 32, 64)) is None  # fp32


@pytest.mark.parametrize("prefetch, head_dim, causal, pairs, tma_layout, expected", [
    ("auto", 128, False, True, False, "registers"), ("auto", 128, True, True, False, "L2"),
    ("auto", 64, False, True, False, "L2"), ("auto", 256, False, True, False, "L2"),
    ("auto", 128, False, False, False, "L2"), ("L1", 128, False, True, False, "L1"),
    ("registers", 64, True, True, False, "registers"),
    ("auto", 128, False, True, True, "tma"), ("auto", 64, False, True, True, "tma"),
    ("auto", 64, True, True, True, "L2"), ("auto", 128, True, True, True, "L2"),
    ("auto", 256, False, True, True, "L2"), ("tma", 128, False, True, False, "registers"),
    ("tma", 256, False, True, True, "tma")])
def test_bias_path_resolves_the_prefetch(prefetch, head_dim, causal, pairs, tma_layout, expected):
    """auto takes TMA tiles for a bias with full query and key dims at the TMA head dims without
    causal, the register prefetch at D128 without causal, else L2; a forced "tma" without that layout takes
    auto's other form (a forced one at another head dim stays, for masked.forward to refuse,
    logged)."""
    from flash_dma.ops.dynamic_mask_attention.cute.masked import bias_path
    with config.overrides(attention_cute_bias_prefetch=prefetch, attention_cute_bias_pairs=pairs):
        path = bias_path(head_dim, causal, tma_layout)
    assert path.prefetch == expected and path.pairs == pairs
    assert path.direct_forward and path.direct_backward  # the defaults


def test_auto_falls_back_with_the_status_as_reason(status):
    status(NO_CUTE)
    backend, reason = choose_backend("cuda", requested="auto", **PLAIN)
    assert backend == "triton"
    assert NO_CUTE in reason


@pytest.mark.parametrize("change, words", [
    (dict(has_mask=True, varlen=True), "varlen path with a mask"),
    (dict(has_bias=True, varlen=True), "varlen path with a bias"),
    (dict(has_mask=True, has_bias=True, varlen=True), "varlen path with a mask and bias"),
    (dict(has_mask=True, head_dim=96), "not 96"), (dict(has_bias=True, head_dim=192), "not 192"),
    (dict(has_mask=True, key_wise_mask=True), "gathered keys"),
    (dict(head_dim=80), "head dim 80"), (dict(head_dim=32), "head dim 32"),
    (dict(dtype=torch.float32), "torch.float32"),
])
def test_auto_falls_back_for_what_cute_lacks_without_importing_it(status_never_asked, change, words):
    backend, reason = choose_backend("cuda", requested="auto", **{**PLAIN, **change})
    assert backend == "triton"
    assert words in reason


def test_forcing_cute_where_it_cannot_run_raises_why_and_how(status):
    status(NO_CUTE)
    with pytest.raises(CuteBackendUnavailable) as info:
        choose_backend("cuda", requested="cute", **PLAIN)
    message = str(info.value)
    assert f"{BACKEND_ENV}=cute" in message and NO_CUTE in message
    assert message.count(availability.INSTALL_HINT) == 1
    # a device reason gets the install line too
    status("the CuTe backend runs on CUDA GPUs, and the tensors are on cpu")
    with pytest.raises(CuteBackendUnavailable, match=r"on cpu.*SM90.*flash-dma\[hopper\]"):
        choose_backend("cpu", requested="cute", **PLAIN)


def test_forcing_cute_reads_the_environment(status, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cute")
    status(None)
    assert choose_backend("cuda", **PLAIN) == ("cute", f"{BACKEND_ENV}=cute")
    status(NO_CUTE)
    with pytest.raises(CuteBackendUnavailable):
        choose_backend("cuda", **PLAIN)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert choose_backend("cuda", **PLAIN)[0] == "triton"


def test_forced_cute_still_falls_back_for_a_missing_feature(status):
    status(None)
    backend, reason = choose_backend("cuda", requested="cute", **{**PLAIN, "has_bias": True,
                                                                  "varlen": True})
    assert backend == "triton"
    assert f"{BACKEND_ENV}=cute" in reason and "bias" in reason


def test_real_status_on_cpu_and_no_import_of_the_cute_stack():
    """Run in a fresh interpreter: selecting on CPU (auto) and the status of a CPU device must not
    import cutlass or FA4 (the base install pays nothing for the optional backend)."""
    code = (
        "import sys, torch\n"
        "from flash_dma.ops.dynamic_mask_attention.cute import choose_backend, cute_backend_status\n"
        "backend, reason = choose_backend('cpu', False, False, 128, torch.float16, False, 'auto')\n"
        "assert backend == 'triton' and 'cpu' in reason, reason\n"
        "assert 'CUDA' in cute_backend_status(torch.device('cpu'))\n"
        "loaded = [m for m in ('cutlass', 'flash_attn', 'quack') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def fake_gpu(monkeypatch, capability, name="NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    availability._cuda_status.cache_clear()
    availability.software_status.cache_clear()


@pytest.fixture
def clear_status_caches():
    yield
    availability._cuda_status.cache_clear()
    availability.software_status.cache_clear()


def test_status_names_a_gpu_that_is_not_sm90(monkeypatch, clear_status_caches):
    fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    reason = availability.cute_backend_status("cuda:0")
    assert "A100" in reason and "8.0" in reason and "9.0" in reason
    fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    assert "10.0" in availability.cute_backend_status("cuda")


def test_status_on_sm90_checks_the_installed_versions(monkeypatch, clear_status_caches):
    versions = {}
    monkeypatch.setattr(availability, "_installed_version", lambda dist: versions.get(dist))
    imported = []
    monkeypatch.setattr(availability, "_import_failure", lambda module: imported.append(module))
    fake_gpu(monkeypatch, (9, 0))
    reason = availability.cute_backend_status("cuda:0")
    assert "nvidia-cutlass-dsl is not installed" in reason and "flash-attn-4 is not installed" in reason
    assert reason.endswith(availability.INSTALL_HINT) and not imported

    versions.update({"nvidia-cutlass-dsl": "4.7.1", "flash-attn-4": "4.0.0b35"})
    fake_gpu(monkeypatch, (9, 0))
    reason = availability.cute_backend_status("cuda:0")
    assert "4.7.1" in reason and "4.8.x" in reason and "4.0.0b35" in reason and "4.0.0b36" in reason

    versions.update({"nvidia-cutlass-dsl": "4.8.1", "flash-attn-4": availability.FLASH_ATTN_4_VERSION})
    fake_gpu(monkeypatch, (9, 0))
    assert availability.cute_backend_status("cuda:0") is None
    assert imported == ["cutlass", "cutlass.cute", "flash_attn.cute.interface"]


def test_status_reports_a_broken_import(monkeypatch, clear_status_caches):
    monkeypatch.setattr(availability, "_installed_version",
                        lambda dist: {"nvidia-cutlass-dsl": "4.8.1",
                                      "flash-attn-4": availability.FLASH_ATTN_4_VERSION}[dist])
    monkeypatch.setattr(availability, "_import_failure",
                        lambda module: "OSError: libcuda.so.1: cannot open" if module == "cutlass" else None)
    fake_gpu(monkeypatch, (9, 0))
    reason = availability.cute_backend_status("cuda:0")
    assert "importing cutlass failed (OSError: libcuda.so.1" in reason
    assert availability.INSTALL_HINT in reason


def test_import_failure_catches_what_a_broken_module_raises():
    assert availability._import_failure("math") is None
    assert "ModuleNotFoundError" in availability._import_failure("flash_dma_no_such_module")


def test_plain_supports(status):
    status(None)
    problem = plain.PlainProblem(device=torch.device("cuda"), dtype=torch.float16, head_dim=256,
                                 num_heads=16, num_kv_heads=4, is_varlen=True, is_causal=True)
    assert plain.supports(problem) is None
    assert "mask" in plain.supports(plain.PlainProblem(**{**problem.__dict__, "has_mask": True}))
    assert "head dim 40" in plain.supports(plain.PlainProblem(**{**problem.__dict__, "head_dim": 40}))
    assert "do not divide" in plain.supports(plain.PlainProblem(**{**problem.__dict__, "num_kv_heads": 3}))
    status(NO_CUTE)
    assert plain.supports(problem) == NO_CUTE


def test_tma_ready_copies_only_what_tma_cannot_describe():
    t = torch.randn(2, 7, 3, 64, dtype=torch.float16)
    assert plain._tma_ready(t) is t
    heads_last = torch.randn(2, 7, 64, 3, dtype=torch.float16).transpose(-1, -2)  # stride(-1) = 3
    assert plain._tma_ready(heads_last).is_contiguous()
    packed = torch.randn(2, 7, 3, 3 * 64 + 4, dtype=torch.float16)[..., 4:68]  # start 8 bytes in
    ready = plain._tma_ready(packed)
    assert ready is not packed and torch.equal(ready, packed)
    narrow = torch.randn(2, 7, 3, 68, dtype=torch.float16)[..., :64]  # row stride 68: not 16-byte
    assert plain._tma_ready(narrow) is not narrow
    wide = torch.randn(2, 7, 3, 72, dtype=torch.float16)[..., 8:72]  # aligned start and strides
    assert plain._tma_ready(wide) is wide


def test_rows_without_keys_get_plus_inf():
    q, k = torch.empty(1, 5, 1, 64), torch.empty(1, 3, 1, 64)
    assert plain._may_have_empty_rows(q, k, causal=True, varlen=False)
    assert not plain._may_have_empty_rows(q, k, causal=False, varlen=False)
    assert not plain._may_have_empty_rows(k, q, causal=True, varlen=False)
    assert plain._may_have_empty_rows(q, k[:, :0], causal=False, varlen=False)
    assert plain._may_have_empty_rows(k, q, causal=False, varlen=True)
    lse = torch.tensor([1.5, -math.inf, math.inf, math.nan, -3.0])
    plain._empty_rows_to_plus_inf(lse)
    assert lse[:3].tolist() == [1.5, math.inf, math.inf] and math.isnan(lse[3]) and lse[4] == -3.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where torch sees no GPU")
def test_real_status_without_a_gpu(clear_status_caches):
    availability._cuda_status.cache_clear()
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        assert "torch sees none" in availability.cute_backend_status(device)


def test_the_attention_call_honours_the_backend_choice(monkeypatch):
    """Wired through the plan: forcing cute where it cannot run raises with the install hint;
    triton and auto run the call on Triton where CuTe cannot (here: no GPU, or the interpreter)."""
    import flash_dma
    from flash_dma.runtime import config
    if torch.cuda.is_available():
        pytest.skip("the CPU path: the GPU tests cover the CuTe backend itself")
    q, k, v = torch.randn(3, 1, 16, 2, 32, dtype=torch.float16)
    ref = flash_dma.flash_dma_func(q, k, v)
    with config.overrides(attention_backend="triton"):
        assert torch.equal(flash_dma.flash_dma_func(q, k, v), ref)
    with config.overrides(attention_backend="cute"), pytest.raises(CuteBackendUnavailable) as info:
        flash_dma.flash_dma_func(q, k, v)
    assert availability.INSTALL_HINT in str(info.value)
    monkeypatch.setenv(BACKEND_ENV, "cute")
    with pytest.raises(CuteBackendUnavailable):
        flash_dma.flash_dma_func(q, k, v)
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        flash_dma.flash_dma_func(q, k, v)


def _cute_plans(status, mask_shape, bias_shape, *, want_dbias=True, deterministic=False,
                causal=False, requested="cute", head_dim=128, seqlen_k=50):
    """(forward plan, backward plan) of a B2 H4 Hk2 S40x50 call, the CuTe status set usable
    (no tensor is read: stand-ins of the shapes, as `flash-dma env --attention` builds)."""
    from flash_dma.ops.dynamic_mask_attention.plan import AttentionProblem, plan_backward, plan_forward
    status(None)
    pb = AttentionProblem(2, 4, 2, head_dim, 40, seqlen_k, False, causal, head_dim ** -0.5, None, None)
    q = torch.empty(2, 40, 4, head_dim, dtype=torch.bfloat16)

    def stand_in(shape, dtype):
        return None if shape is None else torch.empty((), dtype=dtype).expand(shape)
    # the bias as laid out in memory (auto reads whether TMA can load it)
    mask = stand_in(mask_shape, torch.bool)
    bias = None if bias_shape is None else torch.empty(bias_shape, dtype=torch.bfloat16)
    # forced, with the bias hooks let in: this checks the CuTe path's own planning (auto keeps
    # masks and biases on Triton: test_masks_and_biases_stay_on_triton_...)
    with config.overrides(attention_backend=requested, attention_cute_bias=True):
        fwd = plan_forward(pb, q, mask, bias)
        return fwd, plan_backward(fwd, q, mask, bias, want_dbias and bias is not None, deterministic)


@pytest.mark.parametrize("bias_shape, reduce", [
    ((2, 4, 40, 50), "store"), ((1, 4, 40, 50), "atomic"), ((2, 1, 40, 50), "atomic"),
    ((2, 2, 40, 50), "atomic"), ((1, 1, 40, 50), "atomic")])
def test_cute_plans_dbias_store_or_atomic(status, bias_shape, reduce):
    from flash_dma.ops.dynamic_mask_attention.plan import CutePlan
    fwd, bwd = _cute_plans(status, (2, 1, 40, 50), bias_shape)
    assert isinstance(fwd, CutePlan) and isinstance(bwd, CutePlan)
    assert bwd.backend.value == "cute" and bwd.dbias_reduce == reduce
    _, no_grad = _cute_plans(status, None, bias_shape, want_dbias=False)
    assert no_grad.dbias_reduce is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cute_sums_dbias_over_queries_where_its_scores_are_transposed(status, caplog, head_dim):
    """A bias broadcast along queries: the CuTe backward sums its dbias per key tile at head dims
    64 and 128 (stored, one writer per batch and head); at 256 the Triton backward, logged."""
    from flash_dma.ops.dynamic_mask_attention.plan import BackwardPlan, CutePlan
    with caplog.at_level("WARNING", logger="flash_dma"):
        fwd, bwd = _cute_plans(status, None, (2, 4, 1, 50), head_dim=head_dim)
    assert isinstance(fwd, CutePlan)
    if head_dim == 256:
        assert isinstance(bwd, BackwardPlan) and "over queries" in bwd.backend.source
    else:
        assert isinstance(bwd, CutePlan) and bwd.dbias_reduce == "store"


def test_key_wise_masks_stay_on_triton_and_per_head_ones_take_cute(status):
    """A key-wise mask with one keep-set per kv head (the gathered walk) runs on Triton; one that
    differs across the query heads of a group takes the tile lists, on CuTe."""
    from flash_dma.ops.dynamic_mask_attention.plan import CutePlan, ForwardPlan
    fwd, _ = _cute_plans(status, (2, 2, 1, 50), None)
    assert isinstance(fwd, ForwardPlan) and "gathered keys" in fwd.backend.source
    fwd, _ = _cute_plans(status, (2, 4, 1, 50), None)
    assert isinstance(fwd, CutePlan)


@pytest.mark.parametrize("mask_shape, bias_shape, deterministic, words", [
    (None, (2, 4, 40, 1), False, "broadcast along keys"),
    ((2, 4, 40, 50), None, True, "deterministic backward with a mask"),
    (None, (1, 4, 40, 50), True, "atomics"),
])
def test_cute_forward_triton_backward_where_cute_lacks_it(status, caplog, mask_shape, bias_shape,
                                                          deterministic, words):
    from flash_dma.ops.dynamic_mask_attention.plan import BackwardPlan, CutePlan
    with caplog.at_level("WARNING", logger="flash_dma"):
        fwd, bwd = _cute_plans(status, mask_shape, bias_shape, deterministic=deterministic)
    assert isinstance(fwd, CutePlan)
    assert isinstance(bwd, BackwardPlan) and bwd.backend.value == "triton"
    assert words in bwd.backend.source
    assert any(words in r.getMessage() for r in caplog.records) or words in str(
        getattr(__import__("flash_dma.runtime.profile", fromlist=["_FALLBACKS_SEEN"]), "_FALLBACKS_SEEN"))


def test_cute_serves_deterministic_bias_with_one_writer_per_entry(status):
    from flash_dma.ops.dynamic_mask_attention.plan import CutePlan
    _, bwd = _cute_plans(status, None, (2, 4, 40, 50), deterministic=True)
    assert isinstance(bwd, CutePlan) and bwd.dbias_reduce == "store" and bwd.deterministic


@pytest.mark.parametrize("head_dim, seqlen_k, backward", [
    (64, 50, None), (128, 50, "triton"), (256, 50, "cute"),
    (64, 56, "cute"), (128, 56, "cute"), (256, 56, "cute")])
def test_auto_plans_a_dense_bias_where_each_pass_measured_faster(status, caplog, head_dim, seqlen_k,
                                                                  backward):
    """Under auto, a 16-bit dense bias takes the CuTe forward at D128 and D256, and at D64 where
    TMA can load it (keys a multiple of 8 here); the CuTe backward where it reads the bias and
    stores dbias by TMA, or at D256; the Triton backward after a CuTe forward is a choice, not a
    fallback (no warning). The plan carries the resolved bias choices."""
    from flash_dma.ops.dynamic_mask_attention.plan import BackwardPlan, CutePlan, ForwardPlan
    with caplog.at_level("WARNING", logger="flash_dma"):
        fwd, bwd = _cute_plans(status, None, (2, 4, 40, seqlen_k), requested="auto",
                               head_dim=head_dim, seqlen_k=seqlen_k)
    if backward is None:
        assert isinstance(fwd, ForwardPlan) and isinstance(bwd, BackwardPlan)
        return
    assert isinstance(fwd, CutePlan) and fwd.bias_path is not None
    tma = head_dim in (64, 128) and seqlen_k % 8 == 0
    assert fwd.bias_path.prefetch == ("tma" if tma else "registers" if head_dim == 128 else "L2")
    if backward == "cute":
        assert isinstance(bwd, CutePlan) and bwd.bias_path == fwd.bias_path
    else:
        assert isinstance(bwd, BackwardPlan) and "Triton backward leads" in bwd.backend.source
        assert not any("instead" in r.getMessage() for r in caplog.records)
    _, forced = _cute_plans(status, None, (2, 4, 40, seqlen_k), requested="cute", head_dim=head_dim,
                            seqlen_k=seqlen_k)
    assert isinstance(forced, CutePlan)


def test_the_backward_follows_the_forwards_request(status):
    """A forward forced onto CuTe keeps its backward there even when the backward is planned
    outside the override (autograd runs it later), and an auto forward keeps auto's rules."""
    from flash_dma.ops.dynamic_mask_attention.plan import AttentionProblem, BackwardPlan, CutePlan, \
        plan_backward, plan_forward
    status(None)
    pb = AttentionProblem(2, 4, 2, 128, 40, 50, False, False, 128 ** -0.5, None, None)
    q = torch.empty(2, 40, 4, 128, dtype=torch.bfloat16)
    bias = torch.empty((), dtype=torch.bfloat16).expand(2, 4, 40, 50)
    with config.overrides(attention_backend="cute"):
        fwd = plan_forward(pb, q, None, bias)
    assert isinstance(plan_backward(fwd, q, None, bias, True, False), CutePlan)
    fwd = plan_forward(pb, q, None, bias)
    assert isinstance(fwd, CutePlan) and fwd.chosen_by_auto
    with config.overrides(attention_backend="cute"):
        assert isinstance(plan_backward(fwd, q, None, bias, True, False), BackwardPlan)


def test_tma_layout_is_a_full_bias_without_a_mask():
    from flash_dma.ops.dynamic_mask_attention.cute.masked import tma_layout
    bias = torch.zeros(2, 4, 32, 64, dtype=torch.bfloat16)
    assert tma_layout(None, bias)
    assert not tma_layout(torch.ones(2, 1, 32, 64, dtype=torch.bool), bias)
    assert not tma_layout(None, bias[:, :, :1]) and not tma_layout(None, bias[..., :1])
    assert not tma_layout(None, None)
