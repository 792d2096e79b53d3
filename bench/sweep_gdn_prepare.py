"""The gated delta rule's prepare pass (gate cumsums and the WY inverse T) under other launch
configurations, timed through the public forward at the issue's shapes.

    python bench/sweep_gdn_prepare.py [--out DIR]

Per shape: which prepare pass the forward launches (the plan's choice), then the forward's
do_bench median under each candidate configuration of that pass (tune.candidates_for; the
table's entry first), each checked against the table's output (a candidate that differs is
reported, never timed). The table's defaults change only on evidence from both Hopper cards;
`flash-dma tune gdn` stores a card's own winners. Writes DIR/prepare-sweep-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.ops.gated_delta_rule import launch_table, tune  # noqa: E402
from flash_dma.runtime import config  # noqa: E402

SHAPES = [("B8 T4096 H32", 8, 4096, 32), ("B4 T4096 H16", 4, 4096, 16), ("B1 T32768 H16", 1, 32768, 16)]
PREPARE = ("prepare", "prepare_t")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ns = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"# prepare-pass sweep | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g, "
             "public forward ms (do_bench median)"]
    for label, B, T, H in SHAPES:
        q, k, v, g, beta = [t.detach() for t in tune.make_inputs(torch.device("cuda"), "g", B, T, H, 128, 128)]

        def forward():
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

        with tune._PassRecorder() as seen:
            reference = forward()
        passes = [p for p in seen.seen if p in PREPARE]
        lines.append(f"## {label}: passes {seen.seen}; swept {passes}")
        for pass_name in passes:
            table = launch_table._default(pass_name, 128, 128)
            results = []
            for cfg in tune.candidates_for(pass_name, 128, 128, quick=False):
                with config.overrides(**{f"gdn_{pass_name}": cfg}):
                    try:
                        out = forward()
                        err = float((out.double() - reference.double()).norm() / reference.double().norm())
                        if not err <= 1e-2:
                            lines.append(f"{launch_table.config_name(cfg)}: differs ({err:.2e})")
                            continue
                        results.append((triton.testing.do_bench(forward), cfg))
                    except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
                        lines.append(f"{launch_table.config_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
            base = next(ms for ms, cfg in results if cfg == table)
            for ms, cfg in sorted(results, key=lambda r: r[0])[:6]:
                mark = " (table)" if cfg == table else ""
                lines.append(f"{pass_name} {launch_table.config_name(cfg)}{mark}: {ms:.3f} ms ({base / ms:.3f}x)")
            print("\n".join(lines[-7:]), flush=True)
        del reference
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    tag = name.replace("NVIDIA ", "").replace(" ", "-")
    with open(os.path.join(ns.out, f"prepare-sweep-{tag}-{datetime.date.today():%Y%m%d}.txt"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
