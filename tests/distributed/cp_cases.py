"""Cases of the context-parallel tests: global inputs from a seed, the one-process call, the
context-parallel call on one rank, and how each tensor is sharded. Imported by the test (the
parent process, which runs the one-process calls) and by the spawned ranks (cp_worker.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import zlib

import torch
import torch.nn.functional as F

from flash_dma import chunk_gated_delta_rule, flash_dma_func, flash_dma_varlen_func
from flash_dma.distributed import (build_cp_context, cp_chunk_gated_delta_rule, cp_flash_dma_func,
                                   cp_flash_dma_varlen_func)
from flash_dma.distributed.context import shard, shard_ranges

# An empty sequence, short ones, and one that runs through every rank and, for three ranks or
# the zigzag layout, fills a rank's middle (the pieces whose transition M is exchanged).
PACKED = [0, 3, 3, 40, 44, 48]


@dataclass
class Case:
    name: str
    op: str  # "gdr", "attn", "attn_varlen"
    layout: str
    params: dict = field(default_factory=dict)
    # name -> sharded dim (with the case's layout), or None: replicated (gradients and outputs
    # summed over the ranks)
    shards: dict = field(default_factory=dict)
    worlds: tuple = (2, 3)  # the world sizes it runs with on the CPU (the interpreter is slow)


def _gdr(name, layout, worlds=(2, 3), **p):
    shards = {n: 1 for n in ("q", "k", "v", "g", "gk", "beta", "o")}
    shards.update(initial_state=None, final_state=None)
    return Case(name, "gdr", layout, p, shards, worlds)


def _attn(name, layout, worlds=(2, 3), **p):
    """p["form"]: "ring" or "all_gather" (cp_flash_dma_func's form); the ring cases compare lse too."""
    shards = {"q": 1, "k": 1, "v": 1, "o": 1, "lse": 2}
    for t in ("mask", "bias"):
        kind = p.get(t)
        if kind == "key":
            shards[t] = 3
        elif kind in ("dense", "rows"):
            shards[t] = 2
    return Case(name, "attn", layout, p, shards, worlds)


def _attn_varlen(name, layout, worlds=(2, 3), **p):
    return Case(name, "attn_varlen", layout, p, {"q": 0, "k": 0, "v": 0, "o": 0}, worlds)


# The delta rule's pieces: with two contiguous ranks the long sequence only passes from rank 0 to
# rank 1 (only N is exchanged); zigzag and three contiguous ranks put a rank inside it (M too).
# Per-key gates cost three times the scalar gate in the interpreter: one case.
CPU_CASES = [
    _gdr("gdr-g-states", "contiguous", worlds=(2,), T=48, H=1, HV=1, K=16, V=16, gate="g", states=True),
    # K = V = 64: the forward keeps T and the gated pair products for the backward
    _gdr("gdr-gk-states-l2norm", "contiguous", worlds=(3,), T=48, H=1, HV=1, K=64, V=64, gate="gk",
         states=True, l2norm=True),
    # one sequence through every rank, grouped value heads
    _gdr("gdr-zigzag-gva", "zigzag", worlds=(2,), T=48, H=1, HV=2, K=16, V=16, gate="g",
         states=False, cu=[0, 48]),
    # pieces of several segments (one chunk each, the last shorter), K != V
    _gdr("gdr-segments-of-one-chunk", "contiguous", worlds=(2,), T=288, H=1, HV=1, K=16, V=32, gate="g",
         states=True, segment_chunks=1, cu=[0, 100, 288]),
    _attn("attn-zigzag-causal-keywise-gqa", "zigzag", B=2, S=48, H=2, Hk=1, D=16, causal=True, mask="key",
          bias="key", form="all_gather"),
    _attn("attn-zigzag-causal-dense", "zigzag", worlds=(2,), B=1, S=48, H=2, Hk=2, D=16, causal=True,
          mask="dense", bias="dense", form="all_gather"),
    _attn("attn-contiguous-rows-fp32bias", "contiguous", worlds=(3,), B=1, S=48, H=2, Hk=1, D=16, causal=False,
          mask="rows", bias="dense", bias_fp32=True, form="all_gather"),
    # the ring: key-wise mask and bias traveling with their keys (zigzag: half blocks, two calls on
    # the own block); a dense bias cut by the blocks' global columns (several calls per block);
    # contiguous causal (blocks not sent past the last rank, gradients sent straight home)
    _attn("ring-zigzag-causal-keywise-gqa", "zigzag", B=2, S=48, H=2, Hk=1, D=16, causal=True, mask="key",
          bias="key", form="ring"),
    _attn("ring-zigzag-causal-dense-fp32bias", "zigzag", worlds=(2,), B=1, S=48, H=2, Hk=2, D=16, causal=True,
          mask="dense", bias="dense", bias_fp32=True, form="ring"),
    _attn("ring-contiguous-causal-rows", "contiguous", worlds=(3,), B=1, S=48, H=2, Hk=1, D=16, causal=True,
          mask="rows", bias="dense", form="ring"),
    _attn("ring-zigzag-keywise-bias", "zigzag", worlds=(3,), B=1, S=48, H=2, Hk=2, D=16, causal=False,
          bias="key", form="ring"),
    _attn_varlen("attn-varlen-zigzag-causal", "zigzag", T=48, H=2, Hk=1, D=16, causal=True),
    _attn_varlen("attn-varlen-contiguous", "contiguous", worlds=(2,), T=48, H=2, Hk=1, D=16, causal=False),
]

GPU_CASES = [
    _gdr("gpu-gdr-varlen", "contiguous", T=32768, H=8, HV=8, K=128, V=128, gate="g", states=True,
         cu=[0, 1000, 20000, 20001, 32768]),
    _gdr("gpu-gdr-gk-zigzag", "zigzag", T=16384, H=4, HV=8, K=128, V=128, gate="gk", states=True,
         cu=[0, 3000, 16384]),
    _attn("gpu-attn-zigzag-causal-keywise", "zigzag", B=1, S=16384, H=16, Hk=4, D=128, causal=True, mask="key",
          bias="key", form="all_gather"),
    _attn("gpu-attn-zigzag-causal-dense", "zigzag", B=1, S=4096, H=8, Hk=8, D=128, causal=True, mask="dense",
          bias="dense", form="all_gather"),
    _attn("gpu-ring-zigzag-causal", "zigzag", B=1, S=8192, H=16, Hk=16, D=128, causal=True, form="ring"),
    _attn("gpu-ring-zigzag-causal-keywise-gqa", "zigzag", B=1, S=8192, H=16, Hk=4, D=128, causal=True,
          mask="key", bias="key", form="ring"),
    _attn("gpu-ring-contiguous-dense", "contiguous", B=1, S=4096, H=8, Hk=8, D=128, causal=True, mask="dense",
          bias="dense", form="ring"),
    _attn_varlen("gpu-attn-varlen-causal", "zigzag", T=32768, H=16, Hk=4, D=128, causal=True,
                 cu=[0, 1000, 20000, 20001, 32768]),
]


def dtype_for(case: Case, on_gpu: bool) -> torch.dtype:
    """bf16 on GPUs; on the CPU fp16 for attention (what its kernels take in the interpreter) and
    fp32 for the delta rule."""
    if on_gpu:
        return torch.bfloat16
    return torch.float32 if case.op == "gdr" else torch.float16


def case_by_name(name: str) -> Case:
    for c in CPU_CASES + GPU_CASES:
        if c.name == name:
            return c
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
def make_inputs(case: Case, seed: int, device, dtype):
    """(inputs, weights): global leaf tensors, and the weights of the loss sum(out * weight) per
    output; the same for a (case, seed) in every process."""
    gen = torch.Generator().manual_seed(seed + zlib.crc32(case.name.encode()))

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    p = case.params
    if case.op == "gdr":
        T, H, HV, K, V = p["T"], p["H"], p["HV"], p["K"], p["V"]
        cu = p.get("cu", PACKED)
        x = dict(q=randn(1, T, H, K, dt=dtype), k=F.normalize(randn(1, T, H, K), dim=-1).to(dtype),
                 v=randn(1, T, HV, V, dt=dtype),
                 beta=torch.sigmoid(randn(1, T, HV)).to(dtype))
        if p["gate"] == "g":
            x["g"] = F.logsigmoid(randn(1, T, HV) + 4.0)
        else:
            x["gk"] = F.logsigmoid(randn(1, T, HV, K) + 4.0)
        if p["states"]:
            x["initial_state"] = randn(len(cu) - 1, HV, K, V) * 0.5
        w = dict(o=randn(1, T, HV, V))
        if p["states"]:
            w["final_state"] = randn(len(cu) - 1, HV, K, V)
    elif case.op == "attn":
        B, S, H, Hk, D = p["B"], p["S"], p["H"], p["Hk"], p["D"]
        x = dict(q=randn(B, S, H, D, dt=dtype), k=randn(B, S, Hk, D, dt=dtype), v=randn(B, S, Hk, D, dt=dtype))
        shapes = {"key": (B, H, 1, S), "dense": (B, H, S, S), "rows": (1, 1, S, S)}
        if p.get("mask"):
            shape = shapes[p["mask"]]
            x["mask"] = (torch.rand(*shape, generator=gen) < 0.8).to(device)
        if p.get("bias"):
            x["bias"] = randn(*shapes[p["bias"]], dt=torch.float32 if p.get("bias_fp32") else dtype)
        w = dict(o=randn(B, S, H, D))
    else:
        T, H, Hk, D = p["T"], p["H"], p["Hk"], p["D"]
        x = dict(q=randn(T, H, D, dt=dtype), k=randn(T, Hk, D, dt=dtype), v=randn(T, Hk, D, dt=dtype))
        w = dict(o=randn(T, H, D))
    for name, t in x.items():
        if t.is_floating_point():
            t.requires_grad_(True)
    return x, w


def packed(case: Case) -> list[int]:
    return case.params.get("cu", PACKED)


# ------------------------------------------------------------------------------------------------
# The one-process call and the context-parallel call
# ------------------------------------------------------------------------------------------------
def run_single(case: Case, x: dict, device) -> dict:
    p = case.params
    if case.op == "gdr":
        cu = torch.tensor(packed(case), dtype=torch.int32, device=device)
        o, final = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x.get("g"), x["beta"],
                                          initial_state=x.get("initial_state"), output_final_state=p["states"],
                                          use_qk_l2norm_in_kernel=p.get("l2norm", False), cu_seqlens=cu,
                                          gk=x.get("gk"))
        return dict(o=o, final_state=final) if p["states"] else dict(o=o)
    if case.op == "attn":
        o, lse = flash_dma_func(x["q"], x["k"], x["v"], x.get("mask"), x.get("bias"), p["causal"], return_lse=True)
        return dict(o=o, lse=lse)
    cu = torch.tensor(packed(case), dtype=torch.int32, device=device)
    lengths = [b - a for a, b in zip(packed(case), packed(case)[1:])]
    return dict(o=flash_dma_varlen_func(x["q"], x["k"], x["v"], cu, cu, max(lengths), max(lengths),
                                        is_causal=p["causal"]))


def run_cp(case: Case, x: dict, device, group=None) -> dict:
    """x: this rank's shards (and the replicated tensors)."""
    p = case.params
    if case.op == "attn":
        o, lse = cp_flash_dma_func(x["q"], x["k"], x["v"], x.get("mask"), x.get("bias"), p["causal"],
                                   return_lse=True, group=group, layout=case.layout, form=p["form"])
        return dict(o=o, lse=lse)
    ctx = build_cp_context(torch.tensor(packed(case), dtype=torch.int32, device=device), group, case.layout)
    if case.op == "gdr" and "segment_chunks" in p:
        from flash_dma.runtime.config import overrides
        with overrides(gdn_chunks_per_segment=p["segment_chunks"]):
            return run_cp(case_without(case, "segment_chunks"), x, device, group)
    if case.op == "gdr":
        o, final = cp_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x.get("g"), x["beta"],
                                             initial_state=x.get("initial_state"),
                                             output_final_state=p["states"],
                                             use_qk_l2norm_in_kernel=p.get("l2norm", False), gk=x.get("gk"),
                                             cp_context=ctx)
        return dict(o=o, final_state=final) if p["states"] else dict(o=o)
    return dict(o=cp_flash_dma_varlen_func(x["q"], x["k"], x["v"], ctx, is_causal=p["causal"]))


def case_without(case: Case, key: str) -> Case:
    return Case(case.name, case.op, case.layout, {k: v for k, v in case.params.items() if k != key}, case.shards)


def local_part(case: Case, name: str, t: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    dim = case.shards.get(name)
    if dim is None:
        return t
    return shard(t, dim, world_size, rank, case.layout)


def assemble(case: Case, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The global tensor from every rank's part: placed by the layout, or summed (replicated)."""
    dim = case.shards.get(name)
    if dim is None:
        return torch.stack([p.double() for p in parts]).sum(0)
    world = len(parts)
    total = parts[0].shape[dim] * world
    shape = list(parts[0].shape)
    shape[dim] = total
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    for r, part in enumerate(parts):
        offset = 0
        for s, e in shard_ranges(total, world, r, case.layout):
            out.narrow(dim, s, e - s).copy_(part.narrow(dim, offset, e - s))
            offset += e - s
    return out


def loss_of(outputs: dict, weights: dict) -> torch.Tensor:
    return sum((outputs[n].float() * w).sum() for n, w in weights.items())
