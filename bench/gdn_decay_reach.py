"""The rule's cut (the forward's state passes) and the cut of bwd_dhu alike, each with and
without dropping decayed segments' transitions (segments.py, "Decayed segments"), beside the
uncut call: forward and forward + backward do_bench medians of the public op, bf16, K = V = 128,
unit-norm keys, at the op report's decays (g = logsigmoid(x + 2), about e^-10 a chunk) and slow
ones (logsigmoid(x + 7), about e^-0.06 a chunk: nothing decays away, the bound costs only its
store). Outputs of each form compared with the uncut call's.

    python bench/gdn_decay_reach.py [--out DIR]

Writes DIR/gdn-decay-reach-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks.common import write_lines  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import SEGMENT_CHUNKS  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402
from bench.gdn_backward_forms import make  # noqa: E402

SHAPES = [(1, 32768, 16), (1, 16384, 16), (2, 16384, 16)]  # B, T, H: sequences the rule cuts
DECAYS = ("bench", "slow")  # gdn_backward_forms.DECAYS: the report's gates, and ones that do not decay away
FORMS = {  # name: overrides
    "uncut": {"gdn_chunks_per_segment": 0},
    "cut": {"gdn_decay_reach": False},  # the rule's cut: the forward's state passes
    "cut+reach": {},
    "both+reach": {"gdn_chunks_per_segment": SEGMENT_CHUNKS},  # bwd_dhu cut alike
    "both": {"gdn_chunks_per_segment": SEGMENT_CHUNKS, "gdn_decay_reach": False},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ns = ap.parse_args()
    lines = [f"# decayed segments | {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
             f"{triton.__version__} | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, "
             "K = V = 128, public op, do_bench medians, ms",
             f"| shape | decays | fwd {' / '.join(FORMS)} | fwd+bwd {' / '.join(FORMS)} | fwd+bwd speed-up "
             "over uncut | max rel. diff of o to uncut |",
             "| --- | --- | --- | --- | --- | --- |"]
    for B, T, H in SHAPES:
        for decay in DECAYS:
            x, _, do = make(B, T, H, None, decays=decay)
            leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
            row = {}
            for form, over in FORMS.items():
                with overrides(**over):
                    def fwd():
                        return chunk_gated_delta_rule(*leaves.values())[0]

                    def fwd_bwd():
                        return torch.autograd.grad(fwd(), list(leaves.values()), do)
                    with torch.no_grad():
                        o = fwd().float()
                        t_f = triton.testing.do_bench(fwd)
                    fwd_bwd()
                    t_fb = triton.testing.do_bench(fwd_bwd)
                row[form] = (t_f, t_fb, o)
            base, uncut_fb = row["uncut"][2], row["uncut"][1]
            diffs = [((row[f][2] - base).norm() / base.norm()).item() for f in FORMS if f != "uncut"]
            lines.append(f"| B{B} T{T} H{H} | {decay} | {' / '.join(f'{row[f][0]:.3f}' for f in FORMS)} | "
                         f"{' / '.join(f'{row[f][1]:.3f}' for f in FORMS)} | "
                         f"{' / '.join(f'{uncut_fb / row[f][1]:.2f}x' for f in FORMS if f != 'uncut')} | "
                         f"{' / '.join(f'{d:.1e}' for d in diffs)} |")
            print(lines[-1], flush=True)
            del row, base, leaves
            torch.cuda.empty_cache()
    print("\n".join(lines))
    write_lines(ns.out, "gdn-decay-reach", lines)


if __name__ == "__main__":
    main()
