"""Registers and spills of the KDA gated-pair kernels (gate_pairs.py), compiled for sm_90a on
this machine with Triton's compiler and bundled ptxas -v (no GPU). On the H200 the counts
matched within a few registers (ncu and the compiled kernels' n_regs / n_spills): a quick check
of a kernel edit's register pressure before a GPU run.

    python dev/cpu/gate_pairs_regs.py [--K 128] [--configs 64x4,32x4,64x8] [--g] [--varlen]

A config is BKxWARPS. Prints one line per kernel and config.
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flash_dma.ops.gated_delta_rule.triton import gate_pairs  # noqa: E402

BF16, FP32 = "*bf16", "*fp32"
FORWARD = {"q": BF16, "k": BF16, "gk_cum": FP32, "a_raw": FP32, "aqk": FP32, "needs_blocks": "*i8"}
BACKWARD = {"q": BF16, "k": BF16, "beta": BF16, "gk_cum": FP32, "dp": FP32, "da": FP32, "dq": FP32, "dk": FP32,
            "dbeta_parts": FP32, "db": FP32, "dq_out": BF16, "dk_out": BF16, "needs_blocks": "*i8"}
KERNELS = {
    "gated_pairs": (gate_pairs.gdn_gated_pairs_kernel, FORWARD, {"T": "i32", "scale": "fp32"}),
    "gated_pair_blocks": (gate_pairs.gdn_gated_pair_blocks_kernel, FORWARD, {"T": "i32", "scale": "fp32"}),
    "pair_grad": (gate_pairs.gdn_gated_pair_grad_kernel, BACKWARD,
                  {"T": "i32", "part_stride": "i32", "scale": "fp32"}),
    "pair_grad_blocks": (gate_pairs.gdn_gated_pair_grad_blocks_kernel, BACKWARD,
                         {"T": "i32", "part_stride": "i32", "scale": "fp32"}),
}


def ptxas_counts(kernel, pointers: dict, scalars: dict, constants: dict, num_warps: int) -> str:
    """ptxas -v's register and spill lines for one compilation."""
    names = kernel.arg_names
    types = {**pointers, **scalars, **{c: "constexpr" for c in constants}}
    signature = {n: types[n] for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    compiled = triton.compile(ASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 1})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    lines = (out.stdout + out.stderr).splitlines()
    return "; ".join(line.split("info    : ")[-1].strip() for line in lines if "spill" in line or "Used" in line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--configs", default="64x4,32x4,64x8")
    ap.add_argument("--g", action="store_true", help="the scalar gate g beside gk")
    ap.add_argument("--varlen", action="store_true")
    ns = ap.parse_args()
    for name, (kernel, pointers, scalars) in KERNELS.items():
        pointers = dict(pointers)
        if ns.g:
            pointers["g_cum"] = FP32
        if ns.varlen:
            pointers.update(chunk_map="*i32", cu_seqlens="*i32")
        for config in ns.configs.split(","):
            block_k, warps = (int(x) for x in config.split("x"))
            constants = {"H": 16, "HV": 16, "K": ns.K, "BK": block_k, "HAS_G": ns.g, "IS_VARLEN": ns.varlen}
            constants.update({n: None for n in ("g_cum", "chunk_map", "cu_seqlens") if n not in pointers})
            print(f"{name:18s} BK{block_k} W{warps}: {ptxas_counts(kernel, pointers, scalars, constants, warps)}",
                  flush=True)


if __name__ == "__main__":
    main()
