"""What a new user meets first: bf16 in the CPU interpreter, the no-GPU bench's exit code, bad
varlen offsets, the numpy cap, the README's CPU line, warnings leaking into user code."""
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, ON_GPU
from helpers import rel_err
from flash_dma import (chunk_gated_delta_rule, chunk_gated_delta_rule_bwd_dhu, flash_dma_func,
                       flash_dma_varlen_func)
from flash_dma.ops.dynamic_mask_attention import attention_reference

ROOT = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(ON_GPU, reason="the CPU interpreter's behaviour")


def _gdn_inputs(dtype, T=20, B=1):
    q = torch.nn.functional.normalize(torch.randn(B, T, 2, 16), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, 2, 16), dim=-1).to(dtype)
    v = torch.randn(B, T, 2, 16).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, 2))
    beta = torch.rand(B, T, 2).to(dtype)
    return q, k, v, g, beta


@cpu_only
def test_bf16_in_the_interpreter_is_refused_by_name():
    q = torch.randn(1, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"q: bfloat16 .*interpreter.*float16"):
        flash_dma_func(q, q, q)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"bfloat16 .*interpreter"):
        flash_dma_varlen_func(q[0], q[0], q[0], cu, cu, 16, 16)
    q, k, v, g, beta = _gdn_inputs(torch.bfloat16)
    with pytest.raises(TypeError, match=r"q: bfloat16 .*interpreter.*float16 or float32"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.raises(TypeError, match=r"q: bfloat16 .*interpreter"):
        chunk_gated_delta_rule_bwd_dhu(q, k, k, v, v)


# ------------------------------------------------------------------------------------------------
# varlen offsets: never a kernel outside its tensors, never a silently uncomputed row
# ------------------------------------------------------------------------------------------------
def _packed(total, heads=2, dim=16):
    return [torch.randn(total, heads, dim, device=DEVICE, dtype=torch.float16) for _ in range(3)]


@pytest.mark.parametrize("offsets, max_seqlen, match", [
    ([0, 30, 100], 70, r"cu_seqlens_q: the last offset 100 is past the 64 packed tokens"),
    ([0, 30, 64], 10, r"max_seqlen_q: 10 is shorter than the longest sequence in cu_seqlens_q \(34"),
    ([0, 40, 30], 40, r"cu_seqlens_q: offsets must never decrease"),
    ([3, 30, 64], 40, r"cu_seqlens_q: the first offset must be 0"),
])
def test_attention_varlen_bad_offsets_raise_by_name(offsets, max_seqlen, match):
    q, k, v = _packed(64)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flash_dma_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen)


def test_attention_varlen_bad_key_offsets_raise_by_name():
    q, k, v = _packed(64)
    good = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEVICE)
    past = torch.tensor([0, 30, 65], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_k: the last offset 65"):
        flash_dma_varlen_func(q, k, v, good, past, 34, 35)
    with pytest.raises(ValueError, match="max_seqlen_k: 33"):
        flash_dma_varlen_func(q, k, v, good, good, 34, 33)


def test_attention_varlen_offsets_changed_in_place_are_checked_again():
    q, k, v = _packed(64)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32, device=DEVICE)
    flash_dma_varlen_func(q, k, v, cu, cu, 34, 34)
    cu[2] = 90  # an in-place change moves the tensor's version: the cached check does not hold
    with pytest.raises(ValueError, match="cu_seqlens_q: the last offset 90"):
        flash_dma_varlen_func(q, k, v, cu, cu, 60, 60)


def test_attention_varlen_accepts_int64_offsets_like_the_delta_rule():
    q, k, v = _packed(41)
    cu32 = torch.tensor([0, 0, 1, 41], dtype=torch.int32, device=DEVICE)
    out32 = flash_dma_varlen_func(q, k, v, cu32, cu32, 40, 40, is_causal=True)
    out64 = flash_dma_varlen_func(q, k, v, cu32.long(), cu32.long(), 40, 40, is_causal=True)
    assert torch.equal(out32, out64)
    # the last sequence against the reference (lengths 0 and 1 come before it)
    ref, _ = attention_reference(q[None, 1:], k[None, 1:], v[None, 1:], None, None, True)
    assert rel_err(out64[1:], ref[0]) < 5e-3


@pytest.mark.parametrize("offsets, match", [
    ([0, 30, 100], r"cu_seqlens: the last offset 100 is past the 64 packed tokens"),
    ([0, 40, 30], r"cu_seqlens: offsets must never decrease"),
    ([5, 64], r"cu_seqlens: the first offset must be 0"),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_delta_rule_bad_offsets_raise_by_name(offsets, match, dtype):
    q, k, v, g, beta = (t.to(DEVICE) for t in _gdn_inputs(torch.float16, T=64))
    cu = torch.tensor(offsets, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule_bwd_dhu(q, k, k, v, v, cu_seqlens=cu)


# ------------------------------------------------------------------------------------------------
# the no-GPU bench
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(ON_GPU, reason="the no-GPU path")
@pytest.mark.parametrize("check_rc", [0, 1])
def test_no_gpu_bench_exit_code_follows_the_check(monkeypatch, tmp_path, capsys, check_rc):
    from flash_dma import cli
    monkeypatch.setattr(cli, "_run_selfcheck", lambda: check_rc)
    path = tmp_path / "r.json"
    rc = cli.main(["bench", "--json", str(path)])
    assert rc == (1 if check_rc else 0)
    data = json.loads(path.read_text())
    assert data["sections"] == []
    assert ("FAILED" if check_rc else "passed") in data["notes"][0]
    assert "nothing was timed" in capsys.readouterr().out


def test_selfcheck_fails_when_a_check_is_off_bound(monkeypatch, capsys):
    from flash_dma.benchmarks import selfcheck
    monkeypatch.setattr(selfcheck, "CHECKS", {"off": (lambda: 1.0, 1e-3), "ok": (lambda: 0.0, 1e-3)})
    assert selfcheck.main() == 1
    monkeypatch.setattr(selfcheck, "CHECKS", {"ok": (lambda: 0.0, 1e-3)})
    assert selfcheck.main() == 0


# ------------------------------------------------------------------------------------------------
# install and README
# ------------------------------------------------------------------------------------------------
def test_numpy_cap_is_a_base_dependency():
    deps = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert deps and re.search(r'"numpy\s*<\s*2\.4"', deps.group(1))


@cpu_only
def test_the_readme_cpu_line_runs_as_written():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("TRITON_INTERPRET=1 python -c")]
    assert len(lines) == 1, "the README's one-line CPU example"
    proc = subprocess.run(["bash", "-c", lines[0]], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr  # no warnings either


@cpu_only
def test_no_numpy_warning_reaches_user_code():
    q = torch.randn(1, 8, 1, 16, dtype=torch.float16)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)  # every row sees no key: log of a zero sum
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = flash_dma_func(q, q, q, attn_mask=mask)
    assert torch.equal(out, torch.zeros_like(out))


def _random_offsets(gen, total):
    """Offsets that are often wrong: past the tokens, decreasing, not starting at 0."""
    n = int(torch.randint(1, 5, (1,), generator=gen))
    lengths = torch.randint(0, total // 2 + 2, (n,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    if float(torch.rand(1, generator=gen)) < 0.2:
        cu[int(torch.randint(0, n + 1, (1,), generator=gen))] += int(torch.randint(-9, 10, (1,), generator=gen))
    return cu


@pytest.mark.gpu
def test_fuzzed_offsets_give_clear_errors_or_right_answers():
    """Random, often wrong, cu_seqlens and max_seqlen: a ValueError naming an argument, or every
    sequence right against the reference. (Run under compute-sanitizer memcheck on the GPU.)"""
    gen = torch.Generator().manual_seed(0)
    total, errors, answers = 48, 0, 0
    for _ in range(40):
        cu = _random_offsets(gen, total)
        max_seqlen = int(torch.randint(0, total + 4, (1,), generator=gen))
        q, k, v = _packed(total, dim=32)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        cu_dev = cu.to(DEVICE, torch.int32)
        try:
            out = flash_dma_varlen_func(q, k, v, cu_dev, cu_dev, max_seqlen, max_seqlen, is_causal=True)
        except ValueError as exc:
            assert re.match(r"(cu_seqlens_[qk]|max_seqlen_[qk]): ", str(exc)), str(exc)
            errors += 1
            continue
        answers += 1
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            if b > a:
                ref, _ = attention_reference(q[None, a:b], k[None, a:b], v[None, a:b], None, None, True)
                assert rel_err(out[a:b], ref[0]) < 1e-2
        gq, gk, gv, gg, gb = (t.to(DEVICE) for t in _gdn_inputs(torch.bfloat16, T=total))
        try:
            chunk_gated_delta_rule(gq, gk, gv, gg, gb, cu_seqlens=cu.to(DEVICE))
        except ValueError as exc:
            assert str(exc).startswith("cu_seqlens: "), str(exc)
    torch.cuda.synchronize()
    assert errors and answers
