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

# Bounds as multiples of TOLERANCE[dtype]: the split calls chunk and tile the sequence differently
# from the one-process call, so results differ by rounding only.
OUTPUT_SCALE, GRAD_SCALE = 1.0, 2.0


def _spawn(world_size: int, case_names: list[str], seed: int, tmp_path, backend: str) -> list[dict]:
    init_file = tmp_path / "init"
    mp.spawn(cp_worker.run_rank, args=(world_size, str(init_file), str(tmp_path), case_names, seed, backend),
             nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def _compare(case, ranks: list[dict], seed: int, device, dtype):
    for r, res in enumerate(ranks):
        assert "error" not in res[case.name], f"rank {r} failed:\n{res[case.name]['error']}"
    x, w = cp_cases.make_inputs(case, seed, device, dtype)
    outputs = cp_cases.run_single(case, x, device)
    cp_cases.loss_of(outputs, w).backward()
    errors, failures = {}, []
    expected = {n: o.detach() for n, o in outputs.items()}
    expected.update({f"d{n}": t.grad for n, t in x.items() if t.grad is not None})
    got = {n: cp_cases.assemble(case, n, [res[case.name]["outputs"][n] for res in ranks]) for n in outputs}
    got.update({f"d{n}": cp_cases.assemble(case, n, [res[case.name]["grads"][n] for res in ranks])
                for n, t in x.items() if t.grad is not None})
    tol_dtype = torch.float16 if (dtype == torch.float32 and ON_GPU) else dtype
    for name, want in expected.items():
        assert got[name].shape == want.shape, f"{name}: shape {tuple(got[name].shape)} != {tuple(want.shape)}"
        errors[name] = rel_err(got[name], want.cpu())
        bound = TOLERANCE[tol_dtype] * (GRAD_SCALE if name.startswith("d") else OUTPUT_SCALE)
        if errors[name] > bound:
            failures.append(f"{name} {errors[name]:.1e} > {bound:.0e}")
    summary = ", ".join(f"{n}={e:.1e}" for n, e in errors.items())
    assert not failures, f"{case.name}: {'; '.join(failures)} (all: {summary})"
    assert set(expected) >= {"o", "dq", "dk", "dv"}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def cpu_runs(request, tmp_path_factory):
    """Every CPU case on 2 or 3 gloo ranks, spawned once per world size."""
    if ON_GPU:
        pytest.skip("the CPU runs (gloo, interpreter) are for machines without a GPU")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"context-parallel seed {seed}")
    names = [c.name for c in cp_cases.CPU_CASES]
    ranks = _spawn(request.param, names, seed, tmp_path_factory.mktemp(f"cp{request.param}"), "gloo")
    return seed, ranks


@pytest.mark.parametrize("index", range(len(cp_cases.CPU_CASES)), ids=[c.name for c in cp_cases.CPU_CASES])
def test_cp_matches_one_process(cpu_runs, index):
    seed, ranks = cpu_runs
    case = cp_cases.CPU_CASES[index]
    _compare(case, ranks, seed + index, "cpu", cp_cases.dtype_for(case, False))


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
    for index, case in enumerate(cp_cases.GPU_CASES):
        _compare(case, ranks, seed + index, "cuda:0", cp_cases.dtype_for(case, True))
