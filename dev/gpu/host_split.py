"""Where the host time of one KDA forward + backward goes, by removing pieces: each step's
forward and backward host time (the device idle before each), as is; with every runtime.launch
a no-op (the Python around the kernels, the allocations and autograd alone; outputs are garbage);
and both again with autograd's device threads off (the backward runs in the calling thread).

    python dev/gpu/host_split.py ["B2 T4096 H16"] [--steps 30]
"""
import argparse
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import flash_dma  # noqa: E402
from flash_dma.runtime import launch as launch_module  # noqa: E402

PASSES = ("bwd_dhu", "bwd_dqkw", "bwd_wy", "gate_pairs", "key_gates", "output", "state_pass", "wy_prepare")


def launches_off():
    """Replace runtime.launch in the delta rule's Triton modules with a no-op: -> undo."""
    undo = []
    for name in PASSES:
        module = importlib.import_module(f"flash_dma.ops.gated_delta_rule.triton.{name}")
        if getattr(module, "launch", None) is launch_module.launch:
            module.launch = lambda *args, **kwargs: None
            undo.append(module)

    def restore():
        for module in undo:
            module.launch = launch_module.launch
    return restore


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="B2 T4096 H16")
    ap.add_argument("--steps", type=int, default=30)
    ns = ap.parse_args()
    B, T, H = (int(p[1:]) for p in ns.shape.split())
    K = V = 128
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gk = torch.nn.functional.logsigmoid(torch.rand(B, T, H, K, device="cuda")).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16).sigmoid().requires_grad_()
    do = torch.randn_like(v)

    def timed():
        fwd, bwd = [], []
        for _ in range(ns.steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o, _ = flash_dma.chunk_gated_delta_rule(q, k, v, None, beta, scale=K ** -0.5, gk=gk)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            o.backward(do)
            t3 = time.perf_counter()
            for leaf in (q, k, v, gk, beta):
                leaf.grad = None
            fwd.append((t1 - t0) * 1e6)
            bwd.append((t3 - t2) * 1e6)
        return statistics.median(fwd[3:]), statistics.median(bwd[3:])

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | KDA {ns.shape} K=V=128: host us, "
          f"median of {ns.steps} steps")
    print(f"  {'variant':58s} {'fwd':>7s} {'bwd':>7s}")
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for off in (False, True):
            restore = launches_off() if off else (lambda: None)
            try:
                f, b = timed()
            finally:
                restore()
            label = ("launches no-op" if off else "as is") + ("" if threads else ", autograd threads off")
            print(f"  {label:58s} {f:7.0f} {b:7.0f}")
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
