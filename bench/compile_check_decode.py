"""Compile the decode kernels for Hopper (sm_90) on a machine without a GPU.

    python bench/compile_check_decode.py

Triton's interpreter runs code the GPU compiler rejects (a loop-carried value whose type
changes, for one), so this compiles each kernel variant ahead of time with Triton's bundled
ptxas and prints its shared memory and whether the key loads were pipelined (cp.async). Integer
arguments named stride_* (but the mask's and bias's key strides) and every pointer are declared
16-divisible, as Triton's specialisation finds them at a real launch.
"""
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flash_dma.ops.decode.triton.append import append_kv_kernel  # noqa: E402
from flash_dma.ops.decode.triton.combine import decode_combine_kernel  # noqa: E402
from flash_dma.ops.decode.triton.compact import compact_kept_keys_kernel  # noqa: E402
from flash_dma.ops.decode.triton.decode_forward import decode_split_kernel  # noqa: E402

POINTERS = {"Q": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16", "OUT": "*bf16", "LSE": "*fp32",
            "O_PART": "*fp32", "LSE_PART": "*fp32", "CACHE_SEQLENS": "*i32",
            "CACHE_BATCH_IDX": "*i32", "BLOCK_TABLE": "*i32", "MASK": "*u8", "BIAS": "*bf16",
            "KEPT_COUNT": "*i32", "KEPT_INDEX": "*i32", "K_NEW": "*bf16", "V_NEW": "*bf16"}


def compile_for_hopper(kernel, constexprs: dict, options: dict):
    signature, attrs = {}, {}
    for index, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        signature[p.name] = POINTERS.get(p.name, "fp32" if p.name == "softmax_scale" else "i32")
        if p.name in POINTERS or (p.name.startswith("stride_") and p.name not in ("stride_mk", "stride_bk")):
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    print(f"{kernel.fn.__name__} {constexprs} {options}: shared {compiled.metadata.shared} B, "
          f"cp.async {ptx.count('cp.async')}")
    return compiled


def main() -> None:
    for (d, block_n, stages), (gather, paged, per_head), split in itertools.product(
            ((64, 64, 3), (128, 64, 3), (256, 32, 2)),
            ((False, False, False), (True, True, False), (True, False, True)), (False, True)):
        compile_for_hopper(decode_split_kernel, dict(
            HEAD_DIM=d, BLOCK_D=d, BLOCK_M=16, BLOCK_N=block_n, IS_CAUSAL=True, PAGED=paged,
            HAS_BATCH_IDX=not paged, HAS_MASK=gather, HAS_BIAS=gather, GATHER=gather, SPLIT=split,
            MASK_PER_HEAD=per_head), dict(num_warps=4, num_stages=stages))
    compile_for_hopper(decode_combine_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32,
                                                   HAS_BATCH_IDX=False), dict(num_warps=4))
    for paged in (False, True):
        compile_for_hopper(append_kv_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_H=8, PAGED=paged,
                                                  HAS_BATCH_IDX=not paged), dict(num_warps=4))
    compile_for_hopper(compact_kept_keys_kernel, dict(CHUNK=1024, HAS_BATCH_IDX=False),
                       dict(num_warps=4))


if __name__ == "__main__":
    main()
