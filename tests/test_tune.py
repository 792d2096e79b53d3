"""`flash-dma tune` and `flash-dma env --attention/--gdn` on the CPU: the parser, the refusal
without a GPU, the sweep storing its fastest candidate where the plans look it up, and the plan
descriptions."""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import DEVICE
from flash_dma import cli
from flash_dma.benchmarks.tune import TuneCase, summary_lines, sweep_case
from flash_dma.ops.dynamic_mask_attention import launch_table as attention_table
from flash_dma.ops.dynamic_mask_attention import plan as attention_plan
from flash_dma.ops.gated_delta_rule import launch_table as gdn_table
from flash_dma.ops.gated_delta_rule import plan as gdn_plan
from flash_dma.ops.gated_delta_rule import tune as gdn_tune
from flash_dma.runtime import config, tuning_cache
from flash_dma.runtime.hardware import DeviceInfo

C = config.LaunchConfig
FAKE_GPU = DeviceInfo(name="Fake H100", arch=90, sm_count=132, shared_memory_per_block=227 * 1024,
                      l2_bytes=50 * 2 ** 20)
CUDA = torch.device("cuda", 0)  # only a name here: nothing is allocated on it


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A tuning cache in tmp_path, and plans that take the device for a Hopper GPU."""
    monkeypatch.setenv("FLASH_DMA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tuning_cache.forget_memory()
    for module in (config, attention_table, gdn_table, gdn_plan, attention_plan):
        if hasattr(module, "device_info"):
            monkeypatch.setattr(module, "device_info", lambda device: FAKE_GPU)
    for module in (attention_table, gdn_table):
        monkeypatch.setattr(module, "interpreter_active", lambda: False)
    yield tmp_path
    tuning_cache.forget_memory()


def fake_timings(timings: dict):
    """time_config from a table of milliseconds; a candidate mapped to an exception raises it."""
    calls = []

    def time_config(cfg):
        calls.append(cfg)
        result = timings[cfg]
        if isinstance(result, Exception):
            raise result
        return result
    return time_config, calls


def test_parser_knows_tune():
    args = cli.build_parser().parse_args(["tune", "gdn", "--quick"])
    assert args.command == "tune" and args.op == "gdn" and args.quick
    assert cli.build_parser().parse_args(["tune"]).op == "all"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "decode"])


def test_tune_without_gpu_exits_1_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "attention", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "cannot be timed on this machine" in err


def test_attention_sweep_stores_the_fastest_and_the_plan_reads_it(fake_gpu):
    fast, slow, broken = C(128, 128, 8, 2), C(128, 64, 8, 3), C(64, 64, 4, 3)
    time_config, calls = fake_timings({slow: 2.0, broken: RuntimeError("out of resources"), fast: 1.0})
    progress = []

    class Bar:
        def __init__(self, total):
            progress.append(["total", total])

        def update(self, n=1):
            progress.append(["update", n])

        def close(self):
            progress.append(["close"])

    case = TuneCase("attn_fwd", CUDA, 128, torch.bfloat16, "bias", [slow, broken, fast], time_config,
                    label="attn_fwd D128 bias")
    outcome = sweep_case(case, Bar)
    assert calls == [slow, broken, fast]
    assert outcome.best == fast
    assert set(outcome.timings_ms) == {config.config_name(slow), config.config_name(fast)}
    assert "RuntimeError" in outcome.errors[config.config_name(broken)]
    assert progress == [["total", 3], ["update", 1], ["update", 1], ["update", 1], ["close"]]
    stored = json.loads((fake_gpu / "tuning-v1.json").read_text())
    assert outcome.key in stored and C(**stored[outcome.key]) == fast
    assert "Fake H100" in outcome.key and "attn_fwd" in outcome.key
    line = summary_lines([outcome])[0]
    assert config.config_name(fast) in line and outcome.key in line and "1 skipped" in line
    # a plan built afterwards for that kernel, head dim, dtype and variant takes the winner
    q = SimpleNamespace(device=CUDA, dtype=torch.bfloat16, element_size=lambda: 2)
    bias = torch.empty((), dtype=torch.bfloat16).expand(2, 16, 4096, 4096)  # a stand-in, never read
    pb = attention_plan.AttentionProblem(2, 16, 16, 128, 4096, 4096, False, False, 128 ** -0.5, None, None)
    fwd = attention_plan.plan_forward(pb, q, None, bias)
    assert fwd.forward.variant == "bias"
    assert fwd.forward.config.source == "tuning cache" and fwd.forward.cfg == fast
    # another variant is not touched
    assert attention_table.select_config("attn_fwd", CUDA, 128, torch.bfloat16, "plain").source == "table"


def test_gdn_sweep_stores_under_the_key_choose_reads(fake_gpu):
    first, *others = gdn_tune.candidates_for("bwd_dqkw", 128, 128, quick=True)
    assert first == gdn_table._default("bwd_dqkw", 128, 128) and len(others) == gdn_tune.QUICK_CANDIDATES - 1
    timings = {cfg: 3.0 + i for i, cfg in enumerate([first] + others)}
    winner = others[-1]
    timings[winner] = 0.5
    timings[others[0]] = ValueError("wrong result: relative error nan")
    time_config, _ = fake_timings(timings)
    case = TuneCase("gdn_bwd_dqkw", CUDA, 128, torch.bfloat16, "V128", [first] + others, time_config,
                    cache_key=gdn_table.cache_key("bwd_dqkw", 128, 128, CUDA))
    outcome = sweep_case(case)
    assert outcome.best == winner and len(outcome.errors) == 1
    plan = gdn_plan._build(CUDA, torch.bfloat16, 2, 8192, 16, 16, 128, 128, 2, False, True, False)
    assert plan.launches["bwd_dqkw"].source == "tuning cache" and plan.launches["bwd_dqkw"].value == winner
    assert plan.launches["bwd_wy"].source == "table"


def test_gdn_cache_entry_does_not_reach_partly_masked_tiles(fake_gpu):
    """The cache key pads K (K = 80 reads K = 128's entry): a stored 32-wide pair_grad tile is
    taken at K = 128 but not at K = 80, whose partly masked tiles keep the rule's 64."""
    from dataclasses import asdict
    stored = gdn_table.GdnConfig(32, 16, 8, 1)
    tuning_cache.store(gdn_table.cache_key("pair_grad", 128, 128, CUDA), asdict(stored))
    assert gdn_table.cache_key("pair_grad", 80, 128, CUDA) == gdn_table.cache_key("pair_grad", 128, 128, CUDA)
    assert gdn_table.choose("pair_grad", 128, 128, CUDA) == config.Chosen(stored, "tuning cache")
    masked = gdn_table.choose("pair_grad", 80, 128, CUDA)
    assert masked.source == "rule" and masked.value.block_k == 64


def test_sweep_with_no_candidate_that_runs_stores_nothing(fake_gpu):
    cfg = C(64, 64, 4, 2)
    time_config, _ = fake_timings({cfg: RuntimeError("out of resources")})
    with pytest.raises(RuntimeError, match="no candidate"):
        sweep_case(TuneCase("attn_bwd_dq", CUDA, 64, torch.bfloat16, "plain", [cfg], time_config))
    assert tuning_cache.entries() == {}


def test_gdn_candidates_keep_the_tiles_that_compile():
    for pass_name in gdn_table.PASSES:
        if pass_name in gdn_tune.UNTUNED:
            continue
        full = gdn_tune.candidates_for(pass_name, 128, 128, quick=False)
        assert full[0] == (gdn_table._default(pass_name, 128, 128) if pass_name != "intra"
                           else gdn_table.GdnConfig(128, 64, 4, 2))
        assert len(set(full)) == len(full) > gdn_tune.QUICK_CANDIDATES
        # the gated-pair kernels' tiles are 32 wide by the table (launch_table._default); the others stay >= 64
        assert all(c.block_k >= (32 if pass_name in ("gated_pairs", "pair_grad") else 64) for c in full)
        if pass_name == "intra":
            assert {c.block_v for c in full} == {64} and {c.block_k for c in full} == {128}


def test_gdn_state_pass_candidates_hold_all_of_k():
    """The state passes' tile covers all of K; at K = 256 only two stages (three overflow shared
    memory, one made an illegal address on an H200)."""
    for pass_name in gdn_table.SEQUENTIAL:
        for K in (64, 128, 256):
            full = gdn_tune.candidates_for(pass_name, K, K, quick=False)
            assert {c.block_k for c in full} == {K}, (pass_name, K)
            assert {c.num_stages for c in full} == ({2} if K > 128 else {1, 2, 3}), (pass_name, K)


def test_attention_candidates_fit_and_start_with_the_table():
    for kernel in attention_table.KERNELS:
        cands = __import__("flash_dma.ops.dynamic_mask_attention.tune", fromlist=["x"]).candidates_for(
            kernel, 128, torch.bfloat16, "bias", FAKE_GPU, quick=False)
        assert cands[0] == attention_table.default_config(kernel, FAKE_GPU, 128, 2, "bias")
        assert all(attention_table.estimate_shared_memory(kernel, c, 128, 2, 4 if kernel != "attn_fwd" else 2)
                   <= FAKE_GPU.shared_memory_per_block for c in cands)
        assert len(cands) > 3


def test_env_describes_both_ops(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.main(["env", "--attention", "B=2 S=4096 H=16 Hk=16 D=128 bias=B,H,S,S causal",
                     "--gdn", "B=1 T=32768 H=16 HV=16 K=128 V=128 gk varlen"]) == 0
    out = capsys.readouterr().out
    assert "attention plan for" in out and "gdn plan for" in out
    lines = out.splitlines()
    assert any("attn_fwd:" in line and "(interpreter" in line for line in lines)
    assert any("attn_bwd_dkdv:" in line for line in lines)
    for pass_name in ("gated_pairs", "prepare_gk", "intra", "bwd_dhu", "bwd_dqkw", "pair_grad"):
        assert any(line.strip().startswith(f"{pass_name}: ") and "(interpreter)" in line for line in lines), pass_name
    assert any(line.strip() == "gate_grad: BK64_BV16_W4_S1 (rule)" for line in lines)
    assert any("split_prepare: False (rule)" in line for line in lines)


def test_gdn_describe_follows_the_shape():
    plain = gdn_plan.describe("B=2 T=8192 H=16 K=128 V=128", torch.device("cpu"))
    assert "gates g;" in plain[0] and any(line.startswith("prepare_t: ") for line in plain)
    assert not any(line.startswith(("prepare_gk", "gated_pairs")) for line in plain)
    assert any(line == "split_prepare: True (table)" for line in plain)
    both = gdn_plan.describe("B=1 T=4096 H=4 HV=8 K=64 V=32 g gk", torch.device("cpu"))
    assert "gates g+gk;" in both[0] and any(line.startswith("prepare_gk: ") for line in both)
    with pytest.raises(ValueError, match="unknown field"):
        gdn_plan.describe("B=1 Q=3")
    with pytest.raises(ValueError, match="B must be 1"):
        gdn_plan.describe("B=2 T=64 varlen")


def test_gdn_sweep_cases_stay_usable_after_the_generator_moves_on(monkeypatch):
    """Every case's timing closure runs the op with its candidate and checks the result, also when
    the cases were all collected before any ran (each gate's inputs live as long as its cases)."""
    make = gdn_tune.make_inputs
    monkeypatch.setattr(gdn_tune, "make_inputs", lambda *a, **k: make(*a, **{**k, "dtype": torch.float16}))
    collected = list(gdn_tune.cases(torch.device(DEVICE), True, shape=dict(B=1, T=70, H=1, K=64, V=64),
                                    timer=lambda fn: 1.0))
    assert {c.label.split()[-1] for c in collected} == set(gdn_tune.GATES)
    for case in collected:  # each case runs its own gate's inputs: its pass is among those launched
        with gdn_tune._PassRecorder() as launched:
            assert case.time_config(case.candidates[0]) == 1.0
        assert case.kernel.removeprefix("gdn_") in launched.seen, (case.label, launched.seen)
