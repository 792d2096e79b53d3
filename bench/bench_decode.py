"""Decoding with a KV cache beside SDPA, FlexAttention and flash-sparse-attn, in one process.

    python bench/bench_decode.py [--quick]

Writes the report and its JSON under bench/results/ with the device and date in their names
(decode-<device>-<date>[-quick].txt/.json).
"""
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment, format_report, write_json  # noqa: E402
from flash_dma.benchmarks.decode import run_decode_report  # noqa: E402

if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA GPU here, nothing to time")
        sys.exit(0)
    quick = "--quick" in sys.argv[1:]
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    device = torch.cuda.get_device_name().replace(" ", "-")
    stem = os.path.join(out, f"decode-{device}-{datetime.date.today():%Y%m%d}{'-quick' if quick else ''}")
    title = "flash-dma bench decode" + (" (quick)" if quick else "")
    env = environment()
    sections, notes = run_decode_report(quick)
    text = format_report(title, env, sections) + "".join(f"\nnote: {n}" for n in notes)
    print(text)
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    write_json(stem + ".json", title, env, sections, notes)
    print(f"wrote {stem}.txt and {stem}.json")
