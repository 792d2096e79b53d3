"""The CuTe backend's kernels compile for sm_90a without a GPU, and a new length compiles nothing.

Runs bench/cute_cpu_compile_check.py in a fresh interpreter (its target environment must be set
before FA4 is imported) over two variants that between them cover the feature flags: bf16 D128
causal GQA varlen, and fp16 D256 non-causal fixed-length deterministic. The full grid is
`python bench/cute_cpu_compile_check.py`. Skipped where the hopper extra is not installed.
"""
import os
import subprocess
import sys

import pytest

from flash_dma.ops.dynamic_mask_attention.cute import availability

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "bench",
                      "cute_cpu_compile_check.py")
VARIANTS = [
    ["--dims", "128", "--dtypes", "bf16", "--causal", "1", "--gqa", "4", "--varlen", "1"],
    ["--dims", "256", "--dtypes", "fp16", "--causal", "0", "--gqa", "1", "--varlen", "0",
     "--deterministic", "1"],
]


@pytest.fixture(scope="module")
def cute_stack():
    status = availability.software_status()
    if status is not None:
        pytest.skip(f"CuTe DSL stack not installed: {status}")


@pytest.mark.parametrize("args", VARIANTS, ids=["bf16-D128-causal-gqa-varlen", "fp16-D256-det"])
def test_compiles_for_sm90a_without_a_gpu(cute_stack, args):
    env = {k: v for k, v in os.environ.items() if k not in ("FLASH_ATTENTION_ARCH", "CUTE_DSL_ARCH")}
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                            timeout=900)
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert "1 passed, 0 failed" in result.stdout, report
    assert "new lengths compiled 0" in result.stdout and "sm_90a cubins yes" in result.stdout, report
