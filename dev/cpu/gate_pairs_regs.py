"""Registers and spills of the KDA gated-pair kernels (gate_pairs.py), compiled for sm_90a on
this machine with Triton's compiler and bundled ptxas -v (no GPU), through the tests'
compile_for_sm90 and kernel signatures. On the H200 the counts matched within a few registers
(ncu and the compiled kernels' n_regs / n_spills): a quick check of a kernel edit's register
pressure before a GPU run.

    python dev/cpu/gate_pairs_regs.py [--K 128] [--configs 64x4,32x4,64x8] [--g] [--varlen] [--store-q]

A config is BKxWARPS. Prints one line per kernel and config.
"""
import argparse
import os
import sys

TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
sys.path[:0] = [os.path.join(TESTS, ".."), TESTS, os.path.join(TESTS, "ops")]

from gated_delta_rule.cases import compile_for_sm90  # noqa: E402
from gated_delta_rule.test_gate_pairs import FP32, KERNELS  # noqa: E402

# each whole-chunk kernel, then its blockwise kernel (the same arguments)
BLOCKWISE = {"gated_pairs": "gdn_gated_pair_blocks_kernel", "pair_grad": "gdn_gated_pair_grad_blocks_kernel"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--configs", default="64x4,32x4,64x8")
    ap.add_argument("--g", action="store_true", help="the scalar gate g beside gk")
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--store-q", action="store_true", help="the gated-pair forward also stores q e^C")
    ns = ap.parse_args()
    for pass_name, (whole, pointers, scalars) in KERNELS.items():
        pointers = dict(pointers)
        if ns.g:
            pointers.update(g=FP32, g_cum=FP32, **({"dg_parts": FP32} if pass_name == "pair_grad" else {}))
        if ns.varlen:
            pointers.update(chunk_map="*i32", cu_seqlens="*i32")
        for name in (whole, BLOCKWISE[pass_name]):
            for config in ns.configs.split(","):
                block_k, warps = (int(x) for x in config.split("x"))
                constants = {"H": 16, "HV": 16, "K": ns.K, "BK": block_k, "HAS_G": ns.g, "STORE_Q_GATED": ns.store_q,
                             "IS_VARLEN": ns.varlen}
                constants.update({n: None for n in ("g", "g_cum", "dg_parts", "chunk_map", "cu_seqlens")
                                  if n not in pointers and (n != "dg_parts" or pass_name == "pair_grad")})
                compiled = compile_for_sm90(f"flash_dma.ops.gated_delta_rule.triton.gate_pairs.{name}", pointers,
                                            scalars, constants, {"num_warps": warps, "num_stages": 1}, gluon=False)
                print(f"{name:36s} BK{block_k} W{warps}: {compiled['registers']} registers, "
                      f"{compiled['spill_bytes']} spill bytes", flush=True)


if __name__ == "__main__":
    main()
