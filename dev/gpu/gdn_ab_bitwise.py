"""Outputs and gradients of the gated delta rule from two versions of the package, compared bit by
bit on the same inputs: for a change meant to leave the numbers as they are (a buffer's dtype
that every reader rounds to anyway, a sum moved into a kernel). Prints one line per case with the
tensors that differ and their largest difference.

    python dev/gpu/gdn_ab_bitwise.py --old DIR [--dtype bf16] [--shape "2 512 4 128 128"]

DIR holds flash_dma_old/ (bench/make_old_package.sh). Cases: per-key gate alone and with the
scalar gate, grouped value heads, packed sequences with lengths 0 and 1, disable_recompute, and
strong per-key decays (the blockwise kernels).
"""
import argparse
import importlib
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def run(pkg, inputs, kwargs):
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    o, final = pkg.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), leaves["beta"],
                                          gk=leaves.get("gk"), initial_state=leaves.get("h0"),
                                          output_final_state=True, **kwargs)
    names = list(leaves)
    loss = o.float().sum() + 0.1 * (o.float() ** 2).sum() + final.sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in names])
    return dict(zip(["o", "final"] + ["d" + n for n in names], [o, final, *grads]))


def case_inputs(B, T, H, K, V, dtype, device, scalar_gate, grouped, varlen, strong):
    HV = 2 * H if grouped else H
    q = torch.randn(B, T, H, K, device=device).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=device).to(dtype)
    # strong: per-key decays down to about e^-16 a token (the blockwise pair kernels)
    shift, spread = (-2.0, 4.0) if strong else (3.0, 1.0)
    gk = F.logsigmoid(torch.randn(B, T, HV, K, device=device) * spread + shift) * (8.0 if strong else 1.0)
    g = F.logsigmoid(torch.randn(B, T, HV, device=device) + 3.0) if scalar_gate else None
    beta = torch.rand(B, T, HV, device=device).to(dtype)
    cu = None
    if varlen:  # lengths 1, 0 and two longer (T >= 6)
        cu = torch.tensor([0, 1, 1, T // 3, T], device=device, dtype=torch.int32)
    n_states = B if cu is None else cu.numel() - 1
    h0 = torch.randn(n_states, HV, K, V, device=device)
    return dict(q=q, k=k, v=v, g=g, gk=gk, beta=beta, h0=h0), cu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="folder holding flash_dma_old/")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--shape", default="2 512 4 128 128", help="B T H K V")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    sys.path.insert(0, args.old)
    new, old = importlib.import_module("flash_dma"), importlib.import_module("flash_dma_old")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    B, T, H, K, V = (int(x) for x in args.shape.split())
    differing = 0
    for scalar_gate, grouped, varlen, keep, strong in itertools.product([False, True], repeat=5):
        torch.manual_seed(0)
        inputs, cu = case_inputs(1 if varlen else B, T, H, K, V, dtype, args.device, scalar_gate, grouped, varlen,
                                 strong)
        kwargs = {"disable_recompute": keep, "cu_seqlens": cu}
        got, want = run(new, inputs, kwargs), run(old, inputs, kwargs)
        diffs = {n: (got[n].float() - want[n].float()).abs().max().item()
                 for n in got if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])}
        differing += bool(diffs)
        dtypes = {n: str(got[n].dtype).replace("torch.", "") for n in diffs if got[n].dtype != want[n].dtype}
        label = (f"g+gk={scalar_gate:d} gva={grouped:d} varlen={varlen:d} kept={keep:d} strong={strong:d}")
        print(f"{label}: " + (", ".join(f"{n} {d:.3g}" for n, d in diffs.items()) if diffs else "identical")
              + (f" (dtypes differ: {dtypes})" if dtypes else ""), flush=True)
    print(f"{differing} of 32 cases differ ({args.dtype}, B{B} T{T} H{H} K{K} V{V})")


if __name__ == "__main__":
    main()
