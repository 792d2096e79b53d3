"""Sweep launch configurations of the attention kernels on this GPU (what `flash-dma tune
attention` runs, with its shapes and candidates chosen here).

    python bench/tune_attention.py [--head-dims 64 128 256] [--variants plain bias] [--kernels ...]
                                   [--causal] [--quick] [--out FILE]

The sweep (flash_dma/ops/dynamic_mask_attention/tune.py, flash_dma/benchmarks/tune.py) stores
each winner in the persistent tuning cache and every timing in its profiling log; this script
also writes a summary to --out so that the launch table
(flash_dma/ops/dynamic_mask_attention/launch_table.py) can be updated from it.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment  # noqa: E402
from flash_dma.benchmarks.tune import sweep_case  # noqa: E402
from flash_dma.cli import _progress  # noqa: E402
from flash_dma.ops.dynamic_mask_attention import launch_table, tune  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128])
    parser.add_argument("--variants", nargs="+", default=["bias", "plain"])
    parser.add_argument("--out", default="tuning-summary.json")
    parser.add_argument("--kernels", nargs="+", default=list(launch_table.KERNELS))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few candidates per kernel")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    summary = {"environment": environment(), "results": []}
    for case in tune.cases(device, args.quick, args.head_dims, args.variants, args.kernels, args.causal):
        outcome = sweep_case(case, _progress(case.label))
        row = {"kernel": case.kernel, "head_dim": case.head_dim, "variant": case.variant,
               "causal": args.causal, "best": outcome.best.__dict__, "timings_ms": outcome.timings_ms,
               "skipped": outcome.errors, "spills_seen": tune.spills_seen(case.kernel, device)}
        print(json.dumps(row), flush=True)
        summary["results"].append(row)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
