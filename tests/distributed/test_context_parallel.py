"""Context parallelism (flash_dma.distributed) against the one-process call: 2 and 3 ranks as
processes (gloo on the CPU, in Triton's interpreter; NCCL on GPUs), every output and every
gradient, for both ops: packed sequences running through several ranks, initial and final
states, per-key gates, masks and biases (key-wise, by query rows), causal (zigzag), GQA."""
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from conftest import ON_GPU
from helpers import TOLERANCE, rel_err

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_cases  # noqa: E402
import cp_worker  # noqa: E402

# Bounds as multiples of TOLERANCE[dtype] (a bound against fp64): the split calls chunk and tile the
# sequence differently from the one-process call, so the two differ by rounding only, each within
# TOLERANCE of fp64; bf16 (GPU) gets that difference's full width.
SCALES = {torch.float16: (1.0, 2.0), torch.float32: (1.0, 2.0), torch.bfloat16: (2.0, 3.0)}  # (outputs, grads)
_SINGLE: dict = {}  # (case, seed) -> the one-process outputs and gradients


# The ranks run side by side: one thread each (BLAS threads that spin while they wait for work
# multiply the CPU time of the interpreter's small matrix products on a shared machine).
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _spawn(world_size: int, case_names: list[str], seed: int, tmp_path, backend: str) -> list[dict]:
    init_file = tmp_path / "init"
    saved = {k: os.environ.get(k) for k in _ONE_THREAD}
    os.environ.update(_ONE_THREAD)  # read by the spawned ranks as they start
    try:
        mp.spawn(cp_worker.run_rank, args=(world_size, str(init_file), str(tmp_path), case_names, seed, backend),
                 nprocs=world_size, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def _compare(case, ranks: list[dict], seed: int, device, dtype):
    for r, res in enumerate(ranks):
        assert "error" not in res[case.name], f"rank {r} failed:\n{res[case.name]['error']}"
    key = (case.name, seed)
    if key not in _SINGLE:
        x, w = cp_cases.make_inputs(case, seed, device, dtype)
        outputs = cp_cases.run_single(case, x, device)
        cp_cases.loss_of(outputs, w).backward()
        expected = {("outputs", n): o.detach().cpu() for n, o in outputs.items()}
        expected.update({("grads", n): t.grad.cpu() for n, t in x.items() if t.grad is not None})
        _SINGLE[key] = expected
    expected = _SINGLE[key]
    assert {("outputs", "o"), ("grads", "q"), ("grads", "k"), ("grads", "v")} <= set(expected)
    errors, failures = {}, []
    tol_dtype = torch.float16 if (dtype == torch.float32 and ON_GPU) else dtype
    for (part, name), want in expected.items():
        label = name if part == "outputs" else f"d{name}"
        got = cp_cases.assemble(case, name, [res[case.name][part][name] for res in ranks])
        assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if name == "lse":  # rows that see no key: +inf on both sides; the others compared
            assert not torch.isnan(got).any(), "lse: NaN"
            assert torch.equal(torch.isinf(got), torch.isinf(want)), "lse: +inf rows differ"
            got, want = got[torch.isfinite(want)], want[torch.isfinite(want)]
        errors[label] = rel_err(got, want)
        bound = TOLERANCE[tol_dtype] * SCALES[tol_dtype][part == "grads"]
        if errors[label] > bound:
            failures.append(f"{label} {errors[label]:.1e} > {bound:.0e}")
    summary = ", ".join(f"{n}={e:.1e}" for n, e in errors.items())
    print(f"{case.name} on {len(ranks)} ranks: {summary}")
    assert not failures, f"{case.name}: {'; '.join(failures)} (all: {summary})"


# One seed per session, so that both world sizes share the one-process results.
_SEED = int.from_bytes(os.urandom(4), "little")


_RUNS = [(world, case) for world in (2, 3) for case in cp_cases.CPU_CASES if world in case.worlds]
_SPAWNED: dict = {}  # world size -> every rank's results (spawned once per world size)


def _cpu_runs(world: int, tmp_path_factory) -> list[dict]:
    """The CPU cases of a world size on that many gloo ranks."""
    if world not in _SPAWNED:
        print(f"context-parallel seed {_SEED}")
        names = [c.name for c in cp_cases.CPU_CASES if world in c.worlds]
        _SPAWNED[world] = _spawn(world, names, _SEED, tmp_path_factory.mktemp(f"cp{world}"), "gloo")
    return _SPAWNED[world]


# Under pytest-xdist (--dist loadgroup) a world size's cases stay on one worker: one spawn each.
@pytest.mark.skipif(ON_GPU, reason="the CPU runs (gloo, interpreter) are for machines without a GPU")
@pytest.mark.parametrize("world, case", [pytest.param(w, c, marks=pytest.mark.xdist_group(f"cp-{w}-ranks"))
                                         for w, c in _RUNS], ids=[f"{w}-ranks-{c.name}" for w, c in _RUNS])
def test_cp_matches_one_process(world, case, tmp_path_factory):
    _compare(case, _cpu_runs(world, tmp_path_factory), _SEED, "cpu", cp_cases.dtype_for(case, False))


@pytest.mark.gpu
def test_gpu_cp_matches_one_process(tmp_path):
    """NCCL over every GPU of the machine (2 or more), real sizes, bf16."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs two or more GPUs")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"context-parallel seed {seed}")
    names = [c.name for c in cp_cases.GPU_CASES]
    ranks = _spawn(world, names, seed, tmp_path, "nccl")
    for case in cp_cases.GPU_CASES:
        _compare(case, ranks, seed, "cuda:0", cp_cases.dtype_for(case, True))
