"""The chunked gated delta rule beside flash-linear-attention 0.6.0: the whole op (fwd, bwd,
fwd+bwd) and the state-gradient pass bwd_dhu, in one process.

    python bench/bench_gdn.py [--quick] [--only gdn|dhu] [--cases LABELS --tag TAG]

The same as `flash-dma bench gdn` followed by `flash-dma bench dhu`, in one report, written
under bench/results/ as gdn-<GPU>-<date>.txt and .json. FLA comes from .peers/ (anchors.md):

    pip install --no-index --no-deps --target /tmp/site .peers/wheels/*.whl
    PYTHONPATH=/tmp/site python bench/bench_gdn.py

FlashQLA (a second peer of the op rows) and its TileLang stack come from .qla/ the same way
(--target /tmp/site .qla/a/*.whl .qla/b/*.whl); it needs nvcc and compiles each new shape on
its first call, untimed (the notes say how long).

Without a peer the sections show the others' times, with a note. FLA's first call of each new shape
family autotunes for about 100 s (untimed; the notes say how long), so the full run takes
several minutes; bwd_dhu alone (--only dhu) about three. Where a machine is lent for less time
than that, run the op report in parts: --cases picks op-plan cases by label (comma-separated),
--tag names the part's files, e.g.

    python bench/bench_gdn.py --only gdn --cases "B8 T4096 H32,B2 T8192 H8 K256 V256" --tag b
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.cli import parse_cases, run_bench  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of configurations")
    parser.add_argument("--only", choices=("gdn", "dhu"), help="one of the two benchmarks")
    parser.add_argument("--cases", metavar="LABELS", help="some cases of the op plan, by label, comma-separated")
    parser.add_argument("--tag", default="", help="appended to the result files' names (parts of one report)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gdn.py: no CUDA GPU here; nothing can be timed (flash-dma bench runs the "
                 "interpreter self-check instead)")
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
    ops = (args.only,) if args.only else ("gdn", "dhu")
    name = "gdn" if args.only in (None, "gdn") else "dhu"
    stem = os.path.join(out, f"{name}-{device}-{datetime.date.today():%Y%m%d}{'-quick' if args.quick else ''}"
                             f"{'-' + args.tag if args.tag else ''}")
    sys.exit(run_bench(ops, args.quick, json_path=stem + ".json", report=stem + ".txt",
                       cases=parse_cases(args.cases)))
