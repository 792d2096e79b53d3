"""The warp-role bwd_dhu (gluon/bwd_dhu_ws.py, forming the intra-chunk dv and w itself) against
the Triton passes it replaces (local_dv, the recompute of w, bwd_dhu), through the public op:
forward and forward + backward do_bench medians with gdn_dhu_warp_roles off and on, same run,
the backward as their difference; outputs and gradients compared between the two.

    python bench/gdn_dhu_warp_roles.py [--out DIR]

Writes DIR/gdn-dhu-warp-roles-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.benchmarks.gdn import VARLEN_SEED, varlen_lengths  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

SHAPES = [  # label, B, T, H, packed lengths or None
    ("B4 T4096 H16", 4, 4096, 16, None),
    ("B8 T4096 H32", 8, 4096, 32, None),
    ("B2 T8192 H16", 2, 8192, 16, None),
    ("B1 T8192 H16", 1, 8192, 16, None),
    ("varlen N20 T32768 H16", 1, 32768, 16, varlen_lengths(32768, VARLEN_SEED)),
]


def make(B, T, H, lengths, K=128, V=128, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    norm = torch.nn.functional.normalize
    x = dict(q=norm(randn(B, T, H, K), dim=-1).to(dtype), k=norm(randn(B, T, H, K), dim=-1).to(dtype),
             v=randn(B, T, H, V).to(dtype), g=torch.nn.functional.logsigmoid(randn(B, T, H) + 2),
             beta=torch.rand(B, T, H, generator=gen, device="cuda").sigmoid().to(dtype))
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda",
                                                   dtype=torch.int32)
    return x, cu, randn(B, T, H, V).to(dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ns = ap.parse_args()
    name = torch.cuda.get_device_name()
    lines = [f"# warp-role bwd_dhu vs the Triton passes | {name} | torch {torch.__version__} | triton "
             f"{triton.__version__} | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | bf16, "
             "K = V = 128, g; public op, do_bench medians, ms",
             "| shape | fwd | fwd+bwd off / on | bwd off / on | bwd on/off speed-up | max rel. diff of grads |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, B, T, H, lengths in SHAPES:
        x, cu, do = make(B, T, H, lengths)
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        row = {}
        for on in (False, True):
            with overrides(gdn_dhu_warp_roles=on):
                def fwd():
                    return chunk_gated_delta_rule(*leaves.values(), cu_seqlens=cu)[0]

                def fwd_bwd():
                    return torch.autograd.grad(fwd(), list(leaves.values()), do)
                grads = fwd_bwd()
                with torch.no_grad():
                    t_f = triton.testing.do_bench(fwd)
                t_fb = triton.testing.do_bench(fwd_bwd)
            row[on] = (t_f, t_fb, grads)
        diff = max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                   for a, b in zip(row[True][2], row[False][2]))
        (f0, fb0, _), (f1, fb1, _) = row[False], row[True]
        lines.append(f"| {label} | {f0:.3f} | {fb0:.3f} / {fb1:.3f} | {fb0 - f0:.3f} / {fb1 - f1:.3f} | "
                     f"{(fb0 - f0) / (fb1 - f1):.2f}x | {diff:.1e} |")
        print(lines[-1], flush=True)
        del row
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(ns.out, exist_ok=True)
    tag = name.replace("NVIDIA ", "").replace(" ", "-")
    with open(os.path.join(ns.out, f"gdn-dhu-warp-roles-{tag}-{datetime.date.today():%Y%m%d}.txt"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
