"""A/B of two versions of the package in one process: the headline rows of both ops' reports.

    python bench/ab_packages.py --old DIR [--rounds 5] [--only attention|gdn|gdn-kept] [--rows kda]

DIR holds a copy of an earlier flash_dma renamed to flash_dma_old (bench/make_old_package.sh
makes one from a commit). Each row is timed for the old and the new package in alternating
rounds (do_bench medians per round, then the median of the rounds), so that the machine's drift
during the run falls on both alike. Prints one table; --out writes it too.
"""
import argparse
import datetime
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402


def attention_rows(pkg):
    """(label, callable) pairs: forward and forward+backward of the attention headline rows."""
    dev, bf = "cuda", torch.bfloat16
    rows = []

    def add(label, B, H, Hk, S, D, causal=False, bias_shape=None, mask=None, Sk=None):
        Sk = Sk or S
        q = torch.randn(B, S, H, D, device=dev, dtype=bf, requires_grad=True)
        k = torch.randn(B, Sk, Hk, D, device=dev, dtype=bf, requires_grad=True)
        v = torch.randn(B, Sk, Hk, D, device=dev, dtype=bf, requires_grad=True)
        bias = None
        if bias_shape is not None:
            bias = torch.randn(*bias_shape, device=dev, dtype=bf, requires_grad=True)
        leaves = [t for t in (q, k, v, bias) if t is not None]
        do = torch.randn_like(q)

        def fwd():
            return pkg.flash_dma_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal)

        def fwd_bwd():
            torch.autograd.grad(fwd(), leaves, do)
        rows.append((label + " fwd", fwd))
        rows.append((label + " fwd+bwd", fwd_bwd))

    add("B4 H16 S4096 D128", 4, 16, 16, 4096, 128)
    add("B4 H16 S4096 D128 causal", 4, 16, 16, 4096, 128, causal=True)
    add("B4 H16 S4096 D64", 4, 16, 16, 4096, 64)
    add("B4 H8 S4096 D256", 4, 8, 8, 4096, 256)
    add("B2 H16 S4096 D128 bias[B,H,S,S]", 2, 16, 16, 4096, 128, bias_shape=(2, 16, 4096, 4096))
    add("B2 H16 S4096 D128 causal bias[B,H,S,S]", 2, 16, 16, 4096, 128, causal=True,
        bias_shape=(2, 16, 4096, 4096))
    add("B2 H16 S4096 D128 bias[B,H,1,S]", 2, 16, 16, 4096, 128, bias_shape=(2, 16, 1, 4096))
    tiles = torch.rand(2, 16, 32, 32, device=dev) < 0.125
    eighth = tiles.repeat_interleave(128, 2).repeat_interleave(128, 3)
    add("B2 H16 S4096 D128 1/8 tiles", 2, 16, 16, 4096, 128, mask=eighth)
    key_bias = torch.randn(1, 16, 1, 16384, device=dev, dtype=bf)
    keys = key_bias.topk(1024, dim=-1).indices
    keep = torch.zeros(1, 16, 1, 16384, device=dev, dtype=torch.bool).scatter_(-1, keys, True)
    add("B1 H16 S16384 D128 top-1024 keys", 1, 16, 16, 16384, 128, bias_shape=(1, 16, 1, 16384), mask=keep)
    return rows


def gdn_rows(pkg, keep_states=False):
    """The gated delta rule's headline rows; keep_states times them all with disable_recompute=True
    (a package from before that option cannot run those)."""
    dev, bf = "cuda", torch.bfloat16
    rows = []
    kept = {"disable_recompute": True} if keep_states else {}
    label_tail = " kept" if keep_states else ""

    def add(label, B, T, H, K=128, V=128, per_key=False, varlen=None):
        label += label_tail
        q = torch.randn(B, T, H, K, device=dev, dtype=bf, requires_grad=True)
        k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(bf).requires_grad_()
        v = torch.randn(B, T, H, V, device=dev, dtype=bf, requires_grad=True)
        beta = torch.rand(B, T, H, device=dev, dtype=bf).requires_grad_()
        if per_key:
            g, gk = None, F.logsigmoid(torch.randn(B, T, H, K, device=dev) + 4).requires_grad_()
        else:
            g, gk = F.logsigmoid(torch.randn(B, T, H, device=dev) + 4).requires_grad_(), None
        leaves = [t for t in (q, k, v, g, gk, beta) if t is not None]
        do = torch.randn(B, T, H, V, device=dev, dtype=bf)
        cu = None if varlen is None else torch.tensor(varlen, device=dev, dtype=torch.int32)

        def fwd():
            return pkg.chunk_gated_delta_rule(q, k, v, g, beta, gk=gk, cu_seqlens=cu, **kept)[0]

        def fwd_bwd():
            torch.autograd.grad(fwd(), leaves, do)
        rows.append((label + " fwd", fwd))
        rows.append((label + " fwd+bwd", fwd_bwd))

    add("gdn B4 T4096 H16", 4, 4096, 16)
    add("gdn B1 T8192 H16", 1, 8192, 16)
    add("gdn B1 T32768 H16", 1, 32768, 16)
    add("gdn B8 T4096 H32", 8, 4096, 32)
    add("gdn B2 T8192 H8 K256 V256", 2, 8192, 8, 256, 256)
    add("kda B2 T4096 H16", 2, 4096, 16, per_key=True)
    add("gdn varlen 3 seqs T12288 H16", 1, 12288, 16, varlen=[0, 1000, 5096, 12288])
    if keep_states:
        return rows
    for T in (2048, 8192):
        q = torch.randn(2, T, 16, 128, device=dev, dtype=bf)
        k = F.normalize(torch.randn(2, T, 16, 128, device=dev), dim=-1).to(bf)
        w, do, dv = (torch.randn(2, T, 16, 128, device=dev, dtype=bf) * 0.1 for _ in range(3))
        rows.append((f"bwd_dhu B2 T{T} H16 mode A",
                     lambda q=q, k=k, w=w, do=do, dv=dv: pkg.chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dv)))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="folder holding flash_dma_old/")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("attention", "gdn", "gdn-kept"))
    parser.add_argument("--rows", help="only the rows whose label holds this text")
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, args.old)
    new = importlib.import_module("flash_dma")
    old = importlib.import_module("flash_dma_old")
    makers = {"attention": attention_rows, "gdn": gdn_rows,
              "gdn-kept": lambda pkg: gdn_rows(pkg, keep_states=True)}
    names = [args.only] if args.only else ["attention", "gdn"]
    lines = [f"A/B {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
             f"{torch.cuda.get_device_name()} torch {torch.__version__}; median of {args.rounds} "
             "alternating rounds of do_bench medians, ms",
             f"{'row':<48} {'old':>9} {'new':>9} {'new/old':>8}"]
    for name in names:
        torch.manual_seed(0)
        pairs = [(a, b) for a, b in zip(makers[name](old), makers[name](new)) if args.rows is None or args.rows in a[0]]
        for (label, run_old), (_, run_new) in pairs:
            run_old(), run_new()  # compile and plan outside the timing
            times = {"old": [], "new": []}
            for _ in range(args.rounds):
                times["old"].append(do_bench(run_old, warmup=25, rep=100, return_mode="median"))
                times["new"].append(do_bench(run_new, warmup=25, rep=100, return_mode="median"))
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            lines.append(f"{label:<48} {o:9.3f} {n:9.3f} {n / o:8.3f}")
            print(lines[-1], flush=True)
        del pairs
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
