"""The fused kernels' forms on packed sequences of mixed lengths (the issue's 20 sequences filling
T = 32768 at H16, K = V = 128, and others by --cases): the forward's form (one-role 128 or 64
wide, warp roles) and the sequences' order (as given, longest first), each timed as the public
op's forward and forward + backward (do_bench medians) with its kernel time, the output checked
against the first variant's.

    python bench/gdn_packed_forms.py [--cases "varlen N20 B1 T32768 H16"] [--variants ...] [--out DIR]

VARIANTS: name:choice=value,...;name:... over gdn_fused_forward (64, 128, ws) and
gdn_longest_first (0, 1); "default:" takes the plan's rules. Writes DIR/gdn-packed-forms-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks import gdn  # noqa: E402
from flash_dma.benchmarks.common import environment, time_ms, write_lines  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402
from gdn_fused_backward import kernel_us, parse_variants  # noqa: E402

VARIANTS = ("default:;"
            "one-role-128:gdn_fused_forward=128,gdn_longest_first=0;"
            "one-role-128-longest:gdn_fused_forward=128,gdn_longest_first=1;"
            "ws:gdn_fused_forward=ws,gdn_longest_first=0;"
            "ws-longest:gdn_fused_forward=ws,gdn_longest_first=1;"
            "one-role-64-longest:gdn_fused_forward=64,gdn_longest_first=1")
FORWARD_KERNELS = ("gdn_fwd_fused_kernel", "gdn_fwd_ws_kernel")


def parse(text):
    """parse_variants, with ws kept as a string."""
    out = []
    for name, chosen in parse_variants(text.replace("=ws", "=-1")):
        out.append((name, {k: ("ws" if v == -1 else v) for k, v in chosen.items()}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="varlen N20 B1 T32768 H16")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    env = environment()
    lines = [f"# gdn packed forms | {env['device']} | torch {env['torch']} | triton {env['triton']} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g",
             "| case | variant | fwd ms | fwd+bwd ms | forward kernel us | max rel diff of o vs the first |",
             "| --- | --- | --- | --- | --- | --- |"]
    print(lines[0], flush=True)
    for case in gdn.op_plan(False, [c.strip() for c in args.cases.split(",")]):
        x = gdn.make_op_inputs(case, "cuda", seed=case.T + case.H + case.B)
        leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]

        def fwd():
            return chunk_gated_delta_rule(*leaves, cu_seqlens=x["cu_seqlens"])[0]

        def fwd_bwd():
            return torch.autograd.grad(fwd(), leaves, x["do"])
        first = None
        for name, chosen in parse(args.variants):
            with overrides(**chosen):
                o = fwd().detach()
                fwd_bwd()
                f_ms, fb_ms = time_ms(fwd), time_ms(fwd_bwd)
                us = sum(v for k, v in kernel_us(fwd).items() if k.startswith(FORWARD_KERNELS))
            first = o if first is None else first
            diff = float((o.double() - first.double()).norm() / first.double().norm())
            lines.append(f"| {case.label} | {name} | {f_ms:.3f} | {fb_ms:.3f} | {us:.0f} | {diff:.1e} |")
            print(lines[-1], flush=True)
    write_lines(args.out, "gdn-packed-forms", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
