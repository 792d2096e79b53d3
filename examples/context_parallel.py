"""One training step of a small hybrid model (a gated delta rule layer, then dynamic mask attention
with a trainable key-wise bias) on one sequence split across N ranks, checked against one process.

    torchrun --nproc_per_node 2 examples/context_parallel.py            # NCCL, one GPU per rank, bf16
    torchrun --nproc_per_node 3 examples/context_parallel.py --cpu      # gloo, Triton's interpreter
    torchrun --nproc_per_node 2 examples/context_parallel.py --form all_gather

Every rank builds the same model (same seed) and the same global batch, keeps its shard of the
tokens (zigzag: chunks r and 2N-1-r of 2N, which balances causal attention), runs forward and
backward with flash_dma.distributed (attention: the ring form by default, key/value blocks passed
from rank to rank beside the compute; --form all_gather for the other), and all-reduces the
parameter gradients over the group (as data parallelism would; each rank's gradient covers its
own tokens). Each rank also runs the whole sequence in one process and compares: its output rows
and every parameter gradient.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="gloo on CPUs, kernels in Triton's interpreter (fp16/fp32)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens of the whole sequence "
                   "(default: 8192 per rank on GPUs, 16 per rank on the CPU)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--form", default="ring", choices=["ring", "all_gather"],
                   help="context-parallel attention form of cp_flash_dma_func (not --packed: varlen is all-gather)")
    p.add_argument("--packed", action="store_true",
                   help="three packed sequences instead of one (varlen attention, no bias)")
    return p.parse_args()


args = parse_args()
if args.cpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flash_dma import chunk_gated_delta_rule, flash_dma_func, flash_dma_varlen_func  # noqa: E402
from flash_dma.distributed import (build_cp_context, cp_chunk_gated_delta_rule, cp_flash_dma_func,  # noqa: E402
                                   cp_flash_dma_varlen_func)


class HybridBlock(nn.Module):
    """x [1, T, C] -> a gated delta rule layer, then causal attention with a key-wise bias
    computed from x (trainable through dbias), each with a residual connection."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_heads: int):
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.dr_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.dr_gates = nn.Linear(dim, 2 * heads)  # log decay g and beta per head
        self.dr_out = nn.Linear(heads * head_dim, dim, bias=False)
        self.at_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.at_kv = nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        # one learned bias per key and head (no constant term: softmax ignores a shift per row)
        self.at_bias = nn.Linear(dim, heads, bias=False)
        self.at_out = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x, cu_seqlens, max_len: int, cp_context=None, packed: bool = False, form: str = "ring"):
        T, H, D, Hk = x.shape[1], self.heads, self.head_dim, self.kv_heads
        q, k, v = self.dr_qkv(x).view(1, T, 3, H, D).unbind(2)
        q, k = F.normalize(q.float(), dim=-1).to(x.dtype), F.normalize(k.float(), dim=-1).to(x.dtype)
        a, b = self.dr_gates(x).float().view(1, T, 2, H).unbind(2)
        g, beta = F.logsigmoid(a + 4.0), torch.sigmoid(b).to(x.dtype)
        if cp_context is None:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        else:
            o, _ = cp_chunk_gated_delta_rule(q, k, v, g, beta, cp_context=cp_context)
        x = x + self.dr_out(o.reshape(1, T, H * D))

        q = self.at_q(x).view(T, H, D)
        k, v = self.at_kv(x).view(T, 2, Hk, D).unbind(1)
        if packed:  # packed sequences: each attends within itself
            if cp_context is None:
                o = flash_dma_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, is_causal=True)
            else:
                o = cp_flash_dma_varlen_func(q, k, v, cp_context, is_causal=True)
        else:  # one sequence, with a key-wise bias [1, H, 1, T] (sharded with its keys under CP)
            bias = self.at_bias(x).transpose(1, 2).unsqueeze(2).contiguous()
            if cp_context is None:
                o = flash_dma_func(q[None], k[None], v[None], attn_bias=bias, is_causal=True)[0]
            else:
                o = cp_flash_dma_func(q[None], k[None], v[None], attn_bias=bias, is_causal=True,
                                      group=cp_context.group, layout=cp_context.layout, form=form)[0]
        return x + self.at_out(o.reshape(1, T, H * D))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if torch.isnan(x).any():
        return float("nan")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def main():
    if args.cpu:
        dist.init_process_group("gloo")
    else:  # the device named to the group, so NCCL need not guess it from the rank
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float16  # the interpreter's attention takes fp16
        dims = dict(dim=32, heads=2, head_dim=16, kv_heads=1)
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        torch.cuda.set_device(device)
        dims = dict(dim=1024, heads=8, head_dim=128, kv_heads=2)
    seq_len = args.seq_len or (16 if args.cpu else 8192) * world
    parts = 2 * world if args.layout == "zigzag" else world
    seq_len -= seq_len % parts

    torch.manual_seed(0)  # the same model and batch on every rank
    model = HybridBlock(**dims).to(device=device, dtype=dtype)
    x = torch.randn(1, seq_len, dims["dim"], device=device, dtype=dtype)
    target = torch.randn_like(x)
    if args.packed:
        cut = [0, seq_len // 5, seq_len // 5 + 3, seq_len]
    else:
        cut = [0, seq_len]
    cu = torch.tensor(cut, dtype=torch.int32, device=device)
    max_len = max(b - a for a, b in zip(cut, cut[1:]))

    # the context-parallel step on this rank's shard
    ctx = build_cp_context(cu, layout=args.layout)
    x_local, target_local = ctx.shard(x), ctx.shard(target)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out_local = model(x_local, None, max_len, cp_context=ctx, packed=args.packed, form=args.form)
    loss = F.mse_loss(out_local.float(), target_local.float(), reduction="sum") / target.numel()
    loss.backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.grad is not None]  # (--packed: no bias)
    grads = [p.grad.float() for _, p in trained]
    for g in grads:  # each rank's gradient covers its own tokens
        dist.all_reduce(g)
    sync()
    cp_time = time.perf_counter() - start
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)

    # the same step in one process
    model.zero_grad()
    sync()
    start = time.perf_counter()
    out = model(x, cu, max_len, packed=args.packed)
    ref_loss = F.mse_loss(out.float(), target.float(), reduction="sum") / target.numel()
    ref_loss.backward()
    sync()
    one_time = time.perf_counter() - start

    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    errors = {"out": rel_err(out_local, ctx.shard(out.detach()))}
    for (name, p), g in zip(trained, grads):
        errors[f"d{name}"] = rel_err(g, p.grad.float())
    worst = max(errors, key=lambda n: errors[n] if errors[n] == errors[n] else float("inf"))
    ok = all(e <= tol for e in errors.values())  # NaN fails
    form = "all_gather (varlen)" if args.packed else args.form
    say(f"rank {rank}/{world} ({dist.get_backend()}, {dtype}, {seq_len} tokens, {args.layout}, {form}): "
        f"loss {total_loss.item():.6f} vs {ref_loss.item():.6f}; worst rel. error {worst} "
        f"{errors[worst]:.1e} (bound {tol:.0e}); step {cp_time * 1e3:.1f} ms split, "
        f"{one_time * 1e3:.1f} ms whole (first calls include compilation)")
    dist.destroy_process_group()
    if not ok:
        say(f"rank {rank}: errors over {tol:.0e}: " +
            ", ".join(f"{n}={e:.1e}" for n, e in errors.items() if not e <= tol))
        sys.exit(1)


def say(line):
    """One line in one write: the ranks share stdout, and print's separate newline write (unbuffered
    under PYTHONUNBUFFERED) lets another rank's line land between text and newline."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
