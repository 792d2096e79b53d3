"""Key-major backward tile shapes on dense and sparse cases: do_bench, the dkdv kernel's GPU time,
and agreement with the default configuration (session 7: why block lists got their own default).

    python bench/backward_tile_shapes.py
"""
import os, sys, time
from collections import defaultdict
sys.path.insert(0, os.getcwd())
import torch
from flash_dma import flash_dma_func
from flash_dma.runtime import config
from flash_dma.benchmarks.common import time_ms

def kernel_ms(fn, name="attn_bwd_dkdv_kernel", reps=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    return sum(ev.device_time for ev in prof.events()
               if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith(name)) / 1000 / reps

C = config.LaunchConfig
dt = torch.bfloat16
def case(label, B, H, S, D, causal=False, bias=None, mask=None, cfgs=()):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    b = None
    if bias == "full":
        b = torch.randn(B, H, S, S, device="cuda", dtype=dt, requires_grad=True)
    elif bias == "key":
        b = torch.randn(B, H, 1, S, device="cuda", dtype=dt, requires_grad=True)
    m = None
    if mask == "1/8":
        n = S // 128
        keep = torch.rand(B, H, n, n, device="cuda").argsort(-1) < n // 8
        m = keep.repeat_interleave(128, 2).repeat_interleave(128, 3)
    leaves = [q, k, v] + ([b] if b is not None else [])
    dout = torch.randn(B, S, H, D, device="cuda", dtype=dt)
    out = flash_dma_func(q, k, v, attn_mask=m, attn_bias=b, is_causal=causal)
    g = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    ref = None
    for cfg in (None,) + tuple(cfgs):
        forced = config.overrides(attn_bwd_dkdv=cfg) if cfg is not None else config.overrides()
        try:
            forced.__enter__()
            t0 = time.time(); grads = g(); torch.cuda.synchronize(); comp = time.time() - t0
            if ref is None:
                ref = grads
            err = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(grads, ref))
            nan = any(torch.isnan(x).any().item() for x in grads)
            ms = time_ms(g); km = kernel_ms(g)
            name = "default" if cfg is None else f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
            print(f"{label:34s} {name:16s} bwd {ms:7.3f}  dkdv {km:7.3f}  vs default {err:.1e}{' NaN' if nan else ''}  (first call {comp:.1f}s)", flush=True)
        except Exception as e:
            print(label, cfg, "failed", type(e).__name__, str(e)[:150], flush=True)
        finally:
            forced.__exit__(None, None, None)


def main():
    big = (C(64, 128, 8, 2), C(64, 128, 8, 3))
    case("B4 H16 S4096 D128", 4, 16, 4096, 128, cfgs=big)
    case("B4 H16 S4096 D128 causal", 4, 16, 4096, 128, causal=True, cfgs=big)
    case("B2 H16 S4096 D128 bias full", 2, 16, 4096, 128, bias="full", cfgs=big)
    case("B2 H16 S4096 D128 bias full causal", 2, 16, 4096, 128, causal=True, bias="full", cfgs=big)
    case("B2 H16 S4096 D128 bias key", 2, 16, 4096, 128, bias="key", cfgs=big)
    case("B2 H16 S4096 D128 1/8+bias", 2, 16, 4096, 128, bias="full", mask="1/8", cfgs=big)
    case("B4 H16 S4096 D64", 4, 16, 4096, 64, cfgs=(C(64, 128, 4, 2), C(64, 128, 8, 2), C(64, 128, 4, 3)))
    case("B4 H16 S4096 D64 causal", 4, 16, 4096, 64, causal=True, cfgs=(C(64, 128, 4, 2), C(64, 128, 8, 2)))
    case("B2 H16 S4096 D64 bias full", 2, 16, 4096, 64, bias="full", cfgs=(C(64, 128, 4, 2), C(64, 128, 8, 2)))
    case("B4 H8 S4096 D256", 4, 8, 4096, 256, cfgs=(C(64, 64, 8, 2), C(64, 128, 8, 1)))


if __name__ == "__main__":
    main()
