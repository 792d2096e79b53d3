"""The CuTe backend's kernels compile for sm_90a without a GPU, and a new length compiles nothing.

Runs bench/cute_cpu_compile_check.py in a fresh interpreter (its target environment must be set
before FA4 is imported) over variants that between them cover the feature flags: plain bf16 D128
causal GQA varlen, plain fp16 D256 non-causal fixed-length deterministic, and the mask/bias hooks
(cute/masked.py): mask + full bias (stored dbias) and a bias per kv head (atomic dbias, grouped
heads) at bf16 D128 causal GQA, and both again without causal, keys a multiple of 8 (the bias by
TMA, dbias stored by TMA); a
batch-shared bias at fp16 D64; a key-wise mask per kv head at bf16 D256 causal. The full grid is `python bench/cute_cpu_compile_check.py` (add --pairs for the
mask/bias variants). Then the warpgroup MMAs of the plain and TMA bias kernels are checked in
their SASS for the serialisation ptxas falls back to when short of registers (it does not say so
through the DSL). Skipped where the hopper extra is not installed.
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


def _cuobjdump():
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _mma_counts(cubin_dir):
    """{cubin: (warpgroup MMA instructions, waits for them)} from each dumped cubin's SASS."""
    counts = {}
    for name in sorted(os.listdir(cubin_dir)):
        if not name.endswith(".cubin"):
            continue
        sass = subprocess.run([_cuobjdump(), "-sass", os.path.join(cubin_dir, name)], capture_output=True,
                              text=True, timeout=300)
        assert sass.returncode == 0 and "Function" in sass.stdout, f"cuobjdump failed on {name}: {sass.stderr}"
        counts[name[:120]] = (sass.stdout.count("HGMMA."), sass.stdout.count("WARPGROUP.DEPBAR"))
    return counts


SERIALISED = "ptxas serialises this backward's warpgroup MMAs (docs/perf/attention.md, section 0)"
# One head dim and one mask/bias pair each: the dumped cubins are named by class, not by
# variant, so a second variant in one directory would overwrite the first.
MMA_VARIANTS = [
    # the TMA bias paths at both head dims they serve (the D128 backward was serialised while
    # the dbias store's wait sat in the score-gradient hook)
    pytest.param(["--dims", "64", "--pairs", "bias", "--key-multiple", "8"], id="tma-bias-bf16-D64"),
    pytest.param(["--dims", "128", "--pairs", "bias", "--key-multiple", "8"], id="tma-bias-bf16-D128"),
    # a bias broadcast along queries, read per key before each round, with and without its dbias
    # summed per key (cute/backward_bias.py; serialised at D128 while the bias was read in the
    # score hook)
    pytest.param(["--dims", "64", "--pairs", "bias-keys"], id="key-bias-bf16-D64"),
    pytest.param(["--dims", "128", "--pairs", "bias-keys"], id="key-bias-bf16-D128"),
    pytest.param(["--dims", "128", "--pairs", "bias-keys-dbias"], id="key-bias-dbias-bf16-D128"),
    # known: work per element of dS in the score-gradient hook, while the round's fp32 dS is in
    # registers: the dbias sums at D64, the per-element atomic dbias of a shared bias, and the
    # per-element dbias store where TMA cannot take the bias (keys not a multiple of 8)
    pytest.param(["--dims", "64", "--pairs", "bias-keys-dbias"], id="key-bias-dbias-bf16-D64",
                 marks=pytest.mark.xfail(strict=True, reason=SERIALISED)),
    pytest.param(["--dims", "128", "--pairs", "bias-shared"], id="shared-bias-atomic-bf16-D128",
                 marks=pytest.mark.xfail(strict=True, reason=SERIALISED)),
    pytest.param(["--dims", "128", "--pairs", "bias"], id="bias-per-element-bf16-D128",
                 marks=pytest.mark.xfail(strict=True, reason=SERIALISED)),
]


@pytest.mark.parametrize("args", MMA_VARIANTS)
def test_warpgroup_mma_not_serialised(cute_stack, tmp_path, args):
    """No kernel waits after (almost) every warpgroup MMA: what ptxas emits when it serialises
    them (its C7510-C7515 notes, which the DSL's compile does not print). FA4's own SM90
    kernels wait 4-6 times for 24-51 HGMMA."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASH_ATTENTION_ARCH", "CUTE_DSL_ARCH", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")}
    env.update(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, SCRIPT, *args, "--dtypes", "bf16", "--causal", "0", "--gqa", "1",
                             "--varlen", "0"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    counts = _mma_counts(tmp_path)
    with_mmas = {name: c for name, c in counts.items() if c[0] >= 8}
    assert len(with_mmas) == 2, f"expected the forward and backward kernels with warpgroup MMAs: {counts}"
    serialised = {name: c for name, c in with_mmas.items() if c[1] * 2 > c[0]}
    assert not serialised, f"warpgroup MMAs serialised (kernel: HGMMA count, waits): {serialised}"
