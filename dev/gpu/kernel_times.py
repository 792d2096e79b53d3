"""Per-kernel GPU times of one call of the gated delta rule (torch.profiler, several steps):
each kernel's mean duration, their sum, and the span from the first kernel's start to the last
one's end (span - sum = the GPU idle between kernels, where the host's launches are slower).

    python dev/gpu/kernel_times.py ["B1 T32768 H16" "B2 T8192 H8 K256" "B2 T4096 H16 kda" ...] [--backward]
        [--keep] [--package flash_dma_old] [--config pair_grad=32x16x4x1x168] [--choice gdn_fused_forward_gk=True]

--keep passes disable_recompute=True; --package times another copy of the package (one that
bench/make_old_package.sh made, on PYTHONPATH).

A shape: B, T, H, optionally K<n> (K = V = n) and kda (the per-key gate gk instead of g), and
with kda "strong" (a quarter of the keys decaying by e^-2.5 to e^-4 a token: every chunk takes
the gated pairs' blockwise kernels for them) or "kimi<s>" (Kimi Linear's gate as initialised,
-e^A_log softplus(x + dt_bias) with A_log = log U(1, 16) per head, dt_bias from dt log-uniform in
[1e-3, 0.1] per key, and x of standard deviation s: s = 1 leaves about one chunk in ten with a
key past the whole-chunk form, s = 2 most chunks).
"""
import argparse
import collections
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.gdn import kimi_linear_gate  # noqa: E402


def make(B, T, H, K=128, V=128, per_key=False, dtype=torch.bfloat16, strong=False, kimi=None):
    """(q, k, v, g, beta, gk): g = logsigmoid(U(0, 1)) per head (the report's decays), or with
    per_key the same per key as gk (g None; strong and kimi: as the module docstring says)."""
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype)
    gate = torch.nn.functional.logsigmoid(torch.rand(B, T, H, *((K,) if per_key else ()), device="cuda"))
    if strong:
        gate[..., : K // 4] = -torch.empty_like(gate[..., : K // 4]).uniform_(2.5, 4.0)
    if kimi is not None:
        gate = kimi_linear_gate(B, T, H, K, kimi, torch.Generator(device="cuda").manual_seed(0), "cuda")
    beta = torch.rand(B, T, H, device="cuda", dtype=dtype).sigmoid()
    leaves = [t.requires_grad_() for t in (q, k, v, gate, beta)]
    return leaves, dict(g=None, beta=leaves[4], gk=leaves[3]) if per_key else dict(g=leaves[3], beta=leaves[4])


def parse(label):
    """(B, T, H, K, per_key, strong, kimi) of a shape label."""
    parts = label.split()
    B, T, H = (int(part[1:]) for part in parts[:3])
    K = next((int(p[1:]) for p in parts[3:] if p.startswith("K")), 128)
    kimi = next((float(p[4:]) for p in parts[3:] if p.startswith("kimi")), None)
    return B, T, H, K, "kda" in parts[3:], "strong" in parts[3:], kimi


def _value(text: str):
    """A choice's value from the command line: True, False, None, an int, or the text."""
    return {"True": True, "False": False, "None": None}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["B1 T32768 H16"])
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="disable_recompute=True")
    ap.add_argument("--package", default="flash_dma")
    ap.add_argument("--config", action="append", default=[],
                    help="PASS=BKxBVxWARPSxSTAGES[xMAXREGS]: that pass's launch configuration (repeatable)")
    ap.add_argument("--choice", action="append", default=[],
                    help="NAME=VALUE: a declared choice forced, e.g. gdn_fused_forward_gk=True (repeatable)")
    ns = ap.parse_args()
    # the package timed reads its own overrides and configuration class (flash_dma_old: its copies)
    config = importlib.import_module(f"{ns.package}.runtime.config")
    GdnConfig = importlib.import_module(f"{ns.package}.ops.gated_delta_rule.launch_table").GdnConfig
    launch_configs = {f"gdn_{name}": GdnConfig(*(int(x) for x in value.split("x")))
                      for name, value in (item.split("=", 1) for item in ns.config)}
    launch_configs.update({name: _value(value) for name, value in (item.split("=", 1) for item in ns.choice)})
    chunk_gated_delta_rule = importlib.import_module(ns.package).chunk_gated_delta_rule
    keep = {"disable_recompute": True} if ns.keep else {}
    for label in ns.shapes:
        B, T, H, K, per_key, strong, kimi = parse(label)
        leaves, gates = make(B, T, H, K, K, per_key, strong=strong, kimi=kimi)
        do = torch.randn_like(leaves[2])

        def step():
            o, _ = chunk_gated_delta_rule(leaves[0], leaves[1], leaves[2], scale=K ** -0.5, **gates, **keep)
            if ns.backward:
                o.backward(do)
                for leaf in leaves:
                    leaf.grad = None
        with config.overrides(**launch_configs):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(ns.steps):
                    step()
                    torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        per = collections.defaultdict(list)
        for e in events:
            per[e.name].append(e.device_time)
        n = len(events) // ns.steps
        spans = []
        for s in range(ns.steps):
            chunk = events[s * n:(s + 1) * n]
            spans.append(max(e.time_range.end for e in chunk) - min(e.time_range.start for e in chunk))
        total = sum(sum(v) for v in per.values()) / ns.steps
        what = ("fwd+bwd" if ns.backward else "fwd") + (" kept" if ns.keep else "")
        what += "".join(f" {item}" for item in ns.config + ns.choice)
        print(f"== {ns.package} {label} {what}: {n} kernels a step, kernel sum {total:.0f} us, "
              f"span median {sorted(spans)[len(spans) // 2]:.0f} us")
        for name, times in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(times) / ns.steps:8.1f} us  x{len(times) / ns.steps:g}  {name[:90]}")
        last = events[-n:]  # the last step's timeline: where the GPU waits for the host
        t0 = last[0].time_range.start
        print("  last step: start us (idle before it) duration  kernel")
        end = t0
        for e in last:
            print(f"    {e.time_range.start - t0:8.1f} ({e.time_range.start - end:6.1f}) {e.device_time:8.1f}  {e.name[:60]}")
            end = e.time_range.end


if __name__ == "__main__":
    main()
