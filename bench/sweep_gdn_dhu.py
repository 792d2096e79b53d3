"""bwd_dhu's launch configurations on the rows where it trails FLA, with FLA in the same run.

    python bench/sweep_gdn_dhu.py [--out DIR] [--quick]

Per row (a shape and a bwd_dhu mode of `flash-dma bench dhu`): FLA's do_bench median, then ours
under each candidate configuration (runtime.config.overrides(gdn_bwd_dhu=...)), the rule's own
choice first, each checked against the rule's outputs (a candidate that differs is reported,
never timed). Two host figures per row as well: the host time of one call with the device idle
before it (ours and FLA's; where it is above the kernel time, do_bench times the host), and the
kernel time alone (CUDA-graph replay). Writes DIR/dhu-sweep-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma.benchmarks import gdn as bench  # noqa: E402
from flash_dma.benchmarks.common import time_ms  # noqa: E402
from flash_dma.ops.gated_delta_rule import launch_table  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime import config  # noqa: E402

VARLEN_T8K = bench.DhuShape(1, 8192, 64, seqlens=bench.varlen_lengths(8192, bench.VARLEN_SEED))
VARLEN_T32K = bench.DhuShape(1, 32768, 64, seqlens=bench.varlen_lengths(32768, bench.VARLEN_SEED))
# (shape, modes): the rows below 1.0x on 2026-11-27 (bench/results/dhu-H200-20261127-dhu.txt), a
# short row and two full-GPU rows for the rule's other branches
ROWS = [
    (bench.DhuShape(1, 8192, 32), "AB"),
    (bench.DhuShape(2, 4096, 16), "A"),
    (bench.DhuShape(2, 16384, 16), "AB"),
    (bench.DhuShape(1, 2048, 32), "BD"),
    (bench.DhuShape(1, 2048, 16), "BC"),
    (bench.DhuShape(4, 2048, 16), "D"),
    (bench.DhuShape(4, 8192, 32), "AC"),
    (VARLEN_T8K, "B"),
    (VARLEN_T32K, "ABD"),
]
CANDIDATES = [GdnConfig(128, bv, w, s) for bv, w, s in (
    (16, 4, 3), (16, 2, 3), (32, 4, 3), (32, 4, 2), (32, 4, 4), (32, 2, 3), (32, 2, 4), (32, 8, 3),
    (64, 8, 3), (64, 8, 2), (64, 4, 3), (64, 4, 2), (64, 8, 4))]


def host_us(fn, reps: int = 30) -> float:
    """Median host time of one call from an idle device: call, then wait for the device."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def graph_us(fn) -> float | None:
    """Kernel time alone: the call captured in a CUDA graph, replayed."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
    except Exception:  # noqa: BLE001 - a call that cannot be captured gets no figure
        return None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="three rows, four candidates")
    ns = ap.parse_args()
    notes: list[str] = []
    fla = bench.load_fla(notes)
    ours = bench.load_ours("chunk_gated_delta_rule_bwd_dhu", notes)
    factor, probe_note = bench.probe_gate_units(ours, fla) if fla is not None else (1.0, "no FLA")
    notes.append(probe_note)
    rows = ROWS[:3] if ns.quick else ROWS
    candidates = CANDIDATES[:4] if ns.quick else CANDIDATES
    name = torch.cuda.get_device_name()
    lines = [f"# bwd_dhu launch sweep | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "# ms are do_bench medians (25 warm-up, 100 reps); host us: one call from an idle device; "
             "kernel us: CUDA-graph replay", *[f"# {n}" for n in notes]]
    table = ["| row | pairs | FLA ms | rule (config) ms | best ms (config) | best / FLA | host us ours / FLA | "
             "kernel us ours (rule) / FLA |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    timer = lambda fn: time_ms(fn, warmup=25, rep=100)  # noqa: E731
    for shape, modes in rows:
        base = bench.make_dhu_base(shape, "cuda", seed=shape.T * 131 + shape.H * 7 + shape.B)
        pairs = shape.n_seqs * shape.H
        for mode in modes:
            args = bench.dhu_mode_inputs(base, shape, mode)
            mine = bench.scale_gates(args, factor)
            theirs = bench._fla_dhu_args(fla, args) if fla is not None else None
            label = f"{shape.label} {mode}"
            rule_cfg = launch_table.choose("bwd_dhu", shape.K, shape.V, torch.device("cuda"), pairs).config
            ref = ours(**mine)
            times = {}
            for cfg in [rule_cfg] + [c for c in candidates if c != rule_cfg]:
                with config.overrides(gdn_bwd_dhu=cfg):
                    try:
                        out = ours(**mine)
                        torch.cuda.synchronize()
                        errs = [rel_err(o, r) for o, r in zip(out, ref) if o is not None]
                        if not all(e <= 1e-2 for e in errs):
                            lines.append(f"# {label} {launch_table.config_name(cfg)}: differs from the rule's "
                                         f"outputs (relative errors {errs})")
                            continue
                        times[cfg] = timer(lambda: ours(**mine))
                    except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
                        lines.append(f"# {label} {launch_table.config_name(cfg)}: {type(exc).__name__}: "
                                     f"{str(exc)[:160]}")
            fla_ms = timer(lambda: fla.dhu(**theirs)) if fla is not None else None
            best = min(times, key=times.get)
            host_o = host_us(lambda: ours(**mine))
            host_f = host_us(lambda: fla.dhu(**theirs)) if fla is not None else float("nan")
            ker_o = graph_us(lambda: ours(**mine))
            ker_f = graph_us(lambda: fla.dhu(**theirs)) if fla is not None else None
            ranked = sorted(times.items(), key=lambda kv: kv[1])
            lines.append(f"# {label}: " + ", ".join(f"{launch_table.config_name(c)} {t:.3f}" for c, t in ranked))
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            table.append(f"| {label} | {pairs} | {fla_ms:.3f} | {times[rule_cfg]:.3f} "
                         f"({launch_table.config_name(rule_cfg)}) | {times[best]:.3f} "
                         f"({launch_table.config_name(best)}) | {fla_ms / times[best]:.2f}x | "
                         f"{host_o:.0f} / {host_f:.0f} | {fmt(ker_o)} / {fmt(ker_f)} |")
            print(table[-1], flush=True)
            del ref
        del base
        torch.cuda.empty_cache()
    text = "\n".join(lines + [""] + table) + "\n"
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    tag = name.replace("NVIDIA ", "").replace(" ", "-")
    path = os.path.join(ns.out, f"dhu-sweep-{tag}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as fh:
        fh.write(text)
    print("wrote", path)


if __name__ == "__main__":
    main()
