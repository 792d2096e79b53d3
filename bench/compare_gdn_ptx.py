"""Compile the gated delta rule's state passes for Hopper (sm_90) from two packages and compare the PTX.

    bash bench/make_old_package.sh main /tmp/gdn-old
    python bench/compare_gdn_ptx.py /tmp/gdn-old [--dump DIR]

No GPU is needed: Triton compiles for a named target with its bundled ptxas. The old package is
imported as flash_dma_old (bench/make_old_package.sh), the new one as flash_dma from this tree.
The variants follow what the launchers pass by default (the launch table's tiles for sm_90,
every gate, states in and out, varlen, w and u read or formed from T); the new kernels' segment
switches (STORE_STATES, CONSTANT_TERMS, H0_IDENTITY / DHT_IDENTITY) are left at their defaults,
so identical PTX means the unsplit path is unchanged. The segment variants are then compiled
from the new package alone (they must compile for sm_90; nothing to compare them with).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compare_attention_ptx import compare_packages  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = {"gdn_fwd_h_kernel": "state_pass", "gdn_bwd_dhu_kernel": "bwd_dhu"}
# pointer parameters by name, bf16 inputs (what the GPU benchmarks run); fp32 gates and states
POINTERS = {"k": "*bf16", "w": "*bf16", "u": "*bf16", "v": "*bf16", "beta": "*bf16", "ai": "*bf16",
            "g_cum": "*fp32", "gk_cum": "*fp32", "h0": "*fp32", "h": "*bf16", "v_new": "*bf16",
            "ht": "*fp32", "q": "*bf16", "do": "*bf16", "dv": "*bf16", "dht": "*fp32", "dh": "*bf16",
            "dh0": "*fp32", "dv2": "*bf16", "cu_seqlens": "*i32", "chunk_offsets": "*i32"}


def find_kernel(package: str, name: str):
    module = importlib.import_module(f"{package}.ops.gated_delta_rule.triton.{KERNELS[name]}")
    return getattr(module, name)


def compile_ptx(kernel, constexprs: dict, absent: set, options: dict) -> str:
    """absent: pointer parameters the launcher passes as None (constexpr None)."""
    signature, attrs, consts = {}, {}, {}
    for index, p in enumerate(kernel.params):
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
            if name in constexprs:
                consts[name] = constexprs[name]
            elif p.has_default:
                consts[name] = p.default
            else:
                raise KeyError(f"{kernel.fn.__name__}: no value for {name}")
        elif name in absent:
            signature[name] = "constexpr"
            consts[name] = None
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = "fp32"
        else:  # T: not specialised (do_not_specialize)
            signature[name] = "i32"
    unknown = set(constexprs) - {p.name for p in kernel.params}
    if unknown:
        raise KeyError(f"{kernel.fn.__name__}: no parameter {sorted(unknown)}")
    return triton.compile(ASTSource(kernel, signature, consts, attrs), target=TARGET, options=options).asm["ptx"]


MAIN_TILE = (128, 128, 16, 4, 3)
# the other tiles of launch_table's sequential rules for sm_90 (64 wide past a wave, K = 64, 256)
OTHER_TILES = ((128, 128, 32, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 16, 4, 3),
               (256, 256, 64, 8, 2))


def _cases(tile, segments: bool):
    """(gates, varlen, states) compiled at a tile: every combination at the main tile, the
    scalar gate with states elsewhere; the segment variants (always varlen) once per gate."""
    if segments:
        return [(gates, True, True) for gates in ("none", "g", "gk", "g+gk")] if tile == MAIN_TILE else []
    if tile != MAIN_TILE:
        return [("g", False, True)]
    return [(gates, varlen, states) for gates in ("none", "g", "gk", "g+gk")
            for varlen, states in ((False, False), (False, True), (True, True))]


def variants(segments: bool = False):
    """(label, kernel, constexprs, absent pointers, options). With segments: the new kernels'
    segment switches on, as the split launchers set them."""
    for tile in (MAIN_TILE,) + OTHER_TILES:
        K, V, bv, warps, stages = tile
        options = dict(num_warps=warps, num_stages=stages)
        for gates, varlen, states in _cases(tile, segments):
            has_g, has_gk = "g" in gates.split("+"), "gk" in gates
            for from_t in ((False, True) if not has_gk else (False,)):
                c = dict(H=16, HV=16, K=K, V=V, BK=K, BV=bv, HAS_G=has_g, HAS_GK=has_gk, HAS_H0=states,
                         STORE_HT=states, WU_FROM_T=from_t, IS_VARLEN=varlen)
                absent = {n for n, on in (("g_cum", has_g), ("gk_cum", has_gk), ("h0", states),
                                          ("ht", states), ("cu_seqlens", varlen), ("chunk_offsets", varlen),
                                          ("w", not from_t), ("u", not from_t), ("ai", from_t),
                                          ("beta", from_t)) if not on}
                label = f"fwd_h K{K} BV{bv} W{warps} S{stages} {gates} states={states} varlen={varlen} from_t={from_t}"
                if not segments:
                    yield label, "gdn_fwd_h_kernel", c, absent, options
                else:
                    seg = dict(c, IS_VARLEN=True, HAS_H0=False, STORE_HT=True, STORE_STATES=False)
                    yield label + " seg-local", "gdn_fwd_h_kernel", seg, absent - {"ht"}, options
                    yield (label + " seg-transition", "gdn_fwd_h_kernel",
                           dict(seg, V=K, CONSTANT_TERMS=False, H0_IDENTITY=True), absent - {"ht"}, options)
                    yield (label + " seg-from-start", "gdn_fwd_h_kernel",
                           dict(c, IS_VARLEN=True, HAS_H0=True, STORE_HT=False), absent - {"h0"} | {"ht"}, options)
            c = dict(HQ=16, HV=16, K=K, V=V, BK=K, BV=bv, HAS_G=has_g, HAS_GK=has_gk, HAS_DHT=states,
                     STORE_DH0=states, IS_VARLEN=varlen)
            absent = {n for n, on in (("g_cum", has_g), ("gk_cum", has_gk), ("dht", states), ("dh0", states),
                                      ("cu_seqlens", varlen), ("chunk_offsets", varlen)) if not on}
            label = f"bwd_dhu K{K} BV{bv} W{warps} S{stages} {gates} states={states} varlen={varlen}"
            if not segments:
                yield label, "gdn_bwd_dhu_kernel", c, absent, options
            else:
                seg = dict(c, IS_VARLEN=True, HAS_DHT=False, STORE_DH0=True, STORE_STATES=False)
                yield label + " seg-local", "gdn_bwd_dhu_kernel", seg, absent - {"dh0"}, options
                yield (label + " seg-transition", "gdn_bwd_dhu_kernel",
                       dict(seg, V=K, CONSTANT_TERMS=False, DHT_IDENTITY=True), absent - {"dh0"}, options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", help="folder holding flash_dma_old (bench/make_old_package.sh)")
    parser.add_argument("--only", help="comma-separated label prefixes (fwd_h, bwd_dhu)")
    parser.add_argument("--dump", help="write both normalised PTX of each differing variant here")
    parser.add_argument("--no-segments", action="store_true", help="skip compiling the segment variants")
    args = parser.parse_args()
    sys.path.insert(0, args.old_dir)
    only = tuple(args.only.split(",")) if args.only else None
    differ = compare_packages(variants(), compile_ptx, find_kernel, only, args.dump)
    compiled = 0
    if not args.no_segments:
        for label, name, constexprs, absent, options in variants(segments=True):
            if only and not label.startswith(only):
                continue
            compile_ptx(find_kernel("flash_dma", name), constexprs, absent, options)
            compiled += 1
        print(f"{compiled} segment variants compile for sm_90")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
