"""Test setup: the real kernels run on a GPU when there is one, else in Triton's interpreter.

TRITON_INTERPRET must be set before triton is imported, so it is decided here, first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist the workers share the machine's cores: each takes its share of torch's
# threads (idle threads that spin waiting for work multiply the CPU time of the interpreter's small
# products when every core runs a worker).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter's bf16 tl.dot is wrong in Triton 3.6 (it multiplies raw bit patterns), so the CPU
# runs fp16; the GPU runs both.
DTYPES = (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16,)


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (pytest -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every torch.empty / empty_like during a test comes back full of NaN (or -1 for ints), so an
    output element a kernel forgot to write cannot pass for a right answer."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs per test run, but printed, so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")  # a failure's report shows its captured output
    yield seed
