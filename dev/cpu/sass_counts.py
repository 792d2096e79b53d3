"""Registers, spills and per-chunk SASS of the fused forward's warp-role kernel, compiled for
sm_90a on this machine (no GPU: Triton's compiler and bundled ptxas -v). A quick check of a
kernel edit before a GPU run.

    python dev/cpu/sass_counts.py [--K 128] [--varlen]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.tools.disasm import get_sass  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--varlen", action="store_true")
    args = parser.parse_args()
    from flash_dma.ops.gated_delta_rule.gluon.forward_ws import gdn_fwd_ws_kernel
    pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "ai": "*bf16", "g_cum": "*fp32",
                "h0": "*fp32", "o": "*bf16", "ht": "*fp32", "cu_seqlens": "*i32", "order": "*i32"}
    constants = {"HQ": 16, "HV": 16, "K": args.K, "V": 128, "STAGES": 2, "HAS_G": True, "HAS_H0": False,
                 "STORE_HT": False, "IS_VARLEN": args.varlen}
    signature = {**pointers, "T": "i32", "scale": "fp32", **{c: "constexpr" for c in constants}}
    order = list(signature)
    aligned = {(order.index(n),): [["tt.divisibility", 16]] for n in pointers}
    compiled = triton.compile(GluonASTSource(gdn_fwd_ws_kernel, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 160})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", "-maxrregcount", "160", ptx, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    print(" ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if "spill" in line or "Used" in line))
    sass = get_sass(compiled.asm["cubin"])
    # the partitions' code, by their register claims (setmaxnreg), in order
    parts = re.split(r"USETMAXREG\.(?:TRY_ALLOC|DEALLOC)\.CTAPOOL[^\n]*", sass)
    counts = [sum(1 for line in p.splitlines() if re.search(r"[A-Z]{2,}", line) and ";" in line) for p in parts]
    print(json.dumps({"shared": compiled.metadata.shared, "sass_lines_between_setmaxnreg": counts,
                      "fences": sass.count("FENCE.VIEW.ASYNC"), "membar": sass.count("MEMBAR"),
                      "mufu": sass.count("MUFU.EX2"), "hgmma": sass.count("HGMMA.")}))


if __name__ == "__main__":
    main()
