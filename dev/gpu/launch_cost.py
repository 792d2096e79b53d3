"""Host cost of one kernel launch by each path, for a kernel with as many arguments as the gated
delta rule's (about 25 tensors and scalars): Triton's own `kernel[grid](...)`, flash-dma's
`runtime.launch` replay, and the pieces of that replay (the signature key, the driver's device and
stream queries, the C launch alone), from the main thread and from a second thread. Launches are
queued without synchronising, so each figure is host time only.

    python dev/gpu/launch_cost.py [--n 2000]
"""
import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flash_dma.runtime import launch as L  # noqa: E402


@triton.jit
def many_args_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, n0, n1, n2,
                     s0, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    pid = tl.program_id(0)
    if pid == n0 + n1 + n2 + 1_000_000:  # never true: the arguments stay live, nothing runs
        tl.store(a0 + pid, tl.load(a1 + pid) * s0)


def per_call(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ns = ap.parse_args()
    tensors = [torch.empty(1024, device="cuda") for _ in range(18)]
    args = (*tensors, 64, 4096, 16, 0.5)
    kw = dict(C0=1, C1=2, C2=True, C3=None, num_warps=4, num_stages=2)
    grid = (64, 32)
    L.launch(many_args_kernel, grid, *args, **kw)  # compiles and remembers
    L.launch(many_args_kernel, grid, *args, **kw)
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    key = L.signature_key(many_args_kernel, args, kw, device)
    entry = L._ENTRIES[key]
    compiled = entry.compiled
    stream = driver.get_current_stream(device)
    full = args + entry.tail
    rows = [
        ("Triton kernel[grid](...)", lambda: many_args_kernel[grid](*args, **kw)),
        ("runtime.launch (replay)", lambda: L.launch(many_args_kernel, grid, *args, **kw)),
        ("  signature_key alone", lambda: L.signature_key(many_args_kernel, args, kw, device)),
        ("  driver device + stream", lambda: driver.get_current_stream(driver.get_current_device())),
        ("  C launch alone" + ("" if entry.direct else " (via compiled.run: scratch wrapper)"),
         (lambda: entry.direct(64, 32, 1, stream, compiled.function, entry.cooperative, entry.pdl, None, None,
                               compiled.packed_metadata, None, None, None, *full)) if entry.direct else
         (lambda: compiled.run(64, 32, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                               *full))),
        ("torch.empty(1 MiB, cuda)", lambda: torch.empty(1 << 18, device="cuda")),
        ("torch.empty_like", lambda: torch.empty_like(tensors[0])),
    ]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}: "
          f"host us per call, {ns.n} calls, from the main thread / from another thread (as autograd's "
          f"device threads run a backward)")
    for label, fn in rows:
        per_call(fn, 200)
        main_us = per_call(fn, ns.n)
        other = {}

        def in_thread():
            torch.cuda.set_device(device)
            per_call(fn, 200)
            other["us"] = per_call(fn, ns.n)
        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join()
        print(f"  {label:55s} {main_us:7.2f} / {other['us']:7.2f}")

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            return inputs[0].clone()

        @staticmethod
        def backward(ctx, grad):
            return (grad,) + (None,) * 4

    leaves = [torch.randn(1024, device="cuda", requires_grad=True) for _ in range(5)]
    seed = torch.ones(1024, device="cuda")

    def round_trip():
        Identity.apply(*leaves).backward(seed)
        leaves[0].grad = None
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        per_call(round_trip, 200)
        print(f"  autograd Function round trip (forward + backward), device threads {'on' if threads else 'off'}: "
              f"{per_call(round_trip, ns.n):7.2f}")
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
