"""bwd_dhu with warp roles (bench/experiments/gluon_bwd_dhu_ws.py, not yet run on a GPU) beside
the Triton kernel: errors against the fp64 reference, then times, on the GPU.

    python bench/experiments/gluon_bwd_dhu_ws_check.py [--stages 2,3]

Modes A (no gate), B (dht, dh0), C (scalar gate), fixed lengths and varlen, K = V = 64/128;
each row prints both kernels' max relative norm error against the fp64 reference (dh, dv2, dh0)
and their medians (triton.testing.do_bench), kernel launch only. A hang (a barrier protocol
error) shows as no output: run it under `timeout`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from gluon_bwd_dhu_ws import bwd_dhu_ws  # noqa: E402
from flash_dma.ops.gated_delta_rule.layout import chunk_layout  # noqa: E402
from flash_dma.ops.gated_delta_rule.plan import plan_bwd_dhu  # noqa: E402
from flash_dma.ops.gated_delta_rule.reference import bwd_dhu_reference  # noqa: E402
from flash_dma.ops.gated_delta_rule.triton.bwd_dhu import bwd_dhu as bwd_dhu_triton  # noqa: E402
from ops.gated_delta_rule.cases import cu_from_lengths, dhu_inputs  # noqa: E402

CASES = [  # label, B, T, H, K, mode, lengths
    ("B2 T300 H2 K64 A", 2, 300, 2, 64, "A", None),
    ("B2 T300 H2 K128 B", 2, 300, 2, 128, "B", None),
    ("B2 T300 H2 K128 C", 2, 300, 2, 128, "C", None),
    ("varlen T700 H2 K128 C", 1, 700, 2, 128, "C", [1, 64, 0, 300, 335]),
]
TIMED = [  # label, B, T, H, mode
    ("B1 T8192 H16 C", 1, 8192, 16, "C"), ("B1 T32768 H16 C", 1, 32768, 16, "C"),
    ("B4 T4096 H16 A", 4, 4096, 16, "A"), ("B4 T4096 H16 C", 4, 4096, 16, "C"),
    ("B2 T8192 H32 C", 2, 8192, 32, "C"), ("B8 T4096 H32 C", 8, 4096, 32, "C"),
]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_both(x, cu, stages):
    q, k, w, do, dv = x["q"], x["k"], x["w"], x["do"], x["dv"]
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    layout = chunk_layout(B, T, cu)
    plan = plan_bwd_dhu(q.device, B, T, H, HV, K, V, layout, x["g"] is not None, False)
    scale = K ** -0.5
    want = x["dht"] is not None
    dht = None if x["dht"] is None else x["dht"].float().contiguous()
    ours = lambda: bwd_dhu_ws(layout, q, k, w, do, dv, x["g"], dht, want, scale, stages)  # noqa: E731
    theirs = lambda: bwd_dhu_triton(plan, layout, q, k, w, do, dv, x["g"], None, dht, want, scale)  # noqa: E731
    return ours, theirs, layout, plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2")
    args = parser.parse_args()
    configs = [int(c) for c in args.stages.split(",")]
    env = environment()
    print(f"device: {env['device']} | torch {env['torch']} | triton {env['triton']} | bf16")
    print("-- errors against the fp64 reference (max over dh, dv2, dh0) --")
    for label, B, T, H, K, mode, lengths in CASES:
        cu = None if lengths is None else cu_from_lengths(lengths).cuda()
        x = dhu_inputs(B, T, H, H, K, K, torch.bfloat16, mode, cu)
        args_ref = (x["q"], x["k"], x["w"], x["do"], x["dv"])
        ref_dh, ref_dh0, ref_dv2 = bwd_dhu_reference(*args_ref, g=x["g"], gk=None, h0=x["h0"], dht=x["dht"],
                                                     scale=K ** -0.5, cu_seqlens=cu)
        for stages in configs:
            ours, theirs, layout, _ = run_both(x, cu, stages)
            errs = []
            for fn in (ours, theirs):
                dh, dh0, dv2 = fn()
                torch.cuda.synchronize()
                n = ref_dh.shape[1] if layout.is_varlen else None
                got_dh = dh[:ref_dh.shape[1]].unsqueeze(0) if layout.is_varlen else dh.view(ref_dh.shape)
                e = max(rel(got_dh, ref_dh), rel(dv2, ref_dv2))
                if ref_dh0 is not None:
                    e = max(e, rel(dh0, ref_dh0))
                bad = not torch.isfinite(dv2).all() or not torch.isfinite(got_dh).all()
                errs.append(float("inf") if bad else e)
                del n
            print(f"{label:<26} S{stages}: warp roles {errs[0]:.2e}  triton {errs[1]:.2e}", flush=True)
    print("-- times, ms (kernel launch only) --")
    for label, B, T, H, mode in TIMED:
        gen = torch.Generator(device="cuda").manual_seed(0)
        K = V = 128
        x = {"q": torch.randn(B, T, H, K, device="cuda", generator=gen).div(K ** 0.5).bfloat16(),
             "k": torch.randn(B, T, H, K, device="cuda", generator=gen).div(K ** 0.5).bfloat16(),
             "w": torch.randn(B, T, H, K, device="cuda", generator=gen).div(K ** 0.5).bfloat16(),
             "do": torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16(),
             "dv": torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16(),
             "g": (torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 4)
                   .view(B, T // 64, 64, H).cumsum(2).view(B, T, H)) if mode == "C" else None,
             "dht": None}
        _, theirs, _, plan = run_both(x, None, 2)
        t_triton = time_ms(theirs)
        cfg = plan.launches["bwd_dhu"].value
        row = [f"{label:<18} triton {t_triton:.3f} (BV{cfg.block_v} W{cfg.num_warps} S{cfg.num_stages})"]
        for stages in configs:
            ours, _, _, _ = run_both(x, None, stages)
            t = time_ms(ours)
            d_ours, d_theirs = ours(), theirs()
            diff = max(rel(a, b) for a, b in zip((d_ours[0], d_ours[2]), (d_theirs[0], d_theirs[2])))
            row.append(f"warp roles S{stages} {t:.3f} ({t_triton / t:.2f}x, diff {diff:.1e})")
        print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
