"""Sweep the decode kernel's launch settings on this GPU and print every time.

    python bench/tune_decode.py [--quick] [--only TEXT]

For each configuration of the decode benchmark's plan (full cache 8192 and 32768, B1 splits,
key-wise top-1024, paged), times flash_dma_with_kvcache under every (block_n, num_warps,
num_stages) and a few split counts, and prints the best beside the default. Nothing is stored:
put the winners into flash_dma/ops/decode/plan.py by hand (its rule and KEYS_PER_SPLIT). --only keeps the configurations
whose label contains TEXT (each setting compiles once per configuration: the whole sweep may
not fit one 10-minute device call).
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks.common import time_ms  # noqa: E402
from flash_dma.benchmarks.decode import make_inputs, ours, sections  # noqa: E402
from flash_dma.ops.decode import plan  # noqa: E402
from flash_dma.runtime.config import LaunchConfig, overrides  # noqa: E402


def main(quick: bool, only: str | None) -> None:
    cases = [c for _, group in sections(quick) for c in group if only is None or only in c.label]
    grid = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
    for case in cases:
        x = make_inputs(case)
        run = ours(case, x)
        default = time_ms(run)
        bytes_read = case.cache_bytes() if case.topk is None else None
        print(f"\n{case.label}: default {default:.4f} ms"
              + (f" ({bytes_read / default / 1e6:.0f} GB/s)" if bytes_read else ""), flush=True)
        results = []
        for block_n, warps, stages in grid:
            if block_n * case.D * 2 * 2 * stages > 200 * 1024:
                continue  # K and V tiles past the shared memory
            default_plan = plan.plan_decode(x.q.device, batch=case.B, kv_heads=case.Hk,
                                            packed_rows=case.H // case.Hk * case.Sq, max_keys=case.S,
                                            head_dim=case.D, num_splits=None)
            setting = LaunchConfig(default_plan.block_m, block_n, warps, stages)
            try:
                with overrides(**{plan.KERNEL: setting}):
                    ms = time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile or fit
                print(f"  n{block_n} w{warps} s{stages}: failed ({type(exc).__name__})")
                continue
            results.append((ms, block_n, warps, stages))
            print(f"  n{block_n} w{warps} s{stages}: {ms:.4f} ms", flush=True)
        if results:
            best = min(results)
            print(f"  best n{best[1]} w{best[2]} s{best[3]}: {best[0]:.4f} ms "
                  f"({default / best[0]:.2f}x the default)")
        for splits in (1, 2, 4, 8, 16, 32, 64, 128):
            fn = ours_with_splits(case, x, splits)
            print(f"  splits {splits}: {time_ms(fn):.4f} ms", flush=True)
        del x
        torch.cuda.empty_cache()


def ours_with_splits(case, x, splits):
    from flash_dma.ops.decode import flash_dma_with_kvcache
    from flash_dma.benchmarks.decode import _paged
    k_cache, v_cache, table = x.k_cache, x.v_cache, None
    if case.page_size:
        k_cache, v_cache, table = _paged(case, x)
    return lambda: flash_dma_with_kvcache(x.q, k_cache, v_cache, x.k_new, x.v_new,
                                          cache_seqlens=x.lengths, block_table=table,
                                          attn_mask=x.mask, attn_bias=x.bias, num_splits=splits)


if __name__ == "__main__":
    args = sys.argv[1:]
    main("--quick" in args, args[args.index("--only") + 1] if "--only" in args else None)
