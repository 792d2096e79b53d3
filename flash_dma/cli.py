"""The `flash-dma` command.

    flash-dma bench [attention|all] [--quick] [--json PATH] [--plot PATH] [--report PATH]

On a CUDA GPU: times each op beside its peers (those installed; a missing one is named in a note)
and prints a report per op. Without a GPU it cannot time anything; it says so, runs a tiny
correctness check of each op in Triton's CPU interpreter, and exits 0.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

OPS = ("attention",)  # more ops join as they land


class _TextProgress:
    """Fallback progress bar when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def update(self, n: int = 1):
        self.done += n
        print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self):
        print(file=sys.stderr)


def _progress(desc: str):
    def make(total: int):
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            return _TextProgress(total, desc)
    return make


def _run_selfcheck() -> int:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "flash_dma.benchmarks.selfcheck"], env=env)


def bench(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("flash-dma bench: no CUDA GPU here, so nothing can be timed. Running a tiny "
              "correctness check of each op in Triton's CPU interpreter instead.")
        rc = _run_selfcheck()
        if rc != 0:
            print("flash-dma bench: the correctness check FAILED", file=sys.stderr)
        return 0
    from .benchmarks import attention
    from .benchmarks.common import environment, format_report, write_json, write_plot
    ops = OPS if args.op == "all" else (args.op,)
    env = environment()
    sections, notes = [], []
    for op in ops:
        if op == "attention":
            secs, op_notes = attention.run(args.quick, _progress("attention"))
            sections += secs
            notes += op_notes
    title = "flash-dma bench " + "+".join(ops) + (" (quick)" if args.quick else "")
    text = format_report(title, env, sections) + "".join(f"\nnote: {n}" for n in notes)
    print(text)
    if args.json:
        write_json(args.json, title, env, sections, notes)
        print(f"wrote {args.json}")
    if args.plot:
        if write_plot(args.plot, title, env, sections):
            print(f"wrote {args.plot}")
        else:
            print("note: --plot needs matplotlib (pip install 'flash-dma[bench]')")
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-dma", description="flash-dma: trainable attention kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time the kernels beside their peers on this GPU")
    b.add_argument("op", nargs="?", default="all", choices=OPS + ("all",))
    b.add_argument("--quick", action="store_true", help="a few configurations (about a minute)")
    b.add_argument("--json", metavar="PATH", help="write every number with its metadata")
    b.add_argument("--plot", metavar="PATH", help="write a PNG of throughput against length")
    b.add_argument("--report", metavar="PATH", help="also write the text report to PATH")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
