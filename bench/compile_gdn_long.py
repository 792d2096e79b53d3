"""One long sequence through the gated delta rule, eager against torch.compile(fullgraph=True):
forward + backward medians (triton.testing.do_bench). Where the plan cuts the state pass into
segments, both paths keep the segments' starts and transitions for the backward (the compiled
one through its custom ops' extra outputs), so their times should match.

    python bench/compile_gdn_long.py [--shape B,T,H]

bf16, K = V = 128, scalar gate, h0 + final state. Writes bench/results/compile-gdn-<device>-<date>.txt.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import environment, time_ms  # noqa: E402
from sweep_gdn_segments import call, make_inputs, rel_err  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,32768,16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compile_gdn_long.py: no CUDA GPU here; nothing can be timed")
    B, T, H = map(int, args.shape.split(","))
    x = make_inputs(B, T, H, None, False)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [x[n].detach().requires_grad_() for n in names]

    def forward(*tensors):
        return call(x, dict(zip(names, tensors), gk=None))

    def stepper(fwd):
        def step(*tensors):
            o, final = fwd(*tensors)
            return [o, final, *torch.autograd.grad([o, final], tensors, [x["do"], x["dht"]])]
        return step

    env = environment()
    lines = [f"# gated delta rule, eager vs torch.compile(fullgraph=True), B{B} T{T} H{H} K=V=128 bf16 g, h0 + final state",
             f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | {datetime.date.today():%Y-%m-%d}",
             f"{'path':<28} {'fwd+bwd ms':>11} {'max rel err vs eager':>22}"]
    reference = stepper(forward)(*leaves)
    for name, fn in (("eager", stepper(forward)),
                     ("compiled aot_eager", stepper(torch.compile(forward, backend="aot_eager", fullgraph=True))),
                     ("compiled inductor", stepper(torch.compile(forward, fullgraph=True)))):
        results = fn(*leaves)
        err = max(rel_err(r, ref) for r, ref in zip(results, reference))
        ms = time_ms(lambda: fn(*leaves))
        lines.append(f"{name:<28} {ms:11.3f} {err:22.1e}")
        print(lines[-1], flush=True)
    out = os.path.join(os.path.dirname(__file__), "results")
    device = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
    path = os.path.join(out, f"compile-gdn-{device}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
