"""The segments' join (segments.segment_join_kernel) alone: its launch tiles swept on the shapes
where the plan cuts sequences, forward (left to right) and backward (right to left, the
transitions read transposed), each candidate's starts and final state checked against the
default tiles' first.

    python bench/sweep_gdn_join.py [--out DIR]

Transitions and local states are random fp32 of a contraction's size (the join's cost does not
depend on their values). Writes gdn-join-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.ops.gated_delta_rule.segments import JoinTiles, join_segments, join_tiles, segment_layout  # noqa: E402

# (label, B, T, HV, K, V, chunks per segment): the cut rows of the report
SHAPES = [("B1 T32768 H16", 1, 32768, 16, 128, 128, 64), ("B1 T65536 H16", 1, 65536, 16, 128, 128, 128)]
CANDIDATES = [JoinTiles(bv, 128, w, s, "tf32x3") for bv in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    env = environment()
    lines = [f"# segment join tiles, {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}",
             "shape | direction | block_v warps stages | us | vs default | max rel. diff"]
    dev = torch.device("cuda")
    for label, B, T, HV, K, V, cut in SHAPES:
        seg = segment_layout(B, T, None, cut, dev)
        slots = seg.num_slots
        transition = torch.randn(slots, HV, K, K, device=dev) / K ** 0.5
        local = torch.randn(slots, HV, K, V, device=dev)
        initial = torch.randn(B, HV, K, V, device=dev)
        default = join_tiles(K, V, True)
        for reverse in (False, True):
            def run(tiles):
                return join_segments(transition, local, seg, initial, reverse=reverse, transposed=reverse, tiles=tiles)
            ref = run(default)
            base = time_ms(lambda: run(default))
            for tiles in [default] + [c for c in CANDIDATES if c != default]:
                try:
                    out = run(tiles)
                    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out, ref))
                    us = 1000 * time_ms(lambda: run(tiles))
                except Exception as exc:  # a launch that does not compile or fit
                    lines.append(f"{label} | {'backward' if reverse else 'forward'} | {tiles.block_v} {tiles.num_warps} "
                                 f"{tiles.num_stages} | failed: {type(exc).__name__}")
                    continue
                mark = " (default)" if tiles == default else ""
                lines.append(f"{label} | {'backward' if reverse else 'forward'} | {tiles.block_v} {tiles.num_warps} "
                             f"{tiles.num_stages}{mark} | {us:.1f} | {1000 * base / us:.2f}x | {diff:.1e}")
            print("\n".join(lines[-len(CANDIDATES):]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gdn-join-{env['device'].replace(' ', '-')}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:2]))
    print("wrote", path)


if __name__ == "__main__":
    main()
