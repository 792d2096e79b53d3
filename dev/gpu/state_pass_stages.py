"""One launch configuration of a state pass (fwd_h, fwd_h_from_t or bwd_dhu), forced through the
public op's forward + backward, in its own process (an illegal address ends the process):

    python dev/gpu/state_pass_stages.py PASS K BV WARPS STAGES   # prints ok / the error

Checks the gradients against the plan's own configuration in the same process.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig  # noqa: E402
from flash_dma.runtime import config  # noqa: E402


def main():
    name, K, bv, warps, stages = sys.argv[1], *map(int, sys.argv[2:])
    B, T, H = 1, 1024, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1)
            .to(torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, K, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 2).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).sigmoid().to(torch.bfloat16).requires_grad_()
    do = torch.randn_like(v)
    leaves = [q, k, v, g, beta]

    def grads():
        out = chunk_gated_delta_rule(q, k, v, g, beta)[0]
        return [out] + list(torch.autograd.grad(out, leaves, do))
    want = grads()
    label = f"{name} K{K} BV{bv} W{warps} S{stages}"
    try:
        with config.overrides(**{f"gdn_{name}": GdnConfig(K, bv, warps, stages)}):
            got = grads()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return
    err = max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, want))
    print(f"{label}: {'ok' if err <= 1e-2 else 'differs'} (max rel. error {err:.1e})")


if __name__ == "__main__":
    main()
