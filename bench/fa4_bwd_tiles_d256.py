"""FA4's SM90 backward at head dim 256 under other tile configurations (FA4 4.0.0b36 picks 64x48
with a 2-stage Q pipeline: its 64 KB dQ staging buffer leaves no room for FA3's 64x80), beside
SDPA cuDNN, one process, bf16 B4 H8 S4096, causal and not:

    python bench/fa4_bwd_tiles_d256.py

Each configuration's dq, dk, dv are checked against the default's (relative-error norm). Prints
one row per configuration: backward ms, TFLOP/s, ratio to cuDNN. An experiment: nothing in the
package reads it.
"""
from __future__ import annotations

import dataclasses
import sys

import torch
from triton.testing import do_bench

from flash_attn.cute import interface

B, H, S, D = 4, 8, 4096, 256
DEFAULT = interface._tile_size_bwd_sm90
BASE = DEFAULT(256, 256, False, False)
CONFIGS = {
    "default 64x48 Q2": None,
    "64x64 Q1 dKVswap": dict(n_block_size=64, num_stages_Q=1),
    "64x64 Q1 noswap": dict(n_block_size=64, num_stages_Q=1, dKV_swapAB=False),
    "64x80 Q1 dKVswap": dict(n_block_size=80, num_stages_Q=1),
    "64x32 Q2 dKVswap": dict(n_block_size=32),
    "64x96 Q1 dKVswap": dict(n_block_size=96, num_stages_Q=1),
}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> int:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | B{B} H{H} S{S} D{D} bf16", flush=True)
    for causal in (False, True):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        out, lse = interface._flash_attn_fwd(q, k, v, causal=causal, return_lse=True)[:2]
        flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            go = dout.transpose(1, 2)
            cudnn_ms = do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), go, retain_graph=True))
        print(f"causal={causal} cudnn bwd {cudnn_ms:.3f} ms {flops / cudnn_ms / 1e9:.0f} TF/s", flush=True)
        ref = None
        for name, change in CONFIGS.items():
            cfg = BASE if change is None else dataclasses.replace(BASE, **change)
            interface._tile_size_bwd_sm90 = lambda *a, _c=cfg, **kw: _c if a[0] > 192 else DEFAULT(*a, **kw)
            try:
                run = lambda: interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)[:3]  # noqa: E731
                grads = run()
                ms = do_bench(run)
                if ref is None:
                    ref = grads
                err = max(rel(g, r) for g, r in zip(grads, ref))
                print(f"causal={causal} {name:<20} {ms:8.3f} ms {flops / ms / 1e9:5.0f} TF/s "
                      f"cudnn/this {cudnn_ms / ms:5.2f}x  err vs default {err:.1e}", flush=True)
            except Exception as exc:  # a configuration that does not build is a row
                print(f"causal={causal} {name:<20} FAILED {type(exc).__name__}: {str(exc)[:150]}", flush=True)
            finally:
                interface._tile_size_bwd_sm90 = DEFAULT
    return 0


if __name__ == "__main__":
    sys.exit(main())
