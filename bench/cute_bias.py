"""The CuTe backend's bias paths (forward and backward) beside the Triton backend and
FlexAttention, bf16, one process:

    python bench/cute_bias.py [--cases "D128 full,D128 key"] [--variants ...] [--budget-s 480]

- cute-direct: the CuTe backend with its defaults: FA4's SM90 forward with the bias added from
  the score fragment's coordinates (cute/forward_bias.py: paired loads, the next key tile's bias
  prefetched into registers at D128, to L2 elsewhere) and its backward re-adding the bias and
  writing dbias the same way (cute/backward_bias.py); direct-no-pairs, direct-no-prefetch,
  direct-L1, direct-L2, direct-registers and direct-tma (whole bias tiles by TMA into shared
  memory, cute/forward_bias_tma.py) change one forward choice; hooks-backward puts
  FA4's per-element hooks back in the backward; the backward loads the bias and stores dbias by
  TMA through FA4's shared dS tile where it can (cute/backward_bias_tma.py): bwd-direct turns
  both off, bwd-bias-tma and bwd-dbias-tma keep one;
- cute-hook: both passes through FA4's per-element score_mod hooks (hooks.py);
- auto: what a call gets by default (the backend and paths select.py picks);
- triton: flash-dma's Triton backend; flex: FlexAttention with a score_mod reading the bias;
- cute-plain: the same problem without the bias (what the bias costs).
The forward is timed alone (do_bench median), the backward as torch.autograd.grad of a kept
graph (the hooks' path on CuTe unless a variant says otherwise). Each variant's output and gradients are
checked against the fp64 reference on batch 0, heads 0-1 (bound 1e-2). Cases: B2 S4096 at D64
and D128 (H16) and D256 (H8), bias [B,H,S,S] ("full", with and without causal) and [B,H,1,S]
("key"). Writes bench/results/cute-bias-<device>-<date>.txt.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from cute_masked_check import BOUND, recording, runner, sliced_reference, speed_errors, worst  # noqa: E402
from cute_plain_check import cute_environment, stack_line  # noqa: E402
from flash_dma.benchmarks import attention as peers  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

CASES = {
    "D128 full": dict(H=16, D=128, bias="full"),
    "D128 full causal": dict(H=16, D=128, bias="full", causal=True),
    "D128 key": dict(H=16, D=128, bias="key"),
    "D128 key shared": dict(H=16, D=128, bias="key-shared"),
    "D64 full": dict(H=16, D=64, bias="full"),
    "D64 full causal": dict(H=16, D=64, bias="full", causal=True),
    "D256 full": dict(H=8, D=256, bias="full"),
    "D64 key": dict(H=16, D=64, bias="key"),
    "D256 key": dict(H=8, D=256, bias="key"),
}
DIRECT = dict(attention_cute_bias=True, attention_cute_direct_bias=True)
VARIANTS = {
    "cute-direct": ("cute", DIRECT),
    "direct-no-pairs": ("cute", dict(DIRECT, attention_cute_bias_pairs=False)),
    "direct-no-prefetch": ("cute", dict(DIRECT, attention_cute_bias_prefetch="none")),
    "direct-L1": ("cute", dict(DIRECT, attention_cute_bias_prefetch="L1")),
    "direct-L2": ("cute", dict(DIRECT, attention_cute_bias_prefetch="L2")),
    "direct-registers": ("cute", dict(DIRECT, attention_cute_bias_prefetch="registers")),
    "direct-tma": ("cute", dict(DIRECT, attention_cute_bias_prefetch="tma")),
    "tma-evict-first": ("cute", dict(DIRECT, attention_cute_bias_prefetch="tma",
                                     attention_cute_bias_tma_evict_first=True)),
    "hooks-backward": ("cute", dict(DIRECT, attention_cute_direct_bias_backward=False)),
    "bwd-direct": ("cute", dict(DIRECT, attention_cute_dbias_tma=False,
                                attention_cute_bias_tma_backward=False)),
    "bwd-bias-tma": ("cute", dict(DIRECT, attention_cute_dbias_tma=False)),
    "bwd-dbias-tma": ("cute", dict(DIRECT, attention_cute_bias_tma_backward=False)),
    "cute-hook": ("cute", dict(attention_cute_bias=True, attention_cute_direct_bias=False,
                               attention_cute_direct_bias_backward=False)),
    "auto": ("auto", {}),
    "triton": ("triton", {}),
    "flex": ("flex", {}),
    "cute-plain": ("cute", {}),
}


def run_variant(name, case, x, ref):
    build, choices = VARIANTS[name]
    inputs = x if name != "cute-plain" else peers.Inputs(x.q, x.k, x.v, None, None, None, x.dout)
    with overrides(**choices), recording() as ran:
        fwd_ms, bwd_ms, out, grads = peers._measure(runner(build), case, inputs)
    errs = speed_errors(out, grads, ref) if name != "cute-plain" else {}
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "errors": errs,
            "backends": "/".join(sorted({f"{p}:{b}" for p, b in ran}))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    env = cute_environment()
    if env is None:
        return 2
    deadline = time.monotonic() + args.budget_s
    lines = [f"== CuTe bias paths beside Triton and Flex, bf16 B2 S4096 == {stack_line(env)}",
             f"{'case':<18} {'variant':<12} {'fwd ms':>8} {'bwd ms':>8}  backends / worst rel. error"]
    print(lines[0], flush=True)
    problems = []
    for label in [c.strip() for c in args.cases.split(",") if c.strip()]:
        fields = CASES[label]
        case = peers.AttnCase(label, 2, fields["H"], 4096, fields["D"], causal=fields.get("causal", False),
                              bias=fields["bias"])
        x = peers.make_inputs(case)
        ref = sliced_reference(x, case.causal)
        results = {}
        for name in [n.strip() for n in args.variants.split(",") if n.strip()]:
            if time.monotonic() > deadline:
                problems.append(f"{label} {name}: skipped (time budget)")
                continue
            try:
                results[name] = r = run_variant(name, case, x, ref)
                bad = r["errors"] and worst(r["errors"]) > BOUND
                if bad:
                    problems.append(f"{label} {name}: errors {r['errors']}")
                line = (f"{label:<18} {name:<12} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f}  {r['backends']}"
                        + (f" {worst(r['errors']):.1e}" if r["errors"] else "") + (" OVER BOUND" if bad else ""))
            except Exception as exc:  # a failure is a row
                problems.append(f"{label} {name}: {type(exc).__name__}: {exc}"[:300])
                line = f"{label:<18} {name:<12} FAILED {type(exc).__name__}: {str(exc)[:160]}"
                print(traceback.format_exc()[-2500:], flush=True)
            lines.append(line)
            print(line, flush=True)
            torch.cuda.empty_cache()
        fwd = {n: r["fwd_ms"] for n, r in results.items()}
        if "cute-direct" in fwd:
            ratios = ", ".join(f"{n} / direct {fwd[n] / fwd['cute-direct']:.2f}x" for n in fwd if n != "cute-direct")
            lines.append(f"{label:<18} forward ratios: {ratios}")
            print(lines[-1], flush=True)
        del x
        torch.cuda.empty_cache()
    lines.append("\nPROBLEMS:" if problems else "\nno problems")
    lines += ["  " + p for p in problems]
    os.makedirs(args.out, exist_ok=True)
    device = str(env.get("device", "gpu")).replace(" ", "-")
    path = os.path.join(args.out, f"cute-bias-{device}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-1 - len(problems):]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
