"""Host time of one call of the public ops, and which of its kernel launches take Triton's own
launch path (binding and specialising every argument, tens of microseconds each) instead of
runtime.launch's replay of a known signature.

    python bench/host_launches.py [--steps 20] [--profile] [--breakdown] [--out DIR] [--cases fwd,bwd_dhu]

Per case: the host time of one step (forward + backward, or the one function), timed from the
call to its return with the device idle before it (median of --steps samples); the GPU time of
the same step (do_bench median, which the host sets where it is the larger); the kernels one
step launches (torch.profiler); and the launches per step that went through Triton's
JITFunction.run, by kernel name (0 for every kernel once warm is the aim: runtime.launch
replays the rest). Writes DIR/host-launches-<device>-<date>.txt; with --profile also the
Python functions that take the host time of each case (cProfile, by own time) beside it; with
--breakdown the host time per step inside each of a few functions (launches, allocations,
checks, plans, the forward and backward passes), timed around them without a profiler's
per-call cost.
"""
import argparse
import collections
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SLOW_PATH = collections.Counter()
_triton_run = JITFunction.run


def _counting_run(self, *args, **kwargs):
    SLOW_PATH[getattr(self, "__name__", None) or self.fn.__name__] += 1
    return _triton_run(self, *args, **kwargs)


def gdn_step(B, T, H, K, V, dtype=torch.bfloat16, backward=True, per_key=False):
    """per_key: the per-key gate gk (KDA) in place of g."""
    from flash_dma import chunk_gated_delta_rule
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", dtype=torch.float32), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype)
    g = -torch.rand(B, T, H, *((K,) if per_key else ()), device="cuda", dtype=torch.float32) * 0.1
    beta = torch.rand(B, T, H, device="cuda", dtype=dtype)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    do = torch.randn_like(v)
    gates = {"g": None, "gk": leaves[3]} if per_key else {"g": leaves[3]}

    def step():
        o, _ = chunk_gated_delta_rule(*leaves[:3], beta=leaves[4], scale=K ** -0.5, **gates)
        if not backward:  # a training forward: inputs need grads, the graph is dropped
            return
        o.backward(do)
        for leaf in leaves:  # as after optimizer.zero_grad(): no accumulation kernels
            leaf.grad = None
    return step


def dhu_step(B, T, H, K, V, dtype=torch.bfloat16):
    from flash_dma import chunk_gated_delta_rule_bwd_dhu
    torch.manual_seed(0)
    q, k, w = (torch.randn(B, T, H, K, device="cuda", dtype=dtype) * 0.1 for _ in range(3))
    do, dv = (torch.randn(B, T, H, V, device="cuda", dtype=dtype) for _ in range(2))
    return lambda: chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv)


def attention_step(B, S, H, D, dtype=torch.bfloat16):
    from flash_dma import flash_dma_func
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(B, H, S, S, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.rand(B, 1, S, S, device="cuda") < 0.5

    def step():
        flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True).sum().backward()
        for leaf in (q, k, v, bias):
            leaf.grad = None
    return step


CASES = {
    "gdn fwd+bwd B4 T4096 H16 K=V=128": lambda: gdn_step(4, 4096, 16, 128, 128),
    "gdn fwd+bwd B1 T8192 H16 K=V=128": lambda: gdn_step(1, 8192, 16, 128, 128),
    "gdn fwd+bwd B1 T256 H4 K=V=64": lambda: gdn_step(1, 256, 4, 64, 64),
    "gdn fwd+bwd KDA B2 T4096 H16 K=V=128": lambda: gdn_step(2, 4096, 16, 128, 128, per_key=True),
    "gdn fwd B1 T32768 H16 K=V=128": lambda: gdn_step(1, 32768, 16, 128, 128, backward=False),
    "gdn fwd+bwd B1 T32768 H16 K=V=128": lambda: gdn_step(1, 32768, 16, 128, 128),
    "bwd_dhu B1 T2048 H16 K=V=128 (mode A)": lambda: dhu_step(1, 2048, 16, 128, 128),
    "attention fwd+bwd B2 S128 H4 D64 mask+bias causal": lambda: attention_step(2, 128, 4, 64),
}


def kernels_per_step(step) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def host_profile(name, step, steps) -> str:
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return f"== {name}: {steps} steps\n{text.getvalue()}"


class Timed:
    """Wraps module attributes so that each call's host time adds to a total per label."""

    def __init__(self):
        self.totals = collections.Counter()
        self.calls = collections.Counter()
        self._undo = []

    def wrap(self, owner, attr: str, label: str):
        original = getattr(owner, attr)
        totals, calls = self.totals, self.calls

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def restore(self):
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def breakdown(name, step, steps) -> str:
    import importlib
    import pkgutil

    import flash_dma
    from flash_dma.runtime import launch as launch_module
    timed = Timed()
    for info in pkgutil.walk_packages(flash_dma.__path__, "flash_dma."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # optional backends (CuTe) may not import here
            continue
        if getattr(module, "launch", None) is launch_module.launch and info.name != "flash_dma.runtime.launch":
            timed.wrap(module, "launch", "runtime.launch (Triton / Gluon launches)")
    for attr in ("empty", "empty_like", "zeros", "zeros_like", "full"):
        timed.wrap(torch, attr, "torch allocations")
    from flash_dma.ops.gated_delta_rule import autograd as gdn_autograd
    from flash_dma.ops.gated_delta_rule import interface as gdn_interface
    timed.wrap(gdn_interface, "check_op_inputs", "gdn checks")
    timed.wrap(gdn_autograd, "plan_call", "gdn plan_call")
    timed.wrap(gdn_autograd, "run_forward", "gdn run_forward (all of the forward's work)")
    timed.wrap(gdn_autograd, "run_backward", "gdn run_backward (all of the backward's work)")
    try:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        timed.totals.clear()
        timed.calls.clear()
        whole = 0.0
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            whole += time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        timed.restore()
    lines = [f"== {name}: host us per step, {steps} steps (the wrappers' own cost included)",
             f"  whole step: {whole / steps * 1e6:.0f}"]
    for label, total in timed.totals.most_common():
        lines.append(f"  {label}: {total / steps * 1e6:.0f} in {timed.calls[label] / steps:g} calls")
    return "\n".join(lines)


def measure(name, make, steps, profiles=None, breakdowns=None):
    step = make()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    SLOW_PATH.clear()
    host = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    slow = {n: c / steps for n, c in SLOW_PATH.most_common()}
    gpu_ms = triton.testing.do_bench(step, warmup=5, rep=50)
    if profiles is not None:
        profiles.append(host_profile(name, step, steps))
    if breakdowns is not None:
        breakdowns.append(breakdown(name, step, steps))
    return (f"| {name} | {statistics.median(host):.0f} | {gpu_ms * 1e3:.0f} | {kernels_per_step(step)} | "
            + (", ".join(f"{n} x{c:g}" for n, c in slow.items()) or "none") + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also where each case's host time goes")
    parser.add_argument("--breakdown", action="store_true", help="also host time inside a few functions")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--cases", default=None, help="only the cases whose names contain one of these, comma-separated")
    args = parser.parse_args()
    cases = {name: make for name, make in CASES.items()
             if args.cases is None or any(part in name for part in args.cases.split(","))}
    JITFunction.run = _counting_run
    name = torch.cuda.get_device_name()
    when = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"# host time and launch paths | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{when:%Y-%m-%d %H:%M} UTC",
             "| case | host us per step | GPU-timed us per step | kernels per step | Triton-path launches per step |",
             "| --- | --- | --- | --- | --- |"]
    profiles = [] if args.profile else None
    breakdowns = [] if args.breakdown else None
    for case, make in cases.items():
        try:
            lines.append(measure(case, make, args.steps, profiles, breakdowns))
        except Exception as exc:  # one case's failure should not hide the others'
            lines.append(f"| {case} | failed: {type(exc).__name__}: {str(exc)[:200]} | | | |")
        print(lines[-1], flush=True)
    path = os.path.join(args.out, f"host-launches-{name.replace(' ', '-')}-{when:%Y%m%d}.txt")
    if breakdowns:
        lines += ["", *breakdowns]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    if profiles:
        with open(path.replace(".txt", "-profile.txt"), "w") as f:
            f.write("\n".join(profiles))
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
