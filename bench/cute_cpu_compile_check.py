"""Compile the CuTe backend's kernels (FA4's SM90 forward and backward, through our wrapper) for
sm_90a on a machine without a GPU, and check that a new length compiles nothing.

    python bench/cute_cpu_compile_check.py                      # every plain variant (long on 2 cores)
    python bench/cute_cpu_compile_check.py --dims 128 --dtypes bf16 --causal 1 --gqa 4 --varlen 0
    python bench/cute_cpu_compile_check.py --pairs bias,mask-keys --varlen 0   # mask/bias hooks
    python bench/cute_cpu_compile_check.py --pairs bias --varlen 0 --key-multiple 8 \
        --choices attention_cute_bias_prefetch=tma      # the TMA bias forward (keys a multiple of 8)

--pairs picks the mask/bias variants (cute/masked.py, fixed lengths only): "none" (plain), or
one of PAIRS below (a mask and/or bias shape, and whether dbias is asked for).

Needs the hopper extra (pip install "flash-dma[hopper]"); torch may be the CPU build. Tensors are
torch fake tensors on "cuda" (shapes and strides, no memory), which FA4 compiles from. Each
variant compiles at lengths (Sq, Sk) = (300, 257), then runs again at (1000, 777) and at
(4100, 4100): both must find every kernel in FA4's in-process cache. Lengths here stay above one
tile on both sides, where FA4 picks no length-class variant (see cute/plain.py's docstring). The
compiled function's object file must embed an sm_90a cubin (ptxas ran, not only PTX emitted).
Prints one line per variant and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

# Before FA4 is imported: the compilation target, FA4's kernel family, and the SM count it reads
# for its split heuristic (SM90 never splits; an H100 SXM's 132).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from flash_dma.ops.dynamic_mask_attention.cute import availability, masked, plain  # noqa: E402
from flash_dma.runtime.config import overrides, parse_overrides  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FIRST_LENGTHS = (300, 257)
LATER_LENGTHS = ((1000, 777), (4100, 4100))

# name -> (mask shape, bias shape, dbias), shapes as functions of (B, H, Hk, Sq, Sk)
PAIRS = {
    "bias": (None, lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk), "store"),
    "bias-shared": (None, lambda B, H, Hk, Sq, Sk: (1, Hk, Sq, Sk), "atomic"),
    "bias-keys": (None, lambda B, H, Hk, Sq, Sk: (B, 1, 1, Sk), None),
    # dbias summed over queries (cute/backward_bias.py): stored per (batch, head), or atomic
    "bias-keys-dbias": (None, lambda B, H, Hk, Sq, Sk: (B, H, 1, Sk), "store"),
    "bias-keys-shared": (None, lambda B, H, Hk, Sq, Sk: (1, Hk, 1, Sk), "atomic"),
    "mask": (lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk), None, None),
    "mask-keys": (lambda B, H, Hk, Sq, Sk: (1, Hk, 1, Sk), None, None),
    "mask-bias": (lambda B, H, Hk, Sq, Sk: (B, 1, Sq, Sk),
                  lambda B, H, Hk, Sq, Sk: (B, H, Sq, Sk), "store"),
}


def _caches():
    fa4 = plain._fa4()
    return {"fwd": fa4._flash_attn_fwd.compile_cache, "bwd": fa4._flash_attn_bwd.compile_cache,
            "bwd_pre": fa4._bwd_preprocess.compile_cache,
            "bwd_post": fa4._bwd_postprocess_convert.compile_cache}


def _compiled_count() -> int:
    return sum(len(cache.cache) for cache in _caches().values())


def _embeds_sm90a_cubin(fn) -> bool:
    obj = fn.dump_to_object("flash_dma_check")
    return obj.count(b"\x7fELF") >= 2 and b"sm_90a" in obj  # host object + device cubin


def _inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, dim, dtype, varlen):
    def make(*shape):
        return torch.empty(*shape, dtype=dtype, device="cuda")
    if not varlen:
        return (make(batch, seqlen_q, heads, dim), make(batch, seqlen_k, kv_heads, dim),
                make(batch, seqlen_k, kv_heads, dim), {})
    offsets = dict(cu_seqlens_q=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   cu_seqlens_k=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)
    return (make(batch * seqlen_q, heads, dim), make(batch * seqlen_k, kv_heads, dim),
            make(batch * seqlen_k, kv_heads, dim), offsets)


def _run_pair(pair, lengths, heads, kv_heads, dim, dtype, causal):
    mask_shape, bias_shape, dbias = PAIRS[pair]
    batch = 2
    q, k, v, _ = _inputs(batch, *lengths, heads, kv_heads, dim, dtype, False)
    dims = (batch, heads, kv_heads, *lengths)
    mask = torch.empty(mask_shape(*dims), dtype=torch.bool, device="cuda") if mask_shape else None
    bias = torch.empty(bias_shape(*dims), dtype=dtype, device="cuda") if bias_shape else None
    scale = dim ** -0.5
    start = time.perf_counter()
    out, lse = masked.forward(q, k, v, mask, bias, causal=causal, softmax_scale=scale)
    fwd_s = time.perf_counter() - start
    start = time.perf_counter()
    dq, dk, dv, db = masked.backward(torch.empty_like(out), q, k, v, out, lse, mask, bias,
                                     causal=causal, softmax_scale=scale, dbias_mode=dbias)
    bwd_s = time.perf_counter() - start
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (db is None) == (dbias is None) and (db is None or (db.shape == bias.shape and db.dtype == bias.dtype))
    return fwd_s, bwd_s


def _run(lengths, heads, kv_heads, dim, dtype, causal, varlen, deterministic, pair="none"):
    if pair != "none":
        return _run_pair(pair, lengths, heads, kv_heads, dim, dtype, causal)
    q, k, v, offsets = _inputs(2, *lengths, heads, kv_heads, dim, dtype, varlen)
    scale = dim ** -0.5
    start = time.perf_counter()
    out, lse = plain.forward(q, k, v, causal=causal, softmax_scale=scale, **offsets)
    fwd_s = time.perf_counter() - start
    start = time.perf_counter()
    dq, dk, dv = plain.backward(torch.empty_like(out), q, k, v, out, lse, causal=causal,
                                softmax_scale=scale, deterministic=deterministic, **offsets)
    bwd_s = time.perf_counter() - start
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert lse.dtype == torch.float32
    return fwd_s, bwd_s


def check_variant(dim, dtype_name, causal, group, varlen, deterministic, pair="none") -> bool:
    heads, kv_heads = (2 * group, 2) if group > 1 else (4, 4)
    label = (f"{dtype_name} D{dim} {'causal' if causal else 'full'} H{heads}/Hk{kv_heads} "
             f"{'varlen' if varlen else 'fixed'}{' deterministic' if deterministic else ''}"
             f"{'' if pair == 'none' else ' ' + pair}")
    if pair != "none" and (varlen or deterministic):
        print(f"skip {label}: the mask/bias path is fixed-length and not deterministic", flush=True)
        return True
    before = _compiled_count()
    seen = {name: set(cache.cache) for name, cache in _caches().items()}
    try:
        with FakeTensorMode():
            fwd_s, bwd_s = _run(FIRST_LENGTHS, heads, kv_heads, dim, DTYPES[dtype_name], causal,
                                varlen, deterministic, pair)
            compiled = _compiled_count()
            for lengths in LATER_LENGTHS:
                _run(lengths, heads, kv_heads, dim, DTYPES[dtype_name], causal, varlen,
                     deterministic, pair)
        recompiled = _compiled_count() - compiled
        new = [fn for name, cache in _caches().items() for key, fn in cache.cache.items()
               if key not in seen[name]]
        cubins = all(_embeds_sm90a_cubin(fn) for fn in new)
    except Exception as exc:  # report every variant, then fail at the end
        print(f"FAIL {label}: {type(exc).__name__}: {exc}", flush=True)
        return False
    ok = recompiled == 0 and cubins
    print(f"{'ok  ' if ok else 'FAIL'} {label}: compiled {compiled - before} kernels "
          f"(fwd {fwd_s:.1f} s, bwd {bwd_s:.1f} s), new lengths compiled {recompiled}, "
          f"sm_90a cubins {'yes' if cubins else 'NO'}", flush=True)
    return ok


def _ints(text):
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=_ints, default=list(plain.PLAIN_HEAD_DIMS))
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16", "fp16"])
    parser.add_argument("--causal", type=_ints, default=[0, 1])
    parser.add_argument("--gqa", type=_ints, default=[1, 4], help="query heads per kv head")
    parser.add_argument("--varlen", type=_ints, default=[0, 1])
    parser.add_argument("--deterministic", type=_ints, default=[0])
    parser.add_argument("--pairs", type=lambda s: s.split(","), default=["none"],
                        help="mask/bias variants: none or " + ", ".join(PAIRS))
    parser.add_argument("--key-multiple", type=int, default=1,
                        help="round the key lengths down to a multiple of this (TMA's 16-byte rows)")
    parser.add_argument("--choices", type=parse_overrides, default={},
                        help="declared choices to override, name=value,... (True/False for flags)")
    args = parser.parse_args(argv)
    status = availability.software_status()
    if status is not None:
        print(f"cannot check: {status}")
        return 2
    if not torch.cuda.is_available():
        # the wrapper's device guard, and the DLPack export of FA4's deterministic-mode
        # semaphores, ask for the current CUDA device, which a CPU build of torch cannot answer;
        # the fake tensors all live on cuda:0
        torch.cuda.current_device = lambda: 0
        # the tile lists ask whether a CUDA graph is being captured, which a CPU build of torch
        # cannot answer either
        torch.cuda.is_current_stream_capturing = lambda: False
        # a CPU build of torch cannot copy fake CUDA tensors (copy_), though it clones them:
        # .contiguous() of a non-contiguous list goes through clone here
        real_contiguous = torch.Tensor.contiguous

        def contiguous(self, memory_format=torch.contiguous_format):
            if self.is_contiguous(memory_format=memory_format):
                return real_contiguous(self, memory_format=memory_format)
            return self.clone(memory_format=memory_format)
        torch.Tensor.contiguous = contiguous
    print(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']} torch {torch.__version__}", flush=True)
    global FIRST_LENGTHS, LATER_LENGTHS
    step = args.key_multiple
    FIRST_LENGTHS = (FIRST_LENGTHS[0], FIRST_LENGTHS[1] // step * step)
    LATER_LENGTHS = tuple((sq, sk // step * step) for sq, sk in LATER_LENGTHS)
    with overrides(**args.choices):
        results = [check_variant(*variant) for variant in itertools.product(
            args.dims, args.dtypes, map(bool, args.causal), args.gqa, map(bool, args.varlen),
            map(bool, args.deterministic), args.pairs)]
    failed = results.count(False)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
