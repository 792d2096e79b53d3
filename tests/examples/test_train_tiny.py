"""examples/train_tiny.py runs end to end: three steps in the interpreter here (CI), a short
training on the GPU whose loss must fall."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_tiny.py"


def run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def written(out: Path):
    results = sorted(out.glob("train_tiny-*.json"))
    assert len(results) == 1, f"expected one result file in {out}, got {results}"
    result = json.loads(results[0].read_text())
    png = results[0].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the loss curve is not a PNG"
    return result


def test_cpu_smoke_run(tmp_path):
    import numpy
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.4 (flash-dma's own install pins it; "
                    "this environment has a newer one)")
    done = run("--cpu", "--steps", "3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = written(tmp_path)
    assert len(result["losses"]) == 3
    assert all(5.0 < loss < 6.5 for loss in result["losses"]), result["losses"]  # ~log(256) at the start
    assert result["tokens_per_s"] > 0 and result["settings"]["steps"] == 3


def test_bad_arguments_are_named():
    done = run("--steps", "0", timeout=60)
    assert done.returncode == 2 and "--steps" in done.stderr


@pytest.mark.gpu
def test_gpu_training_lowers_the_loss(tmp_path):
    done = run("--steps", "60", "--warmup", "10", "--batch-size", "8", "--seq-len", "512", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = written(tmp_path)
    assert result["final_loss"] < result["first_loss"] - 1.0, (result["first_loss"], result["final_loss"])
