"""The backward's forms through the public op, same run: the passes (local_dv, the recompute of
w and bwd_dhu in Triton, the fused chunk backward), the warp-role bwd_dhu (gluon/bwd_dhu_ws.py,
forming the intra-chunk dv and w itself) and the warp-role backward (gluon/backward_ws.py: all of
it after the state pass in one kernel). Forward and forward + backward do_bench medians per
form, the backward as their difference; gradients compared with the first form's.

    python bench/gdn_backward_forms.py [--out DIR] [--forms passes,dhu_ws,backward_ws] [--shapes 0,1] [--segments whole|rule|N] [--decays bench|slow|mixed]

Sequences run whole by default; --segments rule lets the plan's rule cut them as in a plain call
(the forward's state passes for one long sequence, and with the warp-role backward bwd_dhu too);
--segments N cuts every pass into segments of N chunks.

Writes DIR/gdn-backward-forms-<device>-<date>.txt.
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
from flash_dma.benchmarks.gdn import VARLEN_SEED, varlen_lengths  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

SHAPES = [  # label, B, T, H, packed lengths or None
    ("B4 T4096 H16", 4, 4096, 16, None),
    ("B8 T4096 H32", 8, 4096, 32, None),
    ("B2 T8192 H16", 2, 8192, 16, None),
    ("B1 T8192 H16", 1, 8192, 16, None),
    ("varlen N20 T32768 H16", 1, 32768, 16, varlen_lengths(32768, VARLEN_SEED)),
    ("B16 T4096 H32", 16, 4096, 32, None),
    ("B8 T4096 H16", 8, 4096, 16, None),
    ("B2 T16384 H32", 2, 16384, 32, None),
    ("B1 T32768 H16", 1, 32768, 16, None),
]
FORMS = {  # name: the overrides that select it
    "passes": dict(gdn_dhu_warp_roles=False, gdn_backward_warp_roles=False),
    "dhu_ws": dict(gdn_dhu_warp_roles=True, gdn_backward_warp_roles=False),
    "backward_ws": dict(gdn_backward_warp_roles=True),
}


# gate shifts, g = logsigmoid(x + shift): the op report's (about e^-10 a chunk), slow ones (about
# e^-0.06 a chunk: nothing decays away), and half the heads each (a layer's heads differ so)
DECAYS = {"bench": (2.0,), "slow": (7.0,), "mixed": (2.0, 7.0)}


def make(B, T, H, lengths, K=128, V=128, dtype=torch.bfloat16, decays="bench"):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shifts = DECAYS[decays]
    shift = torch.tensor(shifts, device="cuda").repeat_interleave(-(-H // len(shifts)))[:H]

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    norm = torch.nn.functional.normalize
    x = dict(q=norm(randn(B, T, H, K), dim=-1).to(dtype), k=norm(randn(B, T, H, K), dim=-1).to(dtype),
             v=randn(B, T, H, V).to(dtype), g=torch.nn.functional.logsigmoid(randn(B, T, H) + shift),
             beta=torch.rand(B, T, H, generator=gen, device="cuda").sigmoid().to(dtype))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                                                   dtype=torch.int32)
    return x, cu, randn(B, T, H, V).to(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--shapes", default=None, help="indices into SHAPES (default: all)")
    ap.add_argument("--segments", default="whole", help="whole, rule, or chunks per segment")
    ap.add_argument("--decays", default="bench", choices=list(DECAYS), help="the gates: " + str(DECAYS))
    ns = ap.parse_args()
    forms = ns.forms.split(",")
    cut = {"whole": {"gdn_chunks_per_segment": 0}, "rule": {}}.get(ns.segments)
    if cut is None:
        cut = {"gdn_chunks_per_segment": int(ns.segments)}
    shapes = SHAPES if ns.shapes is None else [SHAPES[int(i)] for i in ns.shapes.split(",")]
    name = torch.cuda.get_device_name()
    lines = [f"# the backward's forms | {name} | torch {torch.__version__} | triton {triton.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, K = V = 128, g, no states; "
             "public op, do_bench medians, ms; backward = fwd+bwd - fwd; "
             f"segments: {ns.segments}; decays: {ns.decays}",
             f"| shape | fwd | bwd {' / '.join(forms)} | bwd speed-up over {forms[0]} | max rel. diff of grads to "
             f"{forms[0]} |",
             "| --- | --- | --- | --- | --- |"]
    for label, B, T, H, lengths in shapes:
        x, cu, do = make(B, T, H, lengths, decays=ns.decays)
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        row = {}
        for form in forms:
            with overrides(**cut, **FORMS[form]):
                def fwd():
                    return chunk_gated_delta_rule(*leaves.values(), cu_seqlens=cu)[0]

                def fwd_bwd():
                    return torch.autograd.grad(fwd(), list(leaves.values()), do)
                grads = fwd_bwd()
                with torch.no_grad():
                    t_f = triton.testing.do_bench(fwd)
                t_fb = triton.testing.do_bench(fwd_bwd)
            row[form] = (t_f, t_fb - t_f, grads)
        base = row[forms[0]]
        diffs = [max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                     for a, b in zip(row[f][2], base[2])) for f in forms[1:]]
        lines.append(f"| {label} | {base[0]:.3f} | {' / '.join(f'{row[f][1]:.3f}' for f in forms)} | "
                     f"{' / '.join(f'{base[1] / row[f][1]:.2f}x' for f in forms[1:])} | "
                     f"{' / '.join(f'{d:.1e}' for d in diffs)} |")
        print(lines[-1], flush=True)
        del row, base
        torch.cuda.empty_cache()
    print("\n".join(lines))
    write_lines(ns.out, "gdn-backward-forms", lines)


if __name__ == "__main__":
    main()
