"""The fused Hopper forward of the gated delta rule (gluon/forward_fused.py) against the Triton
forward's state pass + output: errors against the fp64 recurrence and the Triton forward, then
do_bench medians of the forward's parts.

    python bench/gdn_fused_forward.py [--check-only] [--variants 64x2,128x2] [--out DIR]
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from flash_dma.ops.gated_delta_rule import autograd as gdn  # noqa: E402
from flash_dma.ops.gated_delta_rule.gluon.forward_fused import forward_fused  # noqa: E402
from flash_dma.ops.gated_delta_rule.gluon.forward_ws import forward_ws  # noqa: E402
from flash_dma.ops.gated_delta_rule.layout import chunk_layout  # noqa: E402
from flash_dma.ops.gated_delta_rule.plan import plan_call  # noqa: E402
from flash_dma.ops.gated_delta_rule.reference import gated_delta_rule_reference  # noqa: E402


def make(B, T, HQ, HV, K, V, gate=True, h0=False, cu=None, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    norm = torch.nn.functional.normalize
    n = B if cu is None else len(cu) - 1
    return dict(q=norm(randn(B, T, HQ, K), dim=-1).to(dtype), k=norm(randn(B, T, HQ, K), dim=-1).to(dtype),
                v=randn(B, T, HV, V).to(dtype),
                g=torch.nn.functional.logsigmoid(randn(B, T, HV) + 2) if gate else None,
                beta=torch.rand(B, T, HV, generator=gen, device="cuda").sigmoid().to(dtype),
                h0=randn(n, HV, K, V) * 0.1 if h0 else None,
                cu=None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32))


def prepared(x):
    q, k, v = x["q"], x["k"], x["v"]
    layout = chunk_layout(q.shape[0], q.shape[1], x["cu"])
    plan = plan_call(q, v, x["g"] is not None, False, layout)
    scale = q.shape[-1] ** -0.5
    g_cum, _, _, _, ai, _, _, _ = gdn._prepare(plan, layout, q, k, v, x["beta"], x["g"], None, scale, store_wu=False)
    return layout, plan, scale, g_cum, ai


def fused(x, bv, stages, prep=None):
    """bv 0: the warp-specialised kernel (64-wide V tiles)."""
    layout, plan, scale, g_cum, ai = prep or prepared(x)
    if bv == 0:
        return forward_ws(layout, x["q"], x["k"], x["v"], x["beta"], ai, g_cum, x["h0"], True, scale, stages)
    return forward_fused(layout, x["q"], x["k"], x["v"], x["beta"], ai, g_cum, x["h0"], True, scale, bv, stages)


def triton_forward(x):
    q = x["q"]
    o, final, *_ = gdn.run_forward(q, x["k"], x["v"], x["g"], None, x["beta"], q.shape[-1] ** -0.5, x["h0"],
                                   True, x["cu"])
    return o, final


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


CHECKS = [  # B, T, HQ, HV, K, V, gate, h0, cu_seqlens
    (2, 1000, 4, 4, 128, 128, True, True, None),
    (1, 64, 2, 2, 128, 128, True, False, None),
    (1, 65, 2, 2, 128, 128, True, True, None),
    (3, 333, 2, 4, 64, 128, False, False, None),
    (2, 200, 2, 2, 64, 64, True, True, None),
    (1, 1000, 2, 2, 128, 128, True, True, [0, 1, 300, 300, 1000]),
    (1, 777, 1, 2, 128, 256, True, False, [0, 128, 129, 777]),
]


def checks(variants, lines):
    worst = 0.0
    for case in CHECKS:
        B, T, HQ, HV, K, V, gate, h0, cu = case
        x = make(B, T, HQ, HV, K, V, gate, h0, cu)
        o_ref, ht_ref = gated_delta_rule_reference(
            x["q"].double(), x["k"].double(), x["v"].double(), None if x["g"] is None else x["g"].double(),
            x["beta"].double(), scale=K ** -0.5, initial_state=None if x["h0"] is None else x["h0"].double(),
            output_final_state=True, cu_seqlens=x["cu"])
        o_tri, ht_tri = triton_forward(x)
        base = f"tri: o {rel(o_tri, o_ref):.2e} ht {rel(ht_tri, ht_ref):.2e}"
        for bv, st in variants:
            if V % max(bv, 64):
                continue
            o, ht = fused(x, bv, st)
            torch.cuda.synchronize()
            eo, eh, ot = rel(o, o_ref), rel(ht, ht_ref), rel(o, o_tri)
            worst = max(worst, eo if eo == eo else 1.0, eh if eh == eh else 1.0)
            lines.append(f"check {case} BV{bv}x{st}: o {eo:.2e} ht {eh:.2e} (vs triton o {ot:.2e}); {base}")
            print(lines[-1], flush=True)
    return worst


BENCH = [  # label, B, T, H, K, V
    ("B4 T4096 H16", 4, 4096, 16, 128, 128),
    ("B8 T4096 H32", 8, 4096, 32, 128, 128),
    ("B16 T4096 H32", 16, 4096, 32, 128, 128),
    ("B1 T8192 H16", 1, 8192, 16, 128, 128),
    ("B1 T32768 H16", 1, 32768, 16, 128, 128),
]


def bench(variants, lines):
    rows = []
    for label, B, T, H, K, V in BENCH:
        x = make(B, T, H, H, K, V, True, False)
        prep = prepared(x)
        t_fwd = triton.testing.do_bench(lambda: triton_forward(x))
        t_prep = triton.testing.do_bench(lambda: prepared(x))
        row = [label, f"{t_fwd:.3f}", f"{t_prep:.3f}", f"{t_fwd - t_prep:.3f}"]
        for bv, st in variants:
            t = triton.testing.do_bench(lambda: fused(x, bv, st, prep))
            row += [f"{t:.3f}", f"{t_prep + t:.3f}"]
        rows.append(row)
        print(" | ".join(row), flush=True)
    head = ["shape", "Triton fwd", "prepare", "Triton states+o"]
    for bv, st in variants:
        head += [f"fused BV{bv}x{st}", "prepare+fused"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + " --- |" * len(head))
    lines += ["| " + " | ".join(r) + " |" for r in rows]


OFF = {"gdn_fused_forward": 0}


def _form(form, cut=None):
    return {"gdn_fused_forward": form, **({"gdn_chunks_per_segment": cut} if cut else {})}


PLAN_CASES = [  # label, B, T, H, {name: overrides}
    ("B2 T4096 H16", 2, 4096, 16, {"triton": OFF, "rule": {}, "one-role 64": _form(64)}),
    ("B4 T4096 H16", 4, 4096, 16, {"triton": OFF, "rule": {}, "one-role 64": _form(64)}),
    ("B8 T4096 H32", 8, 4096, 32, {"triton": OFF, "rule": {}, "ws": _form("ws"), "one-role 128": _form(128)}),
    ("B1 T8192 H16", 1, 8192, 16, {"triton": OFF, "rule": {}, "ws": _form("ws"), "ws, cut 16": _form("ws", 16),
                                   "ws, cut 32": _form("ws", 32)}),
    ("B1 T32768 H16", 1, 32768, 16, {"triton (cut 64)": OFF, "rule": {}, "ws, cut 32": _form("ws", 32),
                                     "ws, cut 64": _form("ws", 64), "ws, cut 128": _form("ws", 128),
                                     "one-role 64, cut 64": _form(64, 64)}),
    ("B16 T4096 H32", 16, 4096, 32, {"rule": {}, "ws": _form("ws"), "one-role 128": _form(128)}),
]
ONLY_PLANS = None  # --plans: a comma-separated subset of PLAN_CASES' labels


def plans(lines):
    """The whole forward and forward + backward through the plan, Triton passes against the
    fused forward (rule or forced, whole or cut)."""
    from flash_dma import chunk_gated_delta_rule
    from flash_dma.runtime.config import overrides

    lines.append("")
    lines.append("| shape | plan | fwd ms | fwd+bwd ms |")
    lines.append("| --- | --- | --- | --- |")
    for label, B, T, H, variants in PLAN_CASES:
        if ONLY_PLANS and label not in ONLY_PLANS:
            continue
        x = make(B, T, H, H, 128, 128, True, True)
        leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
        do = torch.randn_like(x["v"])
        for name, chosen in variants.items():
            with overrides(**chosen):
                def fwd():
                    return chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                                  leaves["beta"], initial_state=x["h0"], output_final_state=True)

                def fwd_bwd():
                    o, _ = fwd()
                    torch.autograd.grad(o, list(leaves.values()), do)
                with torch.no_grad():
                    t_f = triton.testing.do_bench(fwd)
                t_fb = triton.testing.do_bench(fwd_bwd)
            lines.append(f"| {label} | {name} | {t_f:.3f} | {t_fb:.3f} |")
            print(lines[-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-plans", action="store_true")
    ap.add_argument("--variants", default="64x2,128x2")  # V tile x stages
    ap.add_argument("--plans", default=None, help="comma-separated PLAN_CASES labels (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    global ONLY_PLANS
    ONLY_PLANS = args.plans.split(",") if args.plans else None
    variants = [tuple(int(p) for p in v.split("x")) for v in args.variants.split(",")]
    lines = [f"# gdn fused forward, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}, {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, bf16, K = V = 128 in timings"]
    worst = checks(variants, lines)
    lines.append(f"worst relative error vs fp64: {worst:.2e}")
    if not args.check_only:
        bench(variants, lines)
        if not args.no_plans:
            plans(lines)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "gdn_fused_forward.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
