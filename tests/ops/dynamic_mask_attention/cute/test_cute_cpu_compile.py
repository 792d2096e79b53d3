"""The CuTe backend's kernels compile for sm_90a without a GPU, and a new length compiles nothing.

Runs bench/cute_cpu_compile_check.py in a fresh interpreter (its target environment must be set
before FA4 is imported) over variants that between them cover the feature flags: plain bf16 D128
causal GQA varlen, plain fp16 D256 non-causal fixed-length deterministic, and the mask/bias hooks
(cute/masked.py): mask + full bias (stored dbias) and a bias per kv head (atomic dbias, grouped
heads) at bf16 D128 causal GQA, and both again without causal, keys a multiple of 8 (the bias by
TMA, dbias stored by TMA); a
batch-shared bias at fp16 D64; a key-wise mask per kv head at bf16 D256 causal. The full grid is `python bench/cute_cpu_compile_check.py` (add --pairs for the
mask/bias variants). Skipped where the hopper extra is not installed.
"""
import os
import subprocess
import sys

import pytest

from flash_dma.ops.dynamic_mask_attention.cute import availability

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "bench",
                      "cute_cpu_compile_check.py")
VARIANTS = {
    "bf16-D128-causal-gqa-varlen": (["--dims", "128", "--dtypes", "bf16", "--causal", "1", "--gqa", "4",
                                     "--varlen", "1"], 1),
    "fp16-D256-det": (["--dims", "256", "--dtypes", "fp16", "--causal", "0", "--gqa", "1", "--varlen", "0",
                       "--deterministic", "1"], 1),
    "bf16-D128-causal-gqa-mask-bias": (["--dims", "128", "--dtypes", "bf16", "--causal", "1", "--gqa", "4",
                                        "--varlen", "0", "--pairs", "mask-bias,bias-shared"], 2),
    "fp16-D64-batch-shared-bias": (["--dims", "64", "--dtypes", "fp16", "--causal", "0", "--gqa", "1",
                                    "--varlen", "0", "--pairs", "bias-shared"], 1),
    # keys a multiple of 8: the forward takes the bias by TMA (cute/forward_bias_tma.py), the
    # backward loads it by TMA and stores dbias by TMA where it has one writer per entry
    # (cute/backward_bias_tma.py); GQA with the bias per query head and shared by all heads
    "bf16-D128-gqa-tma-bias": (["--dims", "128", "--dtypes", "bf16", "--causal", "0", "--gqa", "4",
                                "--varlen", "0", "--pairs", "bias,bias-shared", "--key-multiple", "8"], 2),
    "bf16-D256-causal-gqa-keywise-mask": (["--dims", "256", "--dtypes", "bf16", "--causal", "1", "--gqa", "4",
                                           "--varlen", "0", "--pairs", "mask-keys"], 1),
}


@pytest.fixture(scope="module")
def cute_stack():
    status = availability.software_status()
    if status is not None:
        pytest.skip(f"CuTe DSL stack not installed: {status}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_for_sm90a_without_a_gpu(cute_stack, name):
    args, count = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("FLASH_ATTENTION_ARCH", "CUTE_DSL_ARCH")}
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                            timeout=900)
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert f"{count} passed, 0 failed" in result.stdout, report
    assert result.stdout.count("new lengths compiled 0") == count, report
    assert result.stdout.count("sm_90a cubins yes") == count, report
