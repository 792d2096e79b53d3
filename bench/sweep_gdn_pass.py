"""One pass of the gated delta rule under other launch configurations, timed through the public
op at given shapes (the forward, or with --backward the forward + backward).

    python bench/sweep_gdn_pass.py [--pass prepare_t] [--shapes "B8 T4096 H32,B2 T4096 H16 kda"]
                                   [--backward] [--out DIR]

A shape: B, T, H, optionally K<n> (K = V = n) and kda (the per-key gate gk instead of g).

Per shape: the passes the call launches (the plan's choices), then its do_bench median under
each candidate configuration of the swept pass (the plan's own first; tune.candidates_for, plus
all of K for pair_grad; for the sequential state passes V tiles of 16-64 with 2-8 warps and 2-3
stages, at K = 256 16-32 with 4-8 warps and 2 stages), each checked against the plan's output
and gradients (a candidate that differs is reported, never timed). The table's defaults change
only on evidence from both Hopper cards; `flash-dma tune gdn` stores a card's own winners.
Writes DIR/<pass>-sweep-<device>-<date>.txt.
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
from flash_dma.runtime.config import head_dim_block  # noqa: E402


def sequential_candidates(K: int) -> list[GdnConfig]:
    """V tiles, warps and stages of the state passes; all of K in one tile. At K = 256 three
    stages overflow shared memory, and one stage of fwd_h or bwd_dhu made an illegal address
    (Triton 3.6, H200), which ends the process: two stages, 16- or 32-wide tiles."""
    kp = head_dim_block(K)
    if kp > 128:
        return [GdnConfig(kp, bv, w, 2) for bv, w in itertools.product((16, 32), (4, 8))]
    return [GdnConfig(kp, bv, w, s) for bv, w, s in itertools.product((16, 32, 64), (2, 4, 8), (2, 3))]


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """(B, T, H, K, per_key) of a shape label."""
    parts = text.split()
    fields = dict((part[0], int(part[1:])) for part in parts if part != "kda")
    return fields["B"], fields["T"], fields["H"], fields.get("K", 128), "kda" in parts


def inputs(B, T, H, K=128, per_key=False, seed=0):
    """(q, k, v, beta, gates): unit-norm q and k; gates {g} per head, or {gk} per key (KDA),
    natural-log decays logsigmoid(N(2, 1))."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    norm = torch.nn.functional.normalize
    gate = torch.nn.functional.logsigmoid(randn(B, T, H, *((K,) if per_key else ())) + 2)
    return (norm(randn(B, T, H, K), dim=-1).to(torch.bfloat16), norm(randn(B, T, H, K), dim=-1).to(torch.bfloat16),
            randn(B, T, H, K).to(torch.bfloat16),
            torch.rand(B, T, H, generator=gen, device="cuda").sigmoid().to(torch.bfloat16),
            {"gk" if per_key else "g": gate})


def candidates(pass_name: str, K: int) -> list[GdnConfig]:
    if pass_name in launch_table.SEQUENTIAL:
        return sequential_candidates(K)
    out = tune.candidates_for(pass_name, K, K, quick=False)
    if pass_name == "pair_grad" and K > 64:  # one K tile of all of K: the gates loaded once
        out += [GdnConfig(K, 16, w, s) for w, s in itertools.product((4, 8), (1, 2))]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="pass_name", default="prepare_t")
    ap.add_argument("--shapes", default="B8 T4096 H32,B4 T4096 H16,B1 T32768 H16")
    ap.add_argument("--backward", action="store_true", help="time and check the forward + backward")
    ap.add_argument("--out", default="bench/results")
    ns = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"# {ns.pass_name} sweep | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, K = V (128 unless "
             f"named), public {'forward + backward' if ns.backward else 'forward'} ms (do_bench median)"]
    for label in ns.shapes.split(","):
        B, T, H, K, per_key = parse_shape(label)
        q, k, v, beta, gates = inputs(B, T, H, K, per_key)
        leaves = [q, k, v, beta, *gates.values()]
        if ns.backward:
            for leaf in leaves:
                leaf.requires_grad_()
        do = torch.randn_like(v)

        def forward():
            out = chunk_gated_delta_rule(q, k, v, gates.get("g"), beta, gk=gates.get("gk"))[0]
            return list(torch.autograd.grad(out, leaves, do)) if ns.backward else [out]

        with tune._PassRecorder() as seen:
            reference = forward()
        lines.append(f"## {label}: passes {seen.seen}")
        if ns.pass_name not in seen.seen:
            lines.append(f"{ns.pass_name} does not run here")
            continue
        plain = triton.testing.do_bench(forward)
        results = [(plain, None)]
        for cfg in candidates(ns.pass_name, K):
            with config.overrides(**{f"gdn_{ns.pass_name}": cfg}):
                try:
                    out = forward()
                    err = max(float((o.double() - r.double()).norm() / r.double().norm())
                              for o, r in zip(out, reference))  # NaN fails the test below
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
