"""The benchmark report: formatting, geometric means, JSON, missing peers, and the no-GPU path."""
import json
import subprocess
import sys

import pytest
import torch

from flash_dma.benchmarks import attention
from flash_dma.benchmarks.common import Row, Section, format_report, geometric_mean, write_json, write_plot
from flash_dma.cli import build_parser

ENV = {"device": "Test GPU", "sm_count": 132, "capability": "9.0", "torch": "2.x", "triton": "3.x",
       "cuda": "13.0", "date": "2026-11-21 12:00 UTC"}


def synthetic_sections():
    s = Section("plain")
    s.rows = [Row("S1024 fwd", "flex", 2.0, 1.0, 1e-3, 2e-3, flops=1e12, seqlen=1024, direction="fwd"),
              Row("S2048 fwd", "flex", 8.0, 1.0, 1e-3, 2e-3, flops=4e12, seqlen=2048, direction="fwd"),
              Row("S1024 fwd", "sdpa-cudnn", 1.0, 2.0, flops=1e12, seqlen=1024, direction="fwd"),
              Row("S4096 fwd", "flash-dmattn", None, 3.0, note="refused: ValueError: head dim")]
    return [s]


def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert geometric_mean([0.5, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        geometric_mean([])


def test_report_rows_rates_and_geomeans():
    text = format_report("t", ENV, synthetic_sections())
    assert "Test GPU (132 SMs" in text and "triton 3.x" in text and "2026-11-21" in text
    assert "Config" in text and "max_abs" in text and "Speedup" in text
    lines = text.splitlines()
    s2048 = next(line for line in lines if line.startswith("S2048 fwd"))
    assert "8.00x" in s2048 and "500 TF/s" in s2048 and "4000 TF/s" in s2048  # 4e12 FLOP in 8 / 1 ms
    geo_flex = next(line for line in lines if "geometric mean vs flex" in line)
    assert "4.00x" in geo_flex  # sqrt(2 * 8)
    assert "0.50x" in next(line for line in lines if "geometric mean vs sdpa-cudnn" in line)
    refused = next(line for line in lines if line.startswith("S4096 fwd"))
    assert "n/a" in refused and "refused: ValueError" in refused


def test_json_schema(tmp_path):
    path = tmp_path / "r.json"
    write_json(str(path), "t", ENV, synthetic_sections(), ["flash-dmattn not installed"])
    data = json.loads(path.read_text())
    assert set(data) == {"title", "environment", "notes", "sections"}
    assert data["environment"]["device"] == "Test GPU" and data["notes"] == ["flash-dmattn not installed"]
    section = data["sections"][0]
    assert section["geomean_speedup"]["flex"] == pytest.approx(4.0)
    row = section["rows"][0]
    for key in ("config", "peer", "peer_ms", "ours_ms", "speedup", "max_abs", "max_rel", "flops",
                "bytes", "note", "seqlen", "direction"):
        assert key in row
    assert row["speedup"] == pytest.approx(2.0)
    assert section["rows"][3]["speedup"] is None


def test_plot_or_clear_refusal(tmp_path):
    path = tmp_path / "p.png"
    made = write_plot(str(path), "t", ENV, synthetic_sections())
    try:
        import matplotlib  # noqa: F401
        assert made and path.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert made is False


def test_missing_peer_is_a_note_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_dmattn_triton", None)  # import fails as if absent
    reason = attention.peer_available("flash-dmattn")
    assert reason is not None and "flash-dmattn" in reason
    assert attention.peer_available("sdpa-cudnn") is None


def test_cli_arguments():
    args = build_parser().parse_args(["bench", "attention", "--quick", "--json", "x.json"])
    assert args.op == "attention" and args.quick and args.json == "x.json"
    assert build_parser().parse_args(["bench"]).op == "all"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nonsense"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_no_gpu_path_checks_in_the_interpreter_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "flash_dma.cli", "bench", "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout
    assert "attention: relative error" in proc.stdout and "(ok)" in proc.stdout


def test_json_round_trip(tmp_path):
    from flash_dma.benchmarks.common import load_json
    path = tmp_path / "r.json"
    write_json(str(path), "t", ENV, synthetic_sections(), ["n"])
    title, env, sections, notes = load_json(str(path))
    assert title == "t" and env == ENV and notes == ["n"]
    assert sections[0].rows == synthetic_sections()[0].rows
