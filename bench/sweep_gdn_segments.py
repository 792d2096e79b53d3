"""Sequence split of the gated delta rule's state passes: forward and forward + backward times of
the unsplit op beside every forced chunks_per_segment, to derive the rule that picks the split
(plan.py's gdn_chunks_per_segment, None today).

    python bench/sweep_gdn_segments.py [--splits 2,4,8,16,32] [--shapes LABELS] [--kda] [--tiles BV:W:S,...]
                                       [--decays slow|report]

One process, bf16, K = V = 128 (256 where the label says K256), scalar gate g (--kda adds the
per-key gate rows); gates logsigmoid(N(0, 1) + 4) (slow: about e^-1.3 a chunk), or with --decays
report the op report's logsigmoid(U(0, 1)) (about e^-30 a chunk, where decayed segments apply). Each split's
outputs are checked against the unsplit call's first (relative norm error, printed), so a wrong
split cannot pass as a fast one. --tiles also runs every forced split with the state passes'
tiles forced (fwd_h, fwd_h_from_t and bwd_dhu at BV columns, W warps, S stages; all of K), beside
the launch table's choice. Writes bench/results/gdn-segments-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.benchmarks.gdn import VARLEN_SEED, varlen_lengths  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

# (label, B, T, H, packed lengths or None, K = V)
SHAPES = [
    ("B1 T8192 H16", 1, 8192, 16, None, 128),
    ("B1 T32768 H16", 1, 32768, 16, None, 128),
    ("B4 T4096 H16", 4, 4096, 16, None, 128),
    ("varlen T32768 H16", 1, 32768, 16, varlen_lengths(32768, VARLEN_SEED), 128),
    ("varlen T8192 H16", 1, 8192, 16, varlen_lengths(8192, VARLEN_SEED), 128),
    ("B2 T8192 H8 K256", 2, 8192, 8, None, 256),
    ("B2 T4096 H16", 2, 4096, 16, None, 128),  # the KDA row of the op report (with --kda)
]


def make_inputs(B, T, H, lengths, per_key_gate, device="cuda", dtype=torch.bfloat16, K=128, V=128,
                decays="slow"):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device)

    def gate(*size):
        if decays == "report":
            return torch.nn.functional.logsigmoid(torch.rand(*size, generator=gen, device=device))
        return torch.nn.functional.logsigmoid(randn(*size) + 4)

    norm = torch.nn.functional.normalize
    n = B if lengths is None else len(lengths)
    x = {"q": norm(randn(B, T, H, K), dim=-1).to(dtype), "k": norm(randn(B, T, H, K), dim=-1).to(dtype),
         "v": randn(B, T, H, V).to(dtype),
         "g": gate(B, T, H),
         "gk": gate(B, T, H, K) if per_key_gate else None,
         "beta": torch.rand(B, T, H, generator=gen, device=device).sigmoid().to(dtype),
         "initial_state": randn(n, H, K, V) * 0.1,
         "do": randn(B, T, H, V).to(dtype), "dht": randn(n, H, K, V) * 0.1}
    x["cu_seqlens"] = None if lengths is None else torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    return x


def call(x, leaves=None):
    a = leaves or x
    return chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], gk=a["gk"],
                                  initial_state=a["initial_state"], output_final_state=True,
                                  cu_seqlens=x["cu_seqlens"])


def fwd_bwd(x):
    leaves = {n: x[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "gk", "beta", "initial_state")
              if x[n] is not None}
    o, final = call(x, {**x, **leaves})
    grads = torch.autograd.grad([o, final], list(leaves.values()), [x["do"], x["dht"]])
    return [o, final, *grads]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="2,4,8,16,32", help="chunks per segment, comma-separated")
    parser.add_argument("--shapes", help="labels of SHAPES to run, comma-separated (default: all)")
    parser.add_argument("--kda", action="store_true", help="also the per-key gate (g + gk)")
    parser.add_argument("--tiles", default="", help="state-pass tiles BV:warps:stages to force on the splits, comma-separated")
    parser.add_argument("--tag", default="", help="suffix of the results file")
    parser.add_argument("--decays", choices=("slow", "report"), default="slow")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_gdn_segments.py: no CUDA GPU here; nothing can be timed")
    splits = [int(s) for s in args.splits.split(",")]
    wanted = None if not args.shapes else set(args.shapes.split(","))
    env = environment()
    device = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
    lines = [f"== gated delta rule: state passes cut into segments (chunks_per_segment) ==",
             f"device: {env['device']} ({env['sm_count']} SMs) | torch {env['torch']} | triton {env['triton']} | "
             f"CUDA {env['cuda']} | {datetime.date.today():%Y-%m-%d} | bf16, K = V = 128 unless said, h0 + final state, "
             f"{args.decays} decays",
             "ms: median of triton.testing.do_bench; speed-up against unsplit; err: max relative norm error of "
             "the outputs and gradients against the unsplit call",
             f"{'shape':<28} {'split':>16} {'fwd ms':>9} {'x':>6} {'fwd+bwd ms':>11} {'x':>6} {'err':>9}"]
    print("\n".join(lines), flush=True)
    for label, B, T, H, lengths, K in SHAPES:
        if wanted and label not in wanted:
            continue
        for kda in ((False, True) if args.kda else (False,)):
            x = make_inputs(B, T, H, lengths, kda, K=K, V=K, decays=args.decays)
            name = label + (" KDA" if kda else "") + (f" ({len(lengths)} seqs)" if lengths else "")
            base_fwd = base_all = None
            reference = None
            tiles = [None] + [tuple(map(int, t.split(":"))) for t in args.tiles.split(",") if t]
            runs = [(0, None), (None, None)] + [(c, t) for c in splits if c != 0 for t in tiles]
            for split, tile in runs:  # whole (the baseline), the rule, forced splits (x tiles)
                forced = {}
                if split is not None:
                    forced["gdn_chunks_per_segment"] = split
                if tile is not None:
                    cfg = GdnConfig(K, *tile)
                    forced.update(gdn_fwd_h=cfg, gdn_fwd_h_from_t=cfg, gdn_bwd_dhu=cfg)
                with overrides(**forced):
                    with torch.no_grad():
                        fwd = time_ms(lambda: call(x))
                    results = fwd_bwd(x)
                    both = time_ms(lambda: fwd_bwd(x))
                if split == 0:
                    base_fwd, base_all, reference, err = fwd, both, results, 0.0
                else:
                    err = max(rel_err(r, ref) for r, ref in zip(results, reference))
                what = "rule" if split is None else "whole" if split == 0 else str(split)
                if tile is not None:
                    what += " BV{}W{}S{}".format(*tile)
                line = (f"{name:<28} {what:>16} {fwd:9.3f} {base_fwd / fwd:6.2f} "
                        f"{both:11.3f} {base_all / both:6.2f} {err:9.1e}")
                lines.append(line)
                print(line, flush=True)
                del results
            del x, reference
            torch.cuda.empty_cache()
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"gdn-segments-{device}-{datetime.date.today():%Y%m%d}{args.tag}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
