"""Plain attention on the GPU: the CuTe backend (FA4's kernels through cute/plain.py) beside
flash-dma's Triton kernels and SDPA's cuDNN backend, in one process, bf16.

    python bench/cute_plain_check.py [--quick]

Rows: B4 S4096 H16 D64, H16 D128, H8 D256, causal and not; forward and backward each timed with
triton.testing.do_bench (median ms, L2 flushed). The CuTe backward is timed as one call of
plain.backward (FA4's preprocess, main and postprocess kernels); Triton's and cuDNN's as
torch.autograd.grad of a kept graph. Each row also checks out, lse and dq/dk/dv of every backend
against the fp64 reference on batch 0, heads 0-1 (heads are independent, so the slice of the full
run is exact), by relative-error norm. The first call of each CuTe feature set (which compiles)
is timed too. Writes bench/results/cute-plain-<device>-<date>.txt and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.runtime.config import overrides  # noqa: E402
from flash_dma import flash_dma_func  # noqa: E402
from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from flash_dma.ops.dynamic_mask_attention import attention_reference  # noqa: E402
from flash_dma.ops.dynamic_mask_attention.cute import availability, plain  # noqa: E402

DTYPE = torch.bfloat16
SHAPES = [(4, 4096, 16, 64), (4, 4096, 16, 128), (4, 4096, 8, 256)]  # (B, S, H, D)
QUICK_SHAPES = [(2, 2048, 16, 128)]
CHECK_HEADS = 2


def stack_line(env: dict) -> str:
    """The device and the stack's versions, as every CuTe report's header names them."""
    return (f"{env.get('device')} | torch {env.get('torch')} | triton {env.get('triton')} | "
            f"CUDA {env.get('cuda')} | flash-attn-4 {env.get('flash-attn-4')} | "
            f"nvidia-cutlass-dsl {env.get('nvidia-cutlass-dsl')} | "
            f"quack-kernels {env.get('quack-kernels')} | {env.get('date')}")


def backend(name: str):
    """The attention backend for the calls inside ("triton", "cute" or "auto")."""
    return overrides(attention_backend=name)


def flops(B, S, H, D, causal, backward):
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


def rel_err(x, ref):
    x64, ref64 = x.double(), ref.double()
    if torch.isnan(x64).any():
        return math.inf
    return ((x64 - ref64).norm() / ref64.norm()).item()


def lse_err(lse, ref):
    if torch.isnan(lse).any() or not torch.equal(lse == math.inf, ref == math.inf):
        return math.inf
    finite = torch.isfinite(ref)
    return (lse[finite].double() - ref[finite]).abs().max().item() if finite.any() else 0.0


def reference(q, k, v, dout, causal):
    """fp64 out, lse, dq, dk, dv of batch 0, heads 0..CHECK_HEADS-1."""
    leaves = [t[:1, :, :CHECK_HEADS].detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, is_causal=causal)
    out.backward(dout[:1, :, :CHECK_HEADS].double())
    return out.detach(), lse, *(t.grad for t in leaves)


def errors(out, lse, grads, ref):
    s = (slice(0, 1), slice(None), slice(0, CHECK_HEADS))
    errs = {"out": rel_err(out[s], ref[0])}
    if lse is not None:
        errs["lse"] = lse_err(lse[:1, :CHECK_HEADS], ref[1])
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        errs[name] = rel_err(g[s], r)
    return errs


def run_cute(q, k, v, dout, causal, scale):
    start = time.perf_counter()
    out, lse = plain.forward(q, k, v, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    first_fwd = time.perf_counter() - start
    start = time.perf_counter()
    grads = plain.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    first_bwd = time.perf_counter() - start
    fwd_ms = time_ms(lambda: plain.forward(q, k, v, causal=causal, softmax_scale=scale))
    bwd_ms = time_ms(lambda: plain.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale))
    return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, first_fwd_s=first_fwd, first_bwd_s=first_bwd), out, lse, grads


def run_autograd(fwd, leaves, dout):
    out = fwd()
    lse = None
    if isinstance(out, tuple):
        out, lse = out
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    fwd_ms = time_ms(fwd)
    bwd_ms = time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms), out.detach(), lse, [g.detach() for g in grads]


def run_triton(q, k, v, dout, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with backend("triton"):
            return flash_dma_func(*leaves, is_causal=causal, return_lse=True)
    return run_autograd(fwd, leaves, dout)


def run_cudnn(q, k, v, dout, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    timing, out, _, grads = run_autograd(fwd, leaves, dout.transpose(1, 2).contiguous())
    return timing, out.transpose(1, 2), None, [g.transpose(1, 2) for g in grads]


def fmt_rate(ms, fl):
    return f"{fl / ms / 1e9:5.0f}" if ms else "  n/a"


def cute_status_here() -> str | None:
    """Why the CuTe backend cannot run on this machine's GPU, or None (cute_masked_check.py too)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return availability.cute_backend_status(torch.device("cuda"))


def cute_environment() -> dict | None:
    """The run's environment with the CuTe stack's versions, or None (after saying why) where
    the CuTe backend cannot run here: the start of every CuTe report in bench/."""
    status = cute_status_here()
    if status is not None:
        print(f"cannot run: {status}")
        return None
    import importlib.metadata as md
    env = environment()
    env.update({name: md.version(name) for name in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels")})
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    env = cute_environment()
    if env is None:
        return 2
    env["cudnn"] = torch.backends.cudnn.version()
    rows, bad = [], []
    for B, S, H, D in (QUICK_SHAPES if args.quick else SHAPES):
        for causal in (False, True):
            label = f"B{B} S{S} H{H} D{D}{' causal' if causal else ''}"
            q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
            ref = reference(q, k, v, dout, causal)
            row = {"config": label, "B": B, "S": S, "H": H, "D": D, "causal": causal,
                   "fwd_flops": flops(B, S, H, D, causal, False), "bwd_flops": flops(B, S, H, D, causal, True)}
            for name, run in (("cute", lambda: run_cute(q, k, v, dout, causal, D ** -0.5)),
                              ("triton", lambda: run_triton(q, k, v, dout, causal)),
                              ("cudnn", lambda: run_cudnn(q, k, v, dout, causal))):
                try:
                    timing, out, lse, grads = run()
                except Exception as exc:  # a backend refusing a shape is a result, not a crash
                    row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"}
                    bad.append(f"{label} {name}: {row[name]['error']}")
                    continue
                errs = errors(out, lse, grads, ref)
                row[name] = {**timing, "errors": errs}
                limit = 1e-2
                worst = max(v for key, v in errs.items() if key != "lse")
                if worst > limit or errs.get("lse", 0) > 1e-2:
                    bad.append(f"{label} {name}: errors {errs}")
                del out, lse, grads
                torch.cuda.empty_cache()
            rows.append(row)
            print(format_row(row), flush=True)
    text = report(env, rows, bad)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    device = env["device"].replace(" ", "-")
    stem = os.path.join(args.out, f"cute-plain-{device}-{datetime.date.today():%Y%m%d}{'-quick' if args.quick else ''}")
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"environment": env, "rows": rows, "problems": bad}, f, indent=1)
    print(f"wrote {stem}.txt and .json")
    return 1 if bad else 0


def format_row(row) -> str:
    parts = [f"{row['config']:<26}"]
    for direction in ("fwd", "bwd"):
        fl = row[f"{direction}_flops"]
        rates = []
        for name in ("cute", "triton", "cudnn"):
            ms = row.get(name, {}).get(f"{direction}_ms")
            rates.append(f"{name} {ms:7.3f} ms {fmt_rate(ms, fl)} TF/s" if ms else f"{name} failed")
        cute_ms = row.get("cute", {}).get(f"{direction}_ms")
        ratios = []
        for peer in ("triton", "cudnn"):
            peer_ms = row.get(peer, {}).get(f"{direction}_ms")
            ratios.append(f"vs {peer} {peer_ms / cute_ms:4.2f}x" if cute_ms and peer_ms else f"vs {peer} n/a")
        parts.append(f"{direction}: " + " | ".join(rates) + " | cute " + ", ".join(ratios))
    return "\n  ".join(parts)


def report(env, rows, bad) -> str:
    lines = ["== plain attention: CuTe backend (FA4) vs flash-dma Triton vs SDPA cuDNN, bf16 ==",
             f"{env.get('sm_count')} SMs, sm {env.get('capability')}, cuDNN {env.get('cudnn')} | "
             f"{stack_line(env)}", "",
             f"{'config':<26} {'pass':<4} | {'cute TF/s':>9} {'triton TF/s':>11} {'cudnn TF/s':>10} | "
             f"{'cute/triton':>11} {'cute/cudnn':>10} | {'cute first call':>15} | max rel err cute/triton/cudnn"]
    for row in rows:
        for direction in ("fwd", "bwd"):
            fl = row[f"{direction}_flops"]
            ms = {n: row.get(n, {}).get(f"{direction}_ms") for n in ("cute", "triton", "cudnn")}
            speed = {n: (ms[n] / ms["cute"] if ms[n] and ms["cute"] else None) for n in ("triton", "cudnn")}
            first = row.get("cute", {}).get(f"first_{direction}_s")
            errs = []
            for n in ("cute", "triton", "cudnn"):
                e = row.get(n, {}).get("errors")
                keys = ("out",) if direction == "fwd" else ("dq", "dk", "dv")
                errs.append(f"{max(e[k] for k in keys):.1e}" if e else "n/a")
            lines.append(
                f"{row['config']:<26} {direction:<4} | {fmt_rate(ms['cute'], fl):>9} {fmt_rate(ms['triton'], fl):>11} "
                f"{fmt_rate(ms['cudnn'], fl):>10} | "
                + (f"{speed['triton']:10.2f}x" if speed['triton'] else f"{'n/a':>11}") + " "
                + (f"{speed['cudnn']:9.2f}x" if speed['cudnn'] else f"{'n/a':>10}")
                + f" | {first:13.1f} s | " + "/".join(errs) if first is not None else
                f"{row['config']:<26} {direction:<4} | cute failed: {row.get('cute', {}).get('error')}")
    lines.append("")
    lines.append("cute/triton and cute/cudnn: the peer's time over the CuTe backend's (above 1: CuTe faster). "
                 "First call: wall seconds of the row's first CuTe forward/backward, the compilation of "
                 "its feature set included (each row is a new head dim or causal flag).")
    if bad:
        lines.append("PROBLEMS:")
        lines.extend("  " + b for b in bad)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
