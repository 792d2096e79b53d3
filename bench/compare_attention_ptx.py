"""Compile every attention kernel variant for Hopper (sm_90) from two packages and compare the PTX.

    bash bench/make_old_package.sh COMMIT /tmp/attn-old
    python bench/compare_attention_ptx.py /tmp/attn-old [--only fwd,dq,dkdv,delta,cast]

No GPU is needed: Triton compiles for a named target with its bundled ptxas. The old package is
imported as flash_dma_old (bench/make_old_package.sh), the new one as flash_dma from this tree;
each kernel is found in whichever layout the package has (the one-file kernels.py, or the
triton/ folder). The PTX is compared without its names and debug lines: identical PTX means the
restructuring changed no kernel's behaviour. The variants follow what the launchers pass: the
launch table's tiles for sm_90, descriptors where the host would make them, every walk mode,
mask and bias broadcast, causal, varlen, and the backward's dq and dbias strategies.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# pointer parameters by name, bf16 inputs (what the GPU benchmarks run)
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16",
            "DK": "*bf16", "DV": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "MASK": "*u8",
            "BIAS": "*bf16", "DBIAS": "*bf16", "CU_Q": "*i32", "CU_K": "*i32",
            "LIST_COUNT": "*i32", "LIST_INDEX": "*i32", "DQ_ACC": "*fp32", "SRC": "*fp32",
            "DST": "*bf16"}
FLOATS = ("softmax_scale", "scale")
# strides Triton would not find 16-divisible at a real launch (key strides of mask and bias: 1)
UNIT_STRIDES = ("stride_mk", "stride_bk", "stride_dbk")

KERNEL_HOMES = {  # kernel -> modules that may hold it, new layout first
    "attn_fwd_kernel": ("triton.forward", "kernels"),
    "attn_bwd_delta_kernel": ("triton.backward_preprocess", "kernels"),
    "scale_cast_kernel": ("triton.backward_preprocess", "triton.backward_dq", "kernels"),
    "attn_bwd_dq_kernel": ("triton.backward_dq", "kernels"),
    "attn_bwd_dkdv_kernel": ("triton.backward_dkdv", "kernels"),
}


def find_kernel(package: str, name: str):
    for home in KERNEL_HOMES[name]:
        try:
            module = importlib.import_module(f"{package}.ops.dynamic_mask_attention.{home}")
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"{name} not found in {package}")


def descriptor_type(block: list[int], dtype: str) -> str:
    return f"tensordesc<{dtype}[{','.join(map(str, block))}]>"


def compile_ptx(kernel, constexprs: dict, descriptors: dict, options: dict) -> str:
    """descriptors: name -> signature type of the descriptors present (absent ones are None)."""
    signature, attrs, consts = {}, {}, {}
    for index, p in enumerate(kernel.params):
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
            # old kernels may have a switch the new ones lost (its value is the one production ran)
            consts[name] = constexprs.get(name, OLD_ONLY.get(name))
            continue
        if name.endswith("_DESC"):
            if name in descriptors:
                signature[name] = descriptors[name]
            else:
                signature[name] = "constexpr"
                consts[name] = None
            continue
        if name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith(("stride_", "slot_stride_")) and name not in UNIT_STRIDES:
                attrs[(index,)] = [["tt.divisibility", 16]]
    unknown = set(constexprs) - {p.name for p in kernel.params}
    if unknown:
        raise KeyError(f"{kernel.fn.__name__}: no parameter {sorted(unknown)}")
    compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=TARGET,
                              options=options)
    return compiled.asm["ptx"]


# switches of the old kernels that the new ones no longer have, at the value production used
OLD_ONLY = {"KEY_ROWS": True}


def normalise(ptx: str) -> str:
    """PTX without what names and source positions change: debug lines and sections, the entry's
    and parameters' names, comments."""
    out = []
    in_debug = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section"):
            in_debug = True
        if in_debug:
            if s == "}":
                in_debug = False
            continue
        if s.startswith((".file", ".loc", "//", "$L__func", "$L__tmp")) or not s:
            continue
        if re.match(r"^\$L__\w+:$", s) and ("func_begin" in s or "tmp" in s or "func_end" in s):
            continue
        line = re.sub(r"\b\w+_param_(\d+)", r"P\1", line)
        line = re.sub(r"\.entry \w+", ".entry K", line)
        line = re.sub(r"\$L__(func_begin|func_end|tmp)\d+", "", line)
        out.append(line.rstrip())
    return "\n".join(out)


def _pair(prefix: str, shape: str) -> dict:
    """Constexprs of a mask or bias of broadcast kind: "full", "q-bcast" ([.., 1, Sk]), "k-bcast",
    or "none"."""
    return {f"HAS_{prefix}": shape != "none", f"{prefix}_Q_BCAST": shape == "q-bcast",
            f"{prefix}_K_BCAST": shape == "k-bcast"}


def variants():
    """(label, kernel name, constexprs, descriptors, options)."""
    for d, bd in ((64, 64), (128, 128), (72, 128), (256, 256)):
        wide = bd > 128  # no descriptors above padded head dim 128
        # forward (table tiles for sm_90)
        for mask, bias, mode, causal, varlen in (
                ("none", "none", 0, False, False), ("none", "none", 0, True, False),
                ("none", "full", 0, True, False), ("none", "q-bcast", 0, False, False),
                ("full", "full", 1, True, False), ("full", "none", 1, False, True),
                ("q-bcast", "full", 2, True, False), ("q-bcast", "none", 2, False, True),
                ("k-bcast", "k-bcast", 1, False, False)):
            bm, bn, w, st = (128, 64, 8 if bd >= 128 else 4, 2 if wide else 3)
            if mask == "none" and bias == "none" and bd == 128:
                bn = 128
            c = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=causal,
                     IS_VARLEN=varlen, KV_MODE=mode, **_pair("MASK", mask), **_pair("BIAS", bias),
                     KV_DESC=not wide, BIAS_DESC=bias == "full" and not wide,
                     WARP_SPECIALIZE=False, EXP2_POLY=False)
            descs = {}
            if c["KV_DESC"]:
                descs.update(K_DESC=descriptor_type([bn, 1, bd], "bf16"),
                             V_DESC=descriptor_type([bn, 1, bd], "bf16"))
            if c["BIAS_DESC"]:
                descs["B_DESC"] = descriptor_type([1, 1, bm, bn], "bf16")
            yield (f"fwd D{d} mask={mask} bias={bias} mode={mode} causal={causal} varlen={varlen}",
                   "attn_fwd_kernel", c, descs, dict(num_warps=w, num_stages=st))
        # forward with the polynomial exp2 once
        if d == 128:
            c = dict(c, EXP2_POLY=True)
            yield "fwd D128 poly", "attn_fwd_kernel", c, descs, dict(num_warps=8, num_stages=3)
        # dq kernel (query-major)
        for mask, bias, mode, causal, varlen in (
                ("none", "none", 0, True, False), ("none", "q-bcast", 0, False, False),
                ("full", "full", 1, True, False), ("full", "k-bcast", 1, False, True),
                ("q-bcast", "full", 2, True, False), ("q-bcast", "none", 2, False, True)):
            bm, bn, w, st = (64, 32, 4, 3) if wide else (128, 64, 8, 2)
            c = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=causal,
                     IS_VARLEN=varlen, KV_MODE=mode, **_pair("MASK", mask), **_pair("BIAS", bias),
                     KV_DESC=not wide, BIAS_DESC=bias == "full" and not wide)
            descs = {}
            if c["KV_DESC"]:
                descs.update(K_DESC=descriptor_type([bn, 1, bd], "bf16"),
                             V_DESC=descriptor_type([bn, 1, bd], "bf16"))
            if c["BIAS_DESC"]:
                descs["B_DESC"] = descriptor_type([1, 1, bm, bn], "bf16")
            yield (f"dq D{d} mask={mask} bias={bias} mode={mode} causal={causal} varlen={varlen}",
                   "attn_bwd_dq_kernel", c, descs, dict(num_warps=w, num_stages=st))
        # key-major dk/dv (/dbias, /dq): (mask, bias, mode, causal, varlen, dbias, dq mode,
        # dbias atomic, dbias by descriptor)
        for mask, bias, mode, causal, varlen, dbias, dq_mode, atomic, db_desc in (
                ("none", "none", 1, False, False, False, 2, False, False),
                ("none", "none", 1, True, False, False, 2, False, False),
                ("none", "none", 0, True, True, False, 1, False, False),
                ("none", "none", 0, False, False, False, 0, False, False),
                ("none", "full", 1, True, False, True, 0, False, True),
                ("none", "full", 0, False, False, True, 0, False, False),
                ("none", "q-bcast", 0, True, False, True, 2, True, False),
                ("none", "k-bcast", 0, False, False, True, 2, True, False),
                ("full", "full", 1, True, False, True, 2, False, True),
                ("full", "full", 1, False, True, True, 1, True, False),
                ("q-bcast", "full", 2, True, False, True, 2, False, False),
                ("q-bcast", "none", 2, False, True, False, 1, False, False),
                ("full", "q-bcast", 1, True, False, False, 0, False, False)):
            if wide:
                bm, bn, w, st = 32, 64, 8, 2
                dq_mode, db_desc = 0, False
            elif bd == 128:
                bm, bn, w, st = (64, 128, 8, 2) if (db_desc or mode == 1) else (32, 128, 8, 2)
            else:
                bm, bn, w, st = 64, 64, 4, 2
            c = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=causal,
                     IS_VARLEN=varlen, KV_MODE=mode, **_pair("MASK", mask), **_pair("BIAS", bias),
                     HAS_DBIAS=dbias, DBIAS_ATOMIC=atomic, BIAS_DESC=False, DQ_MODE=dq_mode,
                     DBIAS_DESC=db_desc)
            descs = {}
            if dq_mode == 2:
                descs["DQ_DESC"] = descriptor_type([bm, 1, bd], "fp32")
            if db_desc:
                descs["DB_DESC"] = descriptor_type([1, 1, bm, bn], "bf16")
            yield (f"dkdv D{d} mask={mask} bias={bias} mode={mode} causal={causal} varlen={varlen} "
                   f"dbias={dbias} dq={dq_mode} atomic={atomic} dbdesc={db_desc}",
                   "attn_bwd_dkdv_kernel", c, descs, dict(num_warps=w, num_stages=st))
        for varlen, zero in ((False, True), (True, False)):
            c = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=128, IS_VARLEN=varlen, ZERO_DQ_ACC=zero)
            yield f"delta D{d} varlen={varlen} zero={zero}", "attn_bwd_delta_kernel", c, {}, dict(num_warps=4)
    yield "scale_cast", "scale_cast_kernel", dict(BLOCK=4096), {}, dict(num_warps=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", help="folder holding flash_dma_old (bench/make_old_package.sh)")
    parser.add_argument("--only", help="comma-separated label prefixes (fwd, dq, dkdv, delta, scale)")
    parser.add_argument("--dump", help="write both normalised PTX of each differing variant here")
    args = parser.parse_args()
    sys.path.insert(0, args.old_dir)
    only = tuple(args.only.split(",")) if args.only else None
    return 1 if compare_packages(variants(), compile_ptx, find_kernel, only, args.dump) else 0


def compare_packages(cases, compile_fn, find_fn, only, dump) -> int:
    """Compile every (label, kernel name, constexprs, extra, options) case from flash_dma_old and
    flash_dma, print same/DIFFERS per case and a total, write both normalised PTX of a differing
    case into `dump` when given; returns how many differ. compile_fn(kernel, constexprs, extra,
    options) and find_fn(package, name) are the op's own (compare_gdn_ptx.py uses this too)."""
    same = differ = 0
    for label, name, constexprs, extra, options in cases:
        if only and not label.startswith(only):
            continue
        old = normalise(compile_fn(find_fn("flash_dma_old", name), constexprs, extra, options))
        new = normalise(compile_fn(find_fn("flash_dma", name), constexprs, extra, options))
        if old == new:
            same += 1
            print(f"same    {label}", flush=True)
        else:
            differ += 1
            print(f"DIFFERS {label}", flush=True)
            if dump:
                os.makedirs(dump, exist_ok=True)
                stem = re.sub(r"[^\w=.-]+", "_", label)
                for tag, text in (("old", old), ("new", new)):
                    with open(os.path.join(dump, f"{stem}.{tag}.ptx"), "w") as f:
                        f.write(text)
    print(f"{same} variants compile to the same PTX, {differ} differ")
    return differ

if __name__ == "__main__":
    sys.exit(main())
