"""One pass of the gated delta rule under several launch configurations, timed as whole fwd+bwd
calls in alternating rounds (do_bench medians, then the median of the rounds), with each
configuration's gradients checked against the first's (a miscompiled tile shows there).

    python dev/gpu/gdn_config_sweep.py --pass pair_grad --configs 32x16x4x1,16x16x4x1 ["B2 T4096 H16 kda"]

A configuration is BKxBVxWARPSxSTAGES[xMAXREGS] (launch_table.GdnConfig); the first is the baseline. Shapes
as dev/gpu/kernel_times.py reads them.
"""
import argparse
import os
import statistics
import sys

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", ".."), os.path.dirname(__file__)]

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime import config  # noqa: E402
from kernel_times import make, parse  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="B2 T4096 H16 kda")
    ap.add_argument("--pass", dest="pass_name", required=True)
    ap.add_argument("--configs", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    B, T, H, K, per_key, strong, kimi = parse(args.shape)
    leaves, kw = make(B, T, H, K, K, per_key, strong=strong, kimi=kimi)
    q, k, v = leaves[:3]
    do = torch.randn_like(v)
    configs = [GdnConfig(*(int(x) for x in c.split("x"))) for c in args.configs.split(",")]

    def call():
        return torch.autograd.grad(chunk_gated_delta_rule(q, k, v, **kw)[0], leaves, do)

    grads, times = {}, {c: [] for c in configs}
    for c in configs:
        with config.overrides(**{f"gdn_{args.pass_name}": c}):
            grads[c] = call()
    for _ in range(args.rounds):
        for c in configs:
            with config.overrides(**{f"gdn_{args.pass_name}": c}):
                times[c].append(do_bench(call, warmup=25, rep=100, return_mode="median"))
    print(f"{args.shape}, pass {args.pass_name}, {torch.cuda.get_device_name()}: fwd+bwd ms, median of "
          f"{args.rounds} rounds; largest gradient difference from the first configuration")
    for c in configs:
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[c], grads[configs[0]]))
        nan = any(torch.isnan(g).any().item() for g in grads[c])
        cap = f"x{c.max_registers}" if c.max_registers else ""
        print(f"  {c.block_k}x{c.block_v}x{c.num_warps}x{c.num_stages}{cap}: {statistics.median(times[c]):.3f} ms, "
              f"diff {diff:.3g}{' NaN' if nan else ''}")


if __name__ == "__main__":
    main()
