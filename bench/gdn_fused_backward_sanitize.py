"""The gated delta rule's SM90 backward kernels on small cases, for compute-sanitizer (memcheck,
racecheck): the fused chunk backward (gluon/backward_chunk.py, --choice gdn_fused_backward, the
default), the warp-role bwd_dhu (gluon/bwd_dhu_ws.py, --choice gdn_dhu_warp_roles) or the warp-role
backward (gluon/backward_ws.py, --choice gdn_backward_warp_roles); varlen with
empty and single-token sequences, GQA, K = V = 64, V != K, a lone partial chunk. Each case's
gradients are checked against the Triton passes (a sanitizer run that computes garbage is not a
clean run); one line per case.

    compute-sanitizer --tool memcheck --kernel-name kns=gdn_bwd_chunk python bench/gdn_fused_backward_sanitize.py
    compute-sanitizer --tool racecheck --kernel-name kns=gdn_bwd_dhu_ws python bench/gdn_fused_backward_sanitize.py \
        --choice gdn_dhu_warp_roles
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

CASES = [  # K, V, HQ, HV, varlen lengths or (B, T)
    (128, 128, 1, 2, [1, 0, 70, 129]),
    (64, 64, 2, 4, (2, 200)),
    (128, 64, 1, 1, [65]),
]


def grads(case, choice, on):
    K, V, HQ, HV, shape = case
    lengths = shape if isinstance(shape, list) else None
    B, T = (1, sum(lengths)) if lengths else shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    n = B if lengths is None else len(lengths)
    leaves = dict(q=F.normalize(randn(B, T, HQ, K), dim=-1).bfloat16(), k=F.normalize(randn(B, T, HQ, K), dim=-1).bfloat16(),
                  v=randn(B, T, HV, V).bfloat16(), g=F.logsigmoid(randn(B, T, HV) + 2),
                  beta=torch.rand(B, T, HV, device="cuda", generator=gen).bfloat16(), h0=randn(n, HV, K, V) * 0.1)
    for t in leaves.values():
        t.requires_grad_()
    cu = None if lengths is None else torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda",
                                                   dtype=torch.int32)
    with overrides(**{choice: on}):
        o, final = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                          initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu)
        return torch.autograd.grad([o, final], list(leaves.values()), [randn(*o.shape).bfloat16(), randn(*final.shape)])


def main() -> int:
    choice = sys.argv[sys.argv.index("--choice") + 1] if "--choice" in sys.argv else "gdn_fused_backward"
    bad = 0
    for case in CASES:
        fused, triton_passes = grads(case, choice, True), grads(case, choice, False)
        torch.cuda.synchronize()
        err = max(float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
                  for a, b in zip(fused, triton_passes))
        ok = err < 1e-2 and all(torch.isfinite(t).all() for t in fused)
        bad += not ok
        print(f"K{case[0]} V{case[1]} HQ{case[2]} HV{case[3]} {case[4]}: max relative difference to the Triton "
              f"passes {err:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
