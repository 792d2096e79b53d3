"""The gated delta rule's chunk-parallel backward: one pass (bwd_chunk) against dqkw then WY, and
the one pass's launch configurations, by forward + backward time and by the kernels' own time.

    python bench/sweep_gdn_chunk_backward.py [--shapes LABELS] [--configs BK:BV:W:S,...]

One process, bf16, scalar gate g, h0 + final state. Each variant's outputs and gradients are
checked against the dqkw-then-WY call first (relative norm error, printed), so a wrong variant
cannot pass as a fast one. Kernel times: torch.profiler, the chunk-backward kernels of one
forward + backward (median of 5). Writes bench/results/gdn-chunk-backward-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.benchmarks.gdn import VARLEN_SEED, varlen_lengths  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402
from sweep_gdn_segments import fwd_bwd, make_inputs, rel_err  # noqa: E402

# (label, B, T, H, packed lengths or None, K = V)
SHAPES = [
    ("B1 T32768 H16", 1, 32768, 16, None, 128),
    ("B4 T4096 H16", 4, 4096, 16, None, 128),
    ("B8 T4096 H32", 8, 4096, 32, None, 128),
    ("B1 T8192 H16", 1, 8192, 16, None, 128),
    ("B2 T8192 H8 K256", 2, 8192, 8, None, 256),
    ("varlen T32768 H16", 1, 32768, 16, varlen_lengths(32768, VARLEN_SEED), 128),
]
CHUNK_KERNELS = ("gdn_bwd_chunk_kernel", "gdn_bwd_dqkw_kernel", "gdn_bwd_wy_kernel")


def chunk_kernel_us(x) -> float:
    """Microseconds of the chunk-backward kernels (and the per-tile sums after bwd_chunk) in one
    forward + backward: median over 5 profiled calls."""
    per_call = []
    for _ in range(5):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd_bwd(x)
            torch.cuda.synchronize()
        total = 0.0
        for event in prof.key_averages():
            if any(name in event.key for name in CHUNK_KERNELS) or "reduce_kernel" in event.key:
                total += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        per_call.append(total)
    return statistics.median(per_call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="labels of SHAPES to run, comma-separated (default: all)")
    parser.add_argument("--configs", default="64:32:8:2,64:64:8:2,64:64:8:1,64:32:8:3,64:32:4:2",
                        help="bwd_chunk launch configurations BK:BV:warps:stages, comma-separated")
    parser.add_argument("--tag", default="", help="suffix of the results file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_gdn_chunk_backward.py: no CUDA GPU here; nothing can be timed")
    configs = [GdnConfig(*map(int, c.split(":"))) for c in args.configs.split(",")]
    wanted = None if not args.shapes else set(args.shapes.split(","))
    env = environment()
    device = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
    lines = ["== gated delta rule: the chunk-parallel backward in one pass (bwd_chunk) vs dqkw then WY ==",
             f"device: {env['device']} ({env['sm_count']} SMs) | torch {env['torch']} | triton {env['triton']} | "
             f"CUDA {env['cuda']} | {datetime.date.today():%Y-%m-%d} | bf16, gate g, h0 + final state",
             "fwd+bwd ms: median of triton.testing.do_bench; kernels us: the chunk-backward kernels of one "
             "fwd+bwd (torch.profiler, median of 5); x: against dqkw+WY; err: max relative norm error of "
             "outputs and gradients against dqkw+WY",
             f"{'shape':<24} {'variant':<20} {'fwd+bwd ms':>11} {'x':>6} {'kernels us':>11} {'x':>6} {'err':>9}"]
    print("\n".join(lines), flush=True)
    for label, B, T, H, lengths, KV in SHAPES:
        if wanted and label not in wanted:
            continue
        x = make_inputs(B, T, H, lengths, False, K=KV, V=KV)
        reference = base_ms = base_us = None
        variants = [("dqkw+wy", dict(gdn_one_chunk_backward=False))]
        variants += [(f"one BK{c.block_k} BV{c.block_v} W{c.num_warps} S{c.num_stages}",
                      dict(gdn_one_chunk_backward=True, gdn_bwd_chunk=c)) for c in configs]
        for name, forced in variants:
            try:
                with overrides(**forced):
                    results = fwd_bwd(x)
                    ms = time_ms(lambda: fwd_bwd(x))
                    us = chunk_kernel_us(x)
            except Exception as exc:  # a configuration that does not compile or fit: say so, go on
                line = f"{label:<24} {name:<20} failed: {type(exc).__name__}: {str(exc)[:80]}"
                lines.append(line)
                print(line, flush=True)
                continue
            if reference is None:
                reference, base_ms, base_us, err = results, ms, us, 0.0
            else:
                err = max(rel_err(r, ref) for r, ref in zip(results, reference))
            line = (f"{label:<24} {name:<20} {ms:11.3f} {base_ms / ms:6.2f} {us:11.1f} {base_us / us:6.2f} "
                    f"{err:9.1e}")
            lines.append(line)
            print(line, flush=True)
            del results
        del x, reference
        torch.cuda.empty_cache()
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"gdn-chunk-backward-{device}-{datetime.date.today():%Y%m%d}{args.tag}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
