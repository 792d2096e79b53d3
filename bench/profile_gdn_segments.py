"""Where the time of the gated delta rule's sequence split goes: for each case (unsplit and forced
chunks_per_segment), one forward + backward under torch.profiler, printed as the CUDA kernels in
launch order (so that the three state-pass launches of a split, which share a kernel name, are
told apart) and as a per-kernel table (calls, total us), then do_bench medians of the forward
and of forward + backward, with the split's error against unsplit.

    python bench/profile_gdn_segments.py [--shape B,T,H] [--splits 16,32,64] [--budget 300] [--kda]
        [--order] [--configs 16x4x3,32x4x3,64x4x3,64x8x2,128x8x2] [--varlen]

--varlen passes the same B sequences packed (cu_seqlens, batch 1), as context parallelism and
packed training do.

--configs also runs every split under each forced launch configuration of the sequential passes
(fwd_h, fwd_h_from_t, bwd_dhu), written BVxWARPSxSTAGES: the table picks those configurations
from the number of chains (segments x heads), and this shows which the split wants.

bf16, K = V = 128, scalar gate g, initial and final states. Each case runs in its own try, so one
failure is reported and the rest go on; cases stop once --budget seconds have passed.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from sweep_gdn_segments import call, fwd_bwd, make_inputs, rel_err  # noqa: E402


def kernel_events(fn):
    """[(name, device us)] of the CUDA kernels one call of fn launches, in launch order."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.device_time_total) for e in events]


def short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,32768,16", help="B,T,H (default 1,32768,16)")
    parser.add_argument("--splits", default="16,32,64", help="chunks per segment, comma-separated")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds; later cases are skipped")
    parser.add_argument("--kda", action="store_true", help="per-key gate too (g + gk)")
    parser.add_argument("--order", action="store_true", help="also print every kernel in launch order")
    parser.add_argument("--configs", default="", help="BVxWARPSxSTAGES of the sequential passes, comma-separated")
    parser.add_argument("--varlen", action="store_true", help="the sequences packed (cu_seqlens)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_gdn_segments.py: no CUDA GPU here")
    import triton
    import triton.testing
    B, T, H = (int(s) for s in args.shape.split(","))
    start = time.time()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"B{B} T{T} H{H}{' packed' if args.varlen else ''} K=V=128 bf16 g{'+gk' if args.kda else ''}, h0 + final state", flush=True)
    x = make_inputs(1, B * T, H, [T] * B, args.kda) if args.varlen else make_inputs(B, T, H, None, args.kda)
    reference = None
    summary = []
    cases = [(split, None) for split in [None] + [int(s) for s in args.splits.split(",")]]
    for config in filter(None, args.configs.split(",")):
        bv, warps, stages = (int(n) for n in config.split("x"))
        cases += [(int(s), (bv, warps, stages)) for s in args.splits.split(",")]
    for split, config in cases:
        label = "unsplit" if split is None else f"cps{split}"
        forced = {}
        if config is not None:
            label += " BV{}xW{}xS{}".format(*config)
            cfg = GdnConfig(128, config[0], num_warps=config[1], num_stages=config[2])
            forced = {"gdn_fwd_h": cfg, "gdn_fwd_h_from_t": cfg, "gdn_bwd_dhu": cfg}
        if time.time() - start > args.budget:
            print(f"-- {label}: skipped (budget of {args.budget:.0f} s spent)")
            continue
        try:
            with overrides(gdn_chunks_per_segment=split, **forced) if split else overrides():
                results = fwd_bwd(x)
                err = 0.0 if reference is None else max(rel_err(r, e) for r, e in zip(results, reference))
                if reference is None:
                    reference = results
                del results
                events = kernel_events(lambda: fwd_bwd(x))
                with torch.no_grad():
                    fwd = triton.testing.do_bench(lambda: call(x), warmup=10, rep=50, return_mode="median")
                both = triton.testing.do_bench(lambda: fwd_bwd(x), warmup=10, rep=50, return_mode="median")
        except Exception as exc:  # noqa: BLE001 - report and go on with the next case
            print(f"-- {label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        total = sum(us for _, us in events)
        print(f"-- {label}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms, kernels {len(events)} summing to "
              f"{total / 1000:.3f} ms, err vs unsplit {err:.1e}")
        table: dict = {}
        for name, us in events:
            calls, sum_us = table.get(name, (0, 0.0))
            table[name] = (calls + 1, sum_us + us)
        for name, (calls, sum_us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"   {short(name):<48} {calls:>4} {sum_us:>10.1f} us")
        if args.order:
            print("   in launch order:")
            for name, us in events:
                print(f"     {short(name):<48} {us:>10.1f} us")
        summary.append((label, fwd, both))
        sys.stdout.flush()
    print(f"\n{'case':<24} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    for label, fwd, both in summary:
        print(f"{label:<24} {fwd:8.3f} {both:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
