"""disable_recompute beside the default (recomputing) backward, forward + backward through the
public op: do_bench medians in alternating rounds, peak memory of one fwd+bwd and what the
forward leaves held for the backward.

    python bench/gdn_keep_states.py [--out bench/results]

Writes DIR/gdn-keep-states-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks.gdn import OpCase, make_op_inputs, varlen_lengths  # noqa: E402

CASES = [OpCase(2, 4096, 16, per_key_gate=True), OpCase(2, 4096, 16, per_key_gate=True, strong_decay=True),
         OpCase(2, 8192, 8, 256, 256), OpCase(1, 8192, 16), OpCase(4, 4096, 16), OpCase(8, 4096, 32),
         OpCase(1, 32768, 16, seqlens=varlen_lengths(32768, 1))]
ROUNDS = 5


def step_of(case: OpCase, x: dict, keep: bool):
    leaves = [x["q"], x["k"], x["v"], x["g"], x["beta"]]
    for t in leaves:
        t.requires_grad_()
    gates = {"g": None, "gk": x["g"]} if case.per_key_gate else {"g": x["g"]}

    def forward():
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], cu_seqlens=x["cu_seqlens"],
                                      disable_recompute=keep, **gates)[0]

    def step():
        torch.autograd.grad(forward(), leaves, x["do"])
    return forward, step


def held_and_peak(forward, step) -> tuple[float, float]:
    """MiB the forward's graph holds for the backward, and the peak of one fwd+bwd above the live set."""
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated()
    o = forward()
    held = (torch.cuda.memory_allocated() - live) / 2**20
    del o
    torch.cuda.synchronize()
    live = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return held, (torch.cuda.max_memory_allocated() - live) / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ns = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"# disable_recompute beside the recomputing backward | {name} | torch {torch.__version__} | "
             f"triton {triton.__version__} | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"# bf16, fwd+bwd ms: median of {ROUNDS} alternating rounds of do_bench medians; MiB held by the "
             "forward's graph for the backward / peak of one fwd+bwd above the live set",
             f"{'case':34} {'recompute':>10} {'kept':>8} {'speedup':>8} {'held MiB':>17} {'peak MiB':>15}"]
    for case in CASES:
        x = make_op_inputs(case, seed=case.T + case.H + case.B)
        sides = {keep: step_of(case, x, keep) for keep in (False, True)}
        for _, step in sides.values():
            step()
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for keep, (_, step) in sides.items():
                times[keep].append(triton.testing.do_bench(step, warmup=25, rep=100))
        ms = {keep: statistics.median(t) for keep, t in times.items()}
        mem = {keep: held_and_peak(*sides[keep]) for keep in (False, True)}
        lines.append(f"{case.label:34} {ms[False]:10.3f} {ms[True]:8.3f} {ms[False] / ms[True]:7.3f}x "
                     f"{mem[False][0]:8.0f} -> {mem[True][0]:5.0f} {mem[False][1]:6.0f} -> {mem[True][1]:5.0f}")
        print(lines[-1], flush=True)
        del x, sides
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    os.makedirs(ns.out, exist_ok=True)
    tag = name.replace("NVIDIA ", "").replace(" ", "-")
    with open(os.path.join(ns.out, f"gdn-keep-states-{tag}-{datetime.date.today():%Y%m%d}.txt"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
