"""The fused Hopper chunk backward of the gated delta rule (gluon/backward_chunk.py, replacing the
Triton bwd_dqkw and bwd_wy passes) beside those passes, at the issue's shapes: do_bench medians of
the public op's backward and forward + backward with the fusion forced on and off (same run, same
inputs), the kernel times of the replaced passes from one profiled step, and the gradients' error
between the two paths. The backward column is the one to read: forward + backward builds a plan
on every call while overrides are active (host time).

    python bench/gdn_fused_backward.py [--shapes 4x4096x16,1x8192x16] [--out DIR]

bf16, K = V = 128, scalar gate g, initial and final state; the fused forward as the plan picks it.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

SHAPES = ((4, 4096, 16), (1, 8192, 16), (1, 32768, 16), (8, 4096, 32))
REPLACED = ("gdn_bwd_dqkw_kernel", "gdn_bwd_wy_kernel", "gdn_bwd_chunk_kernel")


def make(B, T, H, K=128, V=128):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    leaves = dict(q=F.normalize(randn(B, T, H, K), dim=-1).bfloat16(), k=F.normalize(randn(B, T, H, K), dim=-1).bfloat16(),
                  v=randn(B, T, H, V).bfloat16(), g=F.logsigmoid(randn(B, T, H) + 2),
                  beta=torch.rand(B, T, H, device="cuda", generator=gen).sigmoid().bfloat16(),
                  h0=randn(B, H, K, V) * 0.1)
    for t in leaves.values():
        t.requires_grad_()
    return leaves, randn(B, T, H, V).bfloat16(), randn(B, H, K, V)


def run(x, do, dht):
    o, ht = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                   output_final_state=True)
    return (o, ht), (do, dht)


def grads(x, do, dht):
    outs, douts = run(x, do, dht)
    return torch.autograd.grad(outs, list(x.values()), douts)


def kernel_us(fn):
    """{kernel name: device us} of one call of fn."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time_total
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    env = environment()
    forms = (False, True)
    lines = [f"# gdn fused chunk backward | {env['device']} | torch {env['torch']} | triton {env['triton']} | "
             f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g, h0 and final state",
             "| shape | form | bwd ms | fwd+bwd ms | replaced kernels us | bwd speedup | max rel diff of grads vs Triton |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    print(lines[0], flush=True)
    for shape in args.shapes.split(","):
        B, T, H = (int(p) for p in shape.split("x"))
        x, do, dht = make(B, T, H)
        row, got = {}, {}
        for form in forms:
            with overrides(gdn_fused_backward=form):
                got[form] = grads(x, do, dht)
                outs, douts = run(x, do, dht)
                row[form, "bwd"] = time_ms(lambda: torch.autograd.grad(outs, list(x.values()), douts,
                                                                       retain_graph=True))
                row[form, "step"] = time_ms(lambda: grads(x, do, dht))
                us = kernel_us(lambda: grads(x, do, dht))
                row[form, "kernels"] = sum(v for k, v in us.items() if any(k.startswith(n) for n in REPLACED))
        for form in forms:
            diff = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                       for a, b in zip(got[form], got[False]))
            bad = any(not torch.isfinite(t).all() for t in got[form])
            lines.append(f"| B{B} T{T} H{H} | {'fused' if form else 'Triton passes'} | {row[form, 'bwd']:.3f} | {row[form, 'step']:.3f} | "
                         f"{row[form, 'kernels']:.0f} | {row[False, 'bwd'] / row[form, 'bwd']:.2f}x | "
                         f"{diff:.1e}{' NaN/inf' if bad else ''} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "gdn_fused_backward.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
