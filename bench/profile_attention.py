"""Where the time goes: per-kernel CUDA times of one forward and one backward, by torch.profiler,
and a forward sweep over a few launch configurations (warp specialisation included).

    python bench/profile_attention.py
"""
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma import flash_dma_func  # noqa: E402
from flash_dma.runtime import config  # noqa: E402
from flash_dma.benchmarks.common import time_ms  # noqa: E402


def kernel_times(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:60]] += ev.device_time / 1000 / reps
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main():
    for label, bias_shape, B, H in (("bias[B,H,S,S]", "full", 2, 16), ("plain", None, 2, 16)):
        S, D = 4096, 128
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        bias = (torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                if bias_shape else None)
        leaves = [q, k, v] + ([bias] if bias is not None else [])
        out = flash_dma_func(q, k, v, attn_bias=bias)
        dout = torch.randn_like(out)
        print(f"== {label} B{B} H{H} S{S} D{D}")
        for name, fn in (("fwd", lambda: flash_dma_func(q, k, v, attn_bias=bias)),
                         ("bwd", lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))):
            print(f"  {name}: total {time_ms(fn):.3f} ms")
            for kname, ms in kernel_times(fn)[:6]:
                print(f"    {ms:8.3f} ms  {kname}")
        C = config.LaunchConfig
        for cfg in (C(128, 64, 8, 3), C(128, 64, 8, 3, True), C(128, 64, 8, 4, True), C(128, 32, 8, 4, True)):
            try:
                with config.overrides(attn_fwd=cfg):
                    ms = time_ms(lambda: flash_dma_func(q, k, v, attn_bias=bias))
                flops = 4 * B * H * S * S * D
                print(f"  fwd {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s")
            except Exception as exc:  # noqa: BLE001
                print(f"  fwd {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")


if __name__ == "__main__":
    main()
