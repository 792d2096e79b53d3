"""A small grid of the CuTe backend's kernels, forward and backward once each, for
compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python bench/cute_sanitize_grid.py [--cute-bias]
    compute-sanitizer --tool racecheck python bench/cute_sanitize_grid.py [--cute-bias] [--only TEXT]
        [--choices name=value,...]

Plain attention (head dims 64/128/256, causal and not, GQA, ragged lengths, varlen with empty
and one-token sequences), a tile-sparse mask, fully masked rows, and with --cute-bias a dense
and a head-broadcast bias (dbias stored and atomic), and the bias by TMA (cute/forward_bias_tma.py;
cute/backward_bias_tma.py: the backward's bias read and dbias store). Shapes are tiny: the tools
slow kernels by orders of magnitude. Each case also checks the forward against the fp64 reference (a
sanitizer run that computes garbage is not a clean run). Prints one line per case.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma import flash_dma_func, flash_dma_varlen_func  # noqa: E402
from flash_dma.ops.dynamic_mask_attention import attention_reference  # noqa: E402
from flash_dma.runtime.config import overrides, parse_overrides  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fixed_case(D, causal, H, Hk, Sq, Sk, mask=None, bias=None):
    q = torch.randn(1, Sq, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, Sk, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, Sk, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if bias is not None:
        bias.requires_grad_(True)
    out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal)
    out.backward(torch.randn_like(out))
    ref = attention_reference(q.detach().double(), k.detach().double(), v.detach().double(),
                              mask, None if bias is None else bias.detach().double(), causal)
    ref = ref[0] if isinstance(ref, tuple) else ref
    grads = [q.grad, k.grad, v.grad] + ([bias.grad] if bias is not None else [])
    finite = all(torch.isfinite(g).all() for g in grads)
    return rel_err(out, ref), finite


def varlen_case(D, causal):
    lens = [0, 1, 37, 130]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lens), 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens), 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens), 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_dma_varlen_func(q, k, v, cu, cu, max(lens), max(lens), is_causal=causal)
    out.backward(torch.randn_like(out))
    finite = all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))
    return float("nan"), finite


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cute-bias", action="store_true")
    parser.add_argument("--only", help="run only the cases whose name contains this text")
    parser.add_argument("--choices", type=parse_overrides, default={},
                        help="declared choices to override, name=value,... (True/False for flags)")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = []
    for D in (64, 128, 256):
        for causal in (False, True):
            cases.append((f"plain D{D} causal={causal} H4 Hk2 Sq197 Sk133",
                          lambda D=D, c=causal: fixed_case(D, c, 4, 2, 197, 133)))
    cases.append(("varlen D128 causal lens 0,1,37,130", lambda: varlen_case(128, True)))
    S = 300
    tiles = torch.rand(1, 4, 3, 3, device="cuda") < 0.3
    tiles |= torch.eye(3, dtype=torch.bool, device="cuda")
    tile_mask = tiles.repeat_interleave(128, 2).repeat_interleave(128, 3)[:, :, :S, :S]
    cases.append(("tile-sparse mask D128 H4 Hk2 S300", lambda: fixed_case(128, False, 4, 2, S, S, mask=tile_mask)))
    rows = torch.rand(1, 2, 200, 190, device="cuda") < 0.5
    rows[:, :, 3] = False
    cases.append(("mask with empty rows D64 H2 S200/190", lambda: fixed_case(64, True, 2, 2, 200, 190, mask=rows)))
    if args.cute_bias:
        cases.append(("bias [B,H,Sq,Sk] D128 H4 Hk2 S197/133",
                      lambda: fixed_case(128, False, 4, 2, 197, 133,
                                         bias=torch.randn(1, 4, 197, 133, device="cuda", dtype=torch.bfloat16))))
        cases.append(("bias [B,H,Sq,Sk] D128 causal Sq300 Sk100 (paired loads; key tile -1)",
                      lambda: fixed_case(128, True, 4, 2, 300, 100,
                                         bias=torch.randn(1, 4, 300, 100, device="cuda", dtype=torch.bfloat16))))
        cases.append(("bias [B,H,1,Sk] (dbias summed over queries) D64 causal Sq300 Sk100",
                      lambda: fixed_case(64, True, 4, 2, 300, 100,
                                         bias=torch.randn(1, 4, 1, 100, device="cuda", dtype=torch.bfloat16))))
        cases.append(("bias [1,Hk,Sq,Sk] (atomic dbias) D128 causal",
                      lambda: fixed_case(128, True, 4, 2, 197, 133,
                                         bias=torch.randn(1, 2, 197, 133, device="cuda", dtype=torch.bfloat16))))

        def tma(D, causal, Sq, Sk, heads):
            with overrides(attention_cute_bias_prefetch="tma"):
                return fixed_case(D, causal, 4, 2, Sq, Sk,
                                  bias=torch.randn(1, heads, Sq, Sk, device="cuda", dtype=torch.bfloat16))
        cases.append(("bias by TMA [B,H,Sq,Sk] D128 causal Sq300 Sk104 (key tile -1)",
                      lambda: tma(128, True, 300, 104, 4)))
        cases.append(("bias by TMA [B,Hk,Sq,Sk] D64 Sq197 Sk136", lambda: tma(64, False, 197, 136, 2)))
        # the backward's TMA bias read and dbias store at D128's 80-row tiles
        cases.append(("bias by TMA [B,H,Sq,Sk] D128 Sq197 Sk136", lambda: tma(128, False, 197, 136, 4)))
        # walks of several tiles each way: the rings wrap
        cases.append(("bias by TMA [B,H,Sq,Sk] D128 Sq600 Sk648 (several tiles each way)",
                      lambda: tma(128, False, 600, 648, 4)))
    if args.only:
        cases = [case for case in cases if args.only in case[0]]
    bad = 0
    with overrides(attention_backend="cute", attention_cute_bias=args.cute_bias, **args.choices):
        for name, run in cases:
            err, finite = run()
            ok = finite and not (err == err and err > 2e-2)
            bad += not ok
            shown = f"{err:.2e}" if err == err else "n/a (no reference for varlen here)"
            print(f"{'ok ' if ok else 'BAD'} {name}: out rel err {shown}, grads finite {finite}", flush=True)
    torch.cuda.synchronize()
    print(f"{len(cases) - bad} of {len(cases)} cases ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
