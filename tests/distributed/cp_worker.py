"""One rank of the context-parallel tests: runs every case on its shards, saves outputs and
gradients for the parent to assemble and compare with the one-process call."""
from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_cases  # noqa: E402


def _poison_empty():
    """As the tests' conftest does: fresh buffers full of NaN, so an unwritten output cannot pass."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))


def run_rank(rank: int, world_size: int, init_file: str, out_dir: str, case_names: list[str], seed: int,
             backend: str):
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    # a rank that fails leaves the others waiting in a collective: give up after a while
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120 if backend == "gloo" else 600))
    _poison_empty()
    if backend == "gloo":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    results = {}
    try:
        for name in case_names:
            case = cp_cases.case_by_name(name)
            x, w = cp_cases.make_inputs(case, seed, device, cp_cases.dtype_for(case, backend == "nccl"))
            local = {n: cp_cases.local_part(case, n, t.detach(), world_size, rank).clone().requires_grad_(
                t.requires_grad) for n, t in x.items()}
            try:
                outputs = cp_cases.run_cp(case, local, device)
                weights = {n: cp_cases.local_part(case, n, wt, world_size, rank) for n, wt in w.items()}
                cp_cases.loss_of(outputs, weights).backward()
                results[name] = dict(
                    outputs={n: o.detach().cpu() for n, o in outputs.items()},
                    grads={n: t.grad.cpu() for n, t in local.items() if t.grad is not None})
            except Exception:  # reported by the parent as this case's failure
                results[name] = dict(error=traceback.format_exc())
                raise
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
