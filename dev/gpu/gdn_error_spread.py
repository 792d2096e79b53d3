"""Spread of the relative errors against the fp64 reference over many random seeds, for one of
the test shapes: where a test's bound sits against its error's tail (the tests draw a fresh seed
per run, so a bound near the tail fails now and then).

    python dev/gpu/gdn_error_spread.py [--seeds 200] [--shape "1 67 1 1 32 32 g"] [--l2norm] [--dtype bf16]
"""
import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "ops", "gated_delta_rule")]

import torch  # noqa: E402

import cases  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--shape", default="1 67 1 1 32 32 g", help="B T H HV K V gate")
    parser.add_argument("--l2norm", action="store_true", help="use_qk_l2norm_in_kernel, keys not unit-norm")
    parser.add_argument("--q-scale", type=float, default=3.0, help="with --l2norm: q times this")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, T, H, HV, K, V, gate = args.shape.split()
    measured = []
    cases.check_errors = lambda pairs, dt, bounds=None: {n: cases.rel_err(g, w) for n, (g, w) in pairs.items()}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        inputs = cases.make_inputs(int(B), int(T), int(H), int(HV), int(K), int(V), dtype, gate, False,
                                   normalize_k=not args.l2norm)
        kwargs = {}
        if args.l2norm:
            inputs["q"] = inputs["q"] * args.q_scale
            kwargs["use_qk_l2norm_in_kernel"] = True
        errors, _ = cases.check_against_reference(inputs, dtype, **kwargs)
        measured.append((seed, errors))
    names = list(measured[0][1])
    print(f"{args.seeds} seeds, shape {args.shape}, {args.dtype}, l2norm {args.l2norm}")
    print(f"{'':12}" + "".join(f"{n:>10}" for n in names))
    for label, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        row = [torch.tensor([float(e[n]) for _, e in measured]).quantile(q).item() for n in names]
        print(f"{label:12}" + "".join(f"{v:10.2e}" for v in row))
    print(f"{'bound':12}" + "".join(f"{cases.bound(n, dtype):10.2e}" for n in names))
    worst = max(measured, key=lambda m: max(float(v) / cases.bound(n, dtype) for n, v in m[1].items()))
    print("worst seed", worst[0], {n: f"{float(v):.2e}" for n, v in worst[1].items()})


if __name__ == "__main__":
    main()
