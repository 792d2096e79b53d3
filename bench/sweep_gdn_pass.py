"""One pass of the gated delta rule's forward under other launch configurations, timed through the
public forward at given shapes.

    python bench/sweep_gdn_pass.py [--pass prepare_t] [--shapes "B8 T4096 H32,B1 T32768 H16"] [--out DIR]

Per shape: the passes the forward launches (the plan's choices), then the forward's do_bench
median under each candidate configuration of the swept pass (the plan's own first; for the
prepare passes tune.candidates_for, for the sequential state passes V tiles of 16-64 with 2-8
warps and 2-3 stages), each checked against the plan's output (a candidate that differs is
reported, never timed). The table's defaults change only on evidence from both Hopper cards;
`flash-dma tune gdn` stores a card's own winners. Writes DIR/<pass>-sweep-<device>-<date>.txt.
"""
import argparse
import datetime
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.ops.gated_delta_rule import launch_table, tune  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime import config  # noqa: E402

SEQUENTIAL_CANDIDATES = [GdnConfig(128, bv, w, s) for bv, w, s in itertools.product((16, 32, 64), (2, 4, 8), (2, 3))]


def parse_shape(text: str) -> tuple[int, int, int]:
    fields = dict((part[0], int(part[1:])) for part in text.split())
    return fields["B"], fields["T"], fields["H"]


def inputs(B, T, H, K=128, V=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    norm = torch.nn.functional.normalize
    return (norm(randn(B, T, H, K), dim=-1).to(torch.bfloat16), norm(randn(B, T, H, K), dim=-1).to(torch.bfloat16),
            randn(B, T, H, V).to(torch.bfloat16), torch.nn.functional.logsigmoid(randn(B, T, H) + 2),
            torch.rand(B, T, H, generator=gen, device="cuda").sigmoid().to(torch.bfloat16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="pass_name", default="prepare_t")
    ap.add_argument("--shapes", default="B8 T4096 H32,B4 T4096 H16,B1 T32768 H16")
    ap.add_argument("--out", default="bench/results")
    ns = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"# {ns.pass_name} sweep | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g, "
             "public forward ms (do_bench median)"]
    sequential = ns.pass_name in launch_table.SEQUENTIAL
    for label in ns.shapes.split(","):
        q, k, v, g, beta = inputs(*parse_shape(label))

        def forward():
            return chunk_gated_delta_rule(q, k, v, g, beta)[0]

        with tune._PassRecorder() as seen:
            reference = forward()
        lines.append(f"## {label}: passes {seen.seen}")
        if ns.pass_name not in seen.seen:
            lines.append(f"{ns.pass_name} does not run here")
            continue
        plain = triton.testing.do_bench(forward)
        candidates = SEQUENTIAL_CANDIDATES if sequential else tune.candidates_for(ns.pass_name, 128, 128, quick=False)
        results = [(plain, None)]
        for cfg in candidates:
            with config.overrides(**{f"gdn_{ns.pass_name}": cfg}):
                try:
                    out = forward()
                    err = float((out.double() - reference.double()).norm() / reference.double().norm())
                    if not err <= 1e-2:
                        lines.append(f"{launch_table.config_name(cfg)}: differs ({err:.2e})")
                        continue
                    results.append((triton.testing.do_bench(forward), cfg))
                except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
                    lines.append(f"{launch_table.config_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
        for ms, cfg in sorted(results, key=lambda r: r[0])[:8]:
            what = "the plan's own" if cfg is None else launch_table.config_name(cfg)
            lines.append(f"{what}: {ms:.3f} ms ({plain / ms:.3f}x)")
        print("\n".join(lines[-9:]), flush=True)
        del reference
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    tag = name.replace("NVIDIA ", "").replace(" ", "-")
    with open(os.path.join(ns.out, f"{ns.pass_name}-sweep-{tag}-{datetime.date.today():%Y%m%d}.txt"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
