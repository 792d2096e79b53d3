"""Backward variants of the gated delta rule side by side at the issue's shapes (same run, same
inputs): the fused Hopper chunk backward (gluon/backward_chunk.py, replacing the Triton bwd_dqkw
and bwd_wy passes) against those passes, and bwd_dhu forming the intra-chunk dv itself
(gdn_dhu_local_dv). Forms measured with it and removed: the one-role fused recompute
(gdn_fused_recompute, commit 2ff8691) and the one-role sequential backward
(gdn_sequential_backward, commit a70b60b). Per variant: do_bench medians of the public op's backward and forward +
backward, the kernel time of the passes that differ from one profiled step, and the gradients'
error against the first variant. The backward column is the one to read: forward + backward
builds a plan on every call while overrides are active (host time).

    python bench/gdn_fused_backward.py [--shapes 4x4096x16,1x8192x16] [--variants VARIANTS] [--out DIR]

VARIANTS: name:choice=value,...;name:... (default: triton, fused, and fused with bwd_dhu's own dv,
then also with w from T).

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
REPLACED = ("gdn_bwd_dqkw_kernel", "gdn_bwd_wy_kernel", "gdn_bwd_chunk_kernel", "gdn_bwd_dhu_kernel",
            "gdn_intra_kernel", "gdn_recompute_wu_kernel", "gdn_fwd_h_kernel")
VARIANTS = ("triton:gdn_fused_backward=0,gdn_dhu_local_dv=0,gdn_dhu_w_from_t=0;"
            "fused:gdn_fused_backward=1,gdn_dhu_local_dv=0,gdn_dhu_w_from_t=0;"
            "fused+dv:gdn_fused_backward=1,gdn_dhu_local_dv=1,gdn_dhu_w_from_t=0;"
            "fused+dv+wT:gdn_fused_backward=1,gdn_dhu_local_dv=1,gdn_dhu_w_from_t=1,gdn_backward_states_from_inverse=1")


def parse_variants(text):
    """'name:a=1,b=0;...' -> [(name, {a: True, b: False})] (0/1 as booleans, else int)."""
    out = []
    for part in text.split(";"):
        name, _, body = part.partition(":")
        chosen = {}
        for item in filter(None, body.split(",")):
            key, value = item.split("=")
            chosen[key] = bool(int(value)) if value in ("0", "1") else int(value)
        out.append((name, chosen))
    return out


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
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    env = environment()
    variants = parse_variants(args.variants)
    lines = [f"# gdn fused chunk backward | {env['device']} | torch {env['torch']} | triton {env['triton']} | "
             f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g, h0 and final state",
             "| shape | variant | bwd ms | fwd+bwd ms | dqkw, wy, chunk, dhu, intra, recompute_wu, fwd_h kernels us | bwd speedup | "
             "max rel diff of grads vs the first |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    print(lines[0], flush=True)
    for shape in args.shapes.split(","):
        B, T, H = (int(p) for p in shape.split("x"))
        x, do, dht = make(B, T, H)
        row, got = {}, {}
        for name, chosen in variants:
            with overrides(**chosen):
                got[name] = grads(x, do, dht)
                outs, douts = run(x, do, dht)
                row[name, "bwd"] = time_ms(lambda: torch.autograd.grad(outs, list(x.values()), douts,
                                                                       retain_graph=True))
                row[name, "step"] = time_ms(lambda: grads(x, do, dht))
                us = kernel_us(lambda: grads(x, do, dht))
                row[name, "kernels"] = sum(v for k, v in us.items() if any(k.startswith(n) for n in REPLACED))
        base = variants[0][0]
        for name, _ in variants:
            diff = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                       for a, b in zip(got[name], got[base]))
            bad = any(not torch.isfinite(t).all() for t in got[name])
            lines.append(f"| B{B} T{T} H{H} | {name} | {row[name, 'bwd']:.3f} | {row[name, 'step']:.3f} | "
                         f"{row[name, 'kernels']:.0f} | {row[base, 'bwd'] / row[name, 'bwd']:.2f}x | "
                         f"{diff:.1e}{' NaN/inf' if bad else ''} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "gdn_fused_backward.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
