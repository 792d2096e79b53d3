"""Sweep launch configurations of the attention kernels on this GPU.

    python bench/tune_attention.py [--head-dims 64 128 256] [--variants plain bias] [--out FILE]

Each kernel is timed with each candidate (the others keep their current choice) on a
representative shape; winners go to the persistent tuning cache (flash_dma.runtime.tuning_cache), every
timing to its profiling log, and a summary to --out so that the launch table
(flash_dma/ops/dynamic_mask_attention/launch_table.py) can be updated from it.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma import flash_dma_func  # noqa: E402
from flash_dma.runtime import config  # noqa: E402
from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.ops.dynamic_mask_attention import autograd, launch_table  # noqa: E402

C = config.LaunchConfig
CANDIDATES = {
    "attn_fwd": [C(128, 64, 8, 3), C(128, 64, 8, 2), C(128, 128, 8, 2), C(128, 128, 8, 3), C(128, 64, 4, 3),
                 C(128, 64, 8, 3, exp2_poly=True), C(128, 64, 4, 3, exp2_poly=True),
                 C(128, 128, 8, 2, exp2_poly=True), C(64, 64, 4, 3)],
    "attn_bwd_dkdv": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 64, 4, 3), C(32, 64, 4, 3),
                      C(128, 64, 8, 2), C(64, 128, 8, 2), C(32, 128, 8, 2), C(32, 128, 8, 3), C(128, 32, 4, 2),
                      C(32, 32, 4, 2), C(64, 32, 4, 2), C(32, 64, 8, 2), C(64, 32, 8, 2)],
    "attn_bwd_dq": [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 3), C(64, 64, 4, 3),
                    C(64, 128, 8, 2), C(128, 128, 8, 2), C(64, 32, 4, 3), C(128, 64, 4, 2),
                    C(64, 64, 8, 1), C(64, 32, 8, 2), C(32, 64, 4, 2)],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--variants", nargs="+", default=["bias", "plain"])
    parser.add_argument("--out", default="tuning-summary.json")
    parser.add_argument("--kernels", nargs="+", default=list(CANDIDATES))
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    summary = {"environment": environment(), "results": []}
    for d in args.head_dims:
        for variant in args.variants:
            H = 16 if d <= 128 else 8
            B, S = 2, 4096
            q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            bias = (torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    if variant == "bias" else None)
            leaves = [q, k, v] + ([bias] if bias is not None else [])
            dout = torch.randn_like(q)
            for kernel in args.kernels:
                cands = CANDIDATES[kernel]
                requested = {}  # the variant the op asks for (e.g. "plain-dq" with fused dq)

                def time_config(cfg, kernel=kernel, measure=True):
                    with config.overrides(**{kernel: cfg}):
                        out = flash_dma_func(q, k, v, attn_bias=bias, is_causal=args.causal)
                        if not measure:  # one untimed call: only to see what the op asks for
                            plans = record_plans(lambda: torch.autograd.grad(out, leaves, dout))
                            passes = [plans[0].forward, plans[1].dkdv, plans[1].dq]
                            requested["variant"] = next(p.variant for p in passes
                                                        if p is not None and p.kernel == kernel)
                            return None
                        if kernel == "attn_fwd":
                            return time_ms(lambda: flash_dma_func(q, k, v, attn_bias=bias, is_causal=args.causal))
                        return time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))

                def record_plans(backward):
                    """The forward plan of `out` and the backward plan `backward` builds."""
                    seen, real = [], autograd.plan_backward
                    autograd.plan_backward = lambda fwd, *a: seen.append((fwd, real(fwd, *a))) or seen[-1][1]
                    try:
                        backward()
                    finally:
                        autograd.plan_backward = real
                    return seen[0]

                block_d = config.head_dim_block(d)
                fits = [c for c in cands
                        if launch_table.estimate_shared_memory(kernel, c, block_d, 2, 2 if bias is not None else 0) <= 227 * 1024]
                timings = {}

                def recorder(cfg, kernel=kernel):
                    ms = time_config(cfg)
                    timings[str(cfg)] = ms
                    return ms
                # the variant the op asks for names the cache entry
                time_config(fits[0], measure=False)
                best = config.tune(kernel, q.device, d, torch.bfloat16,
                                   requested.get("variant", variant), recorder, fits)
                fn = launch_table.triton_kernel(kernel)
                spills = sorted({ck.n_spills for ck in fn.device_caches[q.device.index or 0][0].values()})
                row = {"kernel": kernel, "head_dim": d, "variant": requested.get("variant", variant),
                       "causal": args.causal,
                       "best": best.__dict__, "timings_ms": timings, "spills_seen": spills}
                print(json.dumps(row), flush=True)
                summary["results"].append(row)
            q = k = v = bias = leaves = dout = None  # free before the next shape
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
