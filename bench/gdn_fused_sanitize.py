"""The gated delta rule's fused SM90 forward (gluon/) on small cases, for compute-sanitizer
(memcheck, racecheck): every form (warp roles, one role 64 and 128), whole and cut into
segments, fixed lengths and varlen with empty and single-token sequences, GQA, K 64. Each case
is checked against the Triton forward (a sanitizer run that computes garbage is not a clean
run); prints one line per case.

    compute-sanitizer --tool memcheck python bench/gdn_fused_sanitize.py
    compute-sanitizer --tool racecheck python bench/gdn_fused_sanitize.py [--only ws]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma import chunk_gated_delta_rule  # noqa: E402
from flash_dma.runtime.config import overrides  # noqa: E402

CASES = [  # B, T, HQ, HV, K, V, varlen lengths or None, chunks per segment or None
    (2, 200, 2, 2, 128, 128, None, None),
    (1, 130, 1, 2, 64, 128, None, 1),
    (1, 300, 1, 1, 128, 128, [1, 0, 130, 169], None),
    (1, 300, 1, 1, 128, 128, [70, 0, 1, 229], 2),
]


def run(case, form, dtype=torch.bfloat16):
    B, T, HQ, HV, K, V, lengths, cut = case
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, HQ, K, device="cuda", generator=gen), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, HQ, K, device="cuda", generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen) + 2)
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(dtype)
    cu = None if lengths is None else torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda",
                                                   dtype=torch.int32)
    n = B if cu is None else len(lengths)
    h0 = torch.randn(n, HV, K, V, device="cuda", generator=gen) * 0.1
    outs = {}
    for name, chosen in (("triton", {"gdn_fused_forward": 0}), (str(form), {"gdn_fused_forward": form})):
        if cut:
            chosen = {**chosen, "gdn_chunks_per_segment": cut}
        with overrides(**chosen):
            outs[name] = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu)
    torch.cuda.synchronize()
    (o_t, f_t), (o_f, f_f) = outs["triton"], outs[str(form)]
    err = max(((o_f.double() - o_t.double()).norm() / o_t.double().norm()).item(),
              ((f_f - f_t).norm() / f_t.norm()).item())
    return err


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="one form: ws, 64 or 128")
    args = parser.parse_args()
    forms = ["ws", 64, 128] if args.only is None else [args.only if args.only == "ws" else int(args.only)]
    bad = 0
    for form in forms:
        for case in CASES:
            if case[5] % (64 if form == "ws" else form):
                continue
            err = run(case, form)
            ok = err == err and err < 2e-2
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} form {form} case {case}: relative difference to Triton {err:.2e}",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
