"""Dynamic mask attention beside FlexAttention, SDPA and flash-dmattn, in one process.

    python bench/bench_attention.py [--quick]

The same as `flash-dma bench attention`, writing the report, JSON and plot under
bench/results/ with the device and date in their names.
"""
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.cli import main  # noqa: E402

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    quick = "--quick" in sys.argv[1:]
    stem = os.path.join(out, f"attention-{device}-{datetime.date.today():%Y%m%d}{'-quick' if quick else ''}")
    sys.exit(main(["bench", "attention", *sys.argv[1:], "--json", stem + ".json", "--plot", stem + ".png",
                   "--report", stem + ".txt"]))
