"""Dynamic mask attention beside FlexAttention, SDPA and flash-dmattn, in one process.

    python bench/bench_attention.py [--quick] [--out DIR]

Prints the report and writes report-<date>.txt / .json under --out (default bench/results).
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flash_dma.benchmarks import attention  # noqa: E402
from flash_dma.benchmarks.common import environment, format_report, write_json  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    env = environment()
    sections, notes = attention.run(quick=args.quick)
    title = "flash-dma attention" + (" (quick)" if args.quick else "")
    text = format_report(title, env, sections) + "".join(f"\nnote: {n}" for n in notes)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    device = env["device"].replace(" ", "-")
    base = os.path.join(args.out, f"attention-{device}-{stamp}{'-quick' if args.quick else ''}")
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    write_json(base + ".json", title, env, sections)


if __name__ == "__main__":
    main()
