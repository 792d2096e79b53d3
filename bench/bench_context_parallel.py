"""Context parallelism on N GPUs: time of a forward + backward of each op on a sequence split N
ways, against one GPU; weak-scaling efficiency, and for attention both forms (ring, all-gather)
with the ring's communication/compute overlap.

    torchrun --nproc_per_node N bench/bench_context_parallel.py [--tokens-per-rank 32768] [--op gdr|attn]

Gated delta rule (linear in the sequence): weak-scaling efficiency = t_1(S) / t_N(N S), S the
tokens per rank. Causal attention (quadratic: each rank's work grows with N): efficiency =
(t_1(N S) / N) / t_N(N S), the one-GPU time of the whole sequence shared out evenly, against the
split time. "comm alone": the all-gather of K/V (or of the exchanged states) forward + backward,
or the ring's P2P transfers of both rounds, each timed on its own. "compute alone" (ring): the
same calls with every transfer replaced by the rank's own block. "comm hidden" = 1 - (split -
compute alone) / comm alone: the share of the ring's transfer time that ran beside its kernels
(the all-gather form overlaps nothing: 0%). Prints a table and writes
bench/results/cp-<GPU>-N<N>.json.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flash_dma import chunk_gated_delta_rule, flash_dma_func  # noqa: E402
from flash_dma.distributed import (build_cp_context, cp_chunk_gated_delta_rule, cp_flash_dma_func,  # noqa: E402
                                   gather_sequence, shard_sequence)
from flash_dma.distributed.ring_attention import (make_ring_plan, ring_flash_dma_func,  # noqa: E402
                                                  ring_transfers_only)
from flash_dma.runtime.config import overrides  # noqa: E402


def timed(fn, warmup: int = 2, iters: int = 5, across_ranks: bool = True) -> float:
    """Seconds per call of fn (forward + backward): the slowest rank's, or with across_ranks off
    this rank's alone (fn then holds no collective)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if across_ranks:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor(start.elapsed_time(end) / 1e3 / iters, device="cuda")
    if across_ranks:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fwd_bwd(op, *inputs):
    def run():
        out = op(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return run


def fwd_only(op, *inputs):
    def run():
        with torch.no_grad():
            op(*inputs)
    return run


def leaf(t):
    return t.detach().requires_grad_(True)


def bench_gdr(tokens: int, world: int, rank: int, heads: int, dim: int, segment_sweep=()):
    """One sequence of world * tokens: the exchanged states pass through every rank."""
    total = tokens * world
    gen = torch.Generator(device="cuda").manual_seed(0)

    def inputs(T):
        q = torch.randn(1, T, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = F.normalize(torch.randn(1, T, heads, dim, device="cuda", generator=gen), dim=-1).to(torch.bfloat16)
        v = torch.randn(1, T, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(1, T, heads, device="cuda", generator=gen) + 4)
        beta = torch.rand(1, T, heads, device="cuda", generator=gen).to(torch.bfloat16)
        return [leaf(t) for t in (q, k, v, g, beta)]

    ctx = build_cp_context(torch.tensor([0, total], dtype=torch.int32, device="cuda"))
    local = [leaf(ctx.shard(t)) for t in inputs(total)]
    split = (lambda *x: cp_chunk_gated_delta_rule(*x, cp_context=ctx))
    t_split = timed(fwd_bwd(split, *local))
    t_split_fwd = timed(fwd_only(split, *local))
    per_segment = {}
    for chunks in segment_sweep:  # the same call with other segment lengths (the op's choice)
        with overrides(gdn_chunks_per_segment=chunks):
            per_segment[chunks] = timed(fwd_bwd(split, *local))
    state = leaf(torch.randn(1, heads, dim, 2 * dim, device="cuda"))  # [N | M] per rank
    t_gather = timed(fwd_bwd(lambda s: gather_sequence(s, 0, layout="contiguous"), state))
    t_one = t_one_fwd = None
    if rank == 0:
        # the one-GPU call as a user makes it: one sequence of the rank's length, fixed length
        # (launch_table's sequence-split rule applies)
        one = inputs(tokens)
        t_one = timed(fwd_bwd(chunk_gated_delta_rule, *one), across_ranks=False)
        t_one_fwd = timed(fwd_only(chunk_gated_delta_rule, *one), across_ranks=False)
    dist.barrier()
    return dict(op="gdr", tokens_per_rank=tokens, heads=heads, dim=dim, t_split=t_split, t_one_rank_tokens=t_one,
                efficiency=None if t_one is None else t_one / t_split, t_comm_alone=t_gather,
                t_split_forward=t_split_fwd, t_one_forward=t_one_fwd,
                forward_efficiency=None if t_one_fwd is None else t_one_fwd / t_split_fwd,
                t_split_by_segment_chunks=per_segment)


def bench_attention(tokens: int, world: int, rank: int, heads: int, kv_heads: int, dim: int, key_bias: bool):
    """Causal attention on world * tokens, zigzag: both forms of cp_flash_dma_func, and for the ring
    its compute alone (every transfer replaced by this rank's own block: the same calls) and its
    transfers alone, whence the share of the transfers hidden behind compute."""
    total = tokens * world
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, total, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, total, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, total, kv_heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(1, heads, 1, total, device="cuda", generator=gen, dtype=torch.bfloat16) if key_bias else None
    local = [leaf(shard_sequence(t, 1)) for t in (q, k, v)]
    local_bias = leaf(shard_sequence(bias, 3)) if key_bias else None
    times = {}
    for form in ("ring", "all_gather"):
        times[form] = timed(fwd_bwd(lambda q_, k_, v_, b_, f=form: cp_flash_dma_func(
            q_, k_, v_, attn_bias=b_, is_causal=True, form=f), *local, local_bias))
    times["gather"] = timed(fwd_bwd(lambda k_, v_: torch.cat(
        [gather_sequence(k_, 1), gather_sequence(v_, 1)], 2), local[1], local[2]))

    def ring_plan(exchange: bool):
        return make_ring_plan(None, world, rank, total, "zigzag", True, None, False, None, None, local_bias,
                              "key" if key_bias else None, exchange=exchange)

    compute_plan = ring_plan(False)
    times["ring_compute"] = timed(fwd_bwd(lambda q_, k_, v_, b_: ring_flash_dma_func(
        q_, k_, v_, None, b_, compute_plan), *local, local_bias))
    transfer_plan = ring_plan(True)
    times["ring_transfers"] = timed(lambda: ring_transfers_only(transfer_plan, local[1], local[2], None, local_bias))
    t_one = None
    if rank == 0:
        whole = [leaf(t) for t in (q, k, v)]
        fn = fwd_bwd(lambda q_, k_, v_, b_: flash_dma_func(q_, k_, v_, attn_bias=b_, is_causal=True),
                     *whole, leaf(bias) if key_bias else None)
        t_one = timed(fn, iters=3, across_ranks=False)
    dist.barrier()
    # exposed transfer time: what the ring takes beyond its compute; hidden: the rest of the
    # transfers' own time
    exposed = max(times["ring"] - times["ring_compute"], 0.0)
    hidden = None if times["ring_transfers"] <= 0 else max(0.0, 1.0 - exposed / times["ring_transfers"])
    name = "attention" + ("-keybias" if key_bias else "")
    return [dict(op=name, form=form, tokens_per_rank=tokens, heads=heads, kv_heads=kv_heads, dim=dim,
                 t_split=times[form], t_one_whole=t_one,
                 efficiency=None if t_one is None else t_one / world / times[form],
                 t_comm_alone=times["gather"] if form == "all_gather" else times["ring_transfers"],
                 t_compute_alone=times["ring_compute"] if form == "ring" else None,
                 comm_hidden=hidden if form == "ring" else 0.0)
            for form in ("ring", "all_gather")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens-per-rank", type=int, default=32768)
    p.add_argument("--op", choices=["gdr", "attn", "both"], default="both")
    p.add_argument("--segment-chunks", default="", help="gdr: also time these chunks per segment, e.g. 32,128")
    args = p.parse_args()
    # the device first and named to the group: NCCL otherwise guesses it from the rank, and a rank
    # crashed at exit (SIGSEGV in teardown) without it
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    if args.op in ("gdr", "both"):
        sweep = [int(x) for x in args.segment_chunks.split(",") if x]
        results.append(bench_gdr(args.tokens_per_rank, world, rank, heads=16, dim=128, segment_sweep=sweep))
    if args.op in ("attn", "both"):
        for key_bias in (False, True):
            results += bench_attention(args.tokens_per_rank, world, rank, heads=32, kv_heads=8, dim=128,
                                       key_bias=key_bias)
    if rank == 0:
        gpu = torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-")
        print(f"{'op':<18} {'form':<10} N  tokens/rank  split ms  efficiency  comm alone ms  compute alone ms  "
              f"comm hidden")
        for r in results:
            eff = "n/a" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
            comm = "n/a" if r.get("t_comm_alone") is None else f"{r['t_comm_alone'] * 1e3:.2f}"
            compute = "n/a" if r.get("t_compute_alone") is None else f"{r['t_compute_alone'] * 1e3:.2f}"
            hidden = "n/a" if r.get("comm_hidden") is None else f"{100 * r['comm_hidden']:.0f}%"
            print(f"{r['op']:<18} {r.get('form', '-'):<10} {world:<2} {r['tokens_per_rank']:<12} "
                  f"{r['t_split'] * 1e3:<9.2f} {eff:<11} {comm:<14} {compute:<17} {hidden}", flush=True)
            if r.get("forward_efficiency") is not None:
                print(f"{'  forward alone':<18} {'-':<10} {world:<2} {r['tokens_per_rank']:<12} "
                      f"{r['t_split_forward'] * 1e3:<9.2f} {100 * r['forward_efficiency']:.0f}%", flush=True)
            for chunks, t in r.get("t_split_by_segment_chunks", {}).items():
                eff = "n/a" if r["t_one_rank_tokens"] is None else f"{100 * r['t_one_rank_tokens'] / t:.0f}%"
                print(f"{'  segments of ' + str(chunks):<18} {'-':<10} {world:<2} {r['tokens_per_rank']:<12} "
                      f"{t * 1e3:<9.2f} {eff}", flush=True)
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"cp-{gpu}-N{world}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(gpu=gpu, world=world, date=datetime.date.today().isoformat(),
                           torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                           results=results), f, indent=1)
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
