"""A tiny correctness check of each op against its fp64 reference, for machines without a GPU.

Run as `TRITON_INTERPRET=1 python -m flash_dma.benchmarks.selfcheck`: the real Triton kernels
execute in Triton's CPU interpreter (fp16: the interpreter's bf16 dot is wrong in Triton 3.6).
Exits non-zero if a check fails.
"""
import sys
import warnings

import torch

# numpy in the interpreter warns on log2(0) for rows that see no key; the kernel replaces that
# value (lse = +inf), so the warning is noise here
warnings.filterwarnings("ignore", message="divide by zero", category=RuntimeWarning)


def check_attention() -> float:
    from flash_dma import flash_dma_func
    from flash_dma.ops.dynamic_mask_attention import attention_reference
    torch.manual_seed(0)
    q = torch.randn(1, 19, 2, 32, dtype=torch.float16)
    k = torch.randn(1, 23, 1, 32, dtype=torch.float16)
    v = torch.randn(1, 23, 1, 32, dtype=torch.float16)
    mask = torch.rand(1, 1, 19, 23) < 0.7
    bias = torch.randn(1, 2, 19, 23, dtype=torch.float16)
    out = flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)
    ref, _ = attention_reference(q, k, v, mask, bias, True)
    return ((out.double() - ref).norm() / ref.norm()).item()


CHECKS = {"attention": (check_attention, 5e-3)}


def main() -> int:
    failed = 0
    for name, (check, bound) in CHECKS.items():
        err = check()
        ok = err <= bound
        failed += not ok
        print(f"{name}: relative error {err:.1e} against the fp64 reference ({'ok' if ok else 'FAILED'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
