"""The `flash-dma` command.

    flash-dma bench [attention|gdn|dhu|decode|all] [--quick] [--json PATH] [--plot PATH] [--report PATH]
                    [--cases LABELS]
    flash-dma tune [attention|gdn|all] [--quick]
    flash-dma env [--attention SHAPE] [--gdn SHAPE]

On a CUDA GPU: times each op beside its peers (those installed; a missing one is named in a note)
and prints a report per op: attention (dynamic mask attention), gdn (the chunked gated delta rule,
forward and backward, beside FLA and FlashQLA), dhu (its state-gradient pass,
chunk_gated_delta_rule_bwd_dhu) and decode (flash_dma_with_kvcache); all runs the four. Without a
GPU it cannot time anything; it says so, runs a tiny correctness check of each op in Triton's CPU
interpreter, and exits 0 if the check passed, 1 if not (with --json, the file records that
nothing was timed and how the check ended).

`tune` sweeps the launch configurations of each op's kernels on this GPU and stores the fastest
in the tuning cache (flash_dma/benchmarks/tune.py); without a GPU it exits 1. `env` prints the
device, the installed backends and peers, the tuning cache and, for a shape, each op's plan.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

OPS = ("attention", "gdn", "dhu", "decode")


class _TextProgress:
    """Fallback progress bar when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc = total, 0, desc

    def update(self, n: int = 1):
        self.done += n
        print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self):
        print(file=sys.stderr)


def _progress(desc: str):
    def make(total: int):
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr)
        except ImportError:
            return _TextProgress(total, desc)
    return make


def _run_selfcheck() -> int:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "flash_dma.benchmarks.selfcheck"], env=env)


def _runner(op: str):
    """op -> run(quick, progress_factory) -> (sections, notes)."""
    if op == "attention":
        from .benchmarks import attention
        return attention.run
    if op == "decode":
        from .benchmarks import decode
        return decode.run
    from .benchmarks import gdn
    return {"gdn": gdn.run_op, "dhu": gdn.run_dhu}[op]


def run_bench(ops, quick: bool = False, json_path: str | None = None, plot: str | None = None,
              report: str | None = None, cases=None) -> int:
    """Time the given ops on this GPU, print one report, write the files asked for. cases:
    labels of the attention or gdn cases to run (all when None)."""
    from .benchmarks.common import environment, format_report, write_json, write_plot
    env = environment()
    sections, notes = [], []
    for op in ops:
        extra = {"cases": cases} if op in ("gdn", "attention") and cases else {}
        secs, op_notes = _runner(op)(quick, _progress(op), **extra)
        sections += secs
        notes += [n for n in op_notes if n not in notes]
    title = "flash-dma bench " + "+".join(ops) + (" (quick)" if quick else "")
    text = format_report(title, env, sections) + "".join(f"\nnote: {n}" for n in notes)
    print(text)
    if json_path:
        write_json(json_path, title, env, sections, notes)
        print(f"wrote {json_path}")
    if plot:
        if write_plot(plot, title, env, sections):
            print(f"wrote {plot}")
        else:
            print("note: --plot needs matplotlib (pip install 'flash-dma[bench]')")
    if report:
        with open(report, "w") as f:
            f.write(text + "\n")
    return 0


def bench(args) -> int:
    import torch
    if not torch.cuda.is_available():
        return _bench_without_gpu(args)
    ops = OPS if args.op == "all" else (args.op,)
    return run_bench(ops, args.quick, args.json, args.plot, args.report, parse_cases(args.cases))


def _bench_without_gpu(args) -> int:
    print("flash-dma bench: no CUDA GPU here, so nothing can be timed. Running a tiny "
          "correctness check of each op in Triton's CPU interpreter instead.")
    passed = _run_selfcheck() == 0
    outcome = "passed" if passed else "FAILED"
    note = f"no CUDA GPU: nothing was timed; the interpreter correctness check {outcome}"
    if not passed:
        print("flash-dma bench: the correctness check FAILED", file=sys.stderr)
    if args.json:
        from .benchmarks.common import environment, write_json
        write_json(args.json, "flash-dma bench (no GPU)", environment(), [], [note])
        print(f"wrote {args.json} ({note})")
    for flag in ("plot", "report"):
        if getattr(args, flag):
            print(f"note: --{flag} not written: {note}")
    return 0 if passed else 1


def tune(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("flash-dma tune: no CUDA GPU here, so launch configurations cannot be timed on this "
              "machine; run it on the GPU that will run the kernels.", file=sys.stderr)
        return 1
    from .benchmarks import tune as sweep
    from .runtime import tuning_cache
    ops = sweep.OPS if args.op == "all" else (args.op,)
    outcomes = sweep.run(ops, args.quick, _progress)
    print(f"tuning cache: {tuning_cache.cache_dir() / 'tuning-v1.json'} "
          f"(every timing in {tuning_cache.profile_log_file()})")
    print("stored:")
    for line in sweep.summary_lines(outcomes):
        print("  " + line)
    return 0 if any(o.best is not None for o in outcomes) else 1


_PEERS = (("flash_attn.cute", "FlashAttention-4 (CuTe DSL)", "flash-attn-4"),
          ("cutlass", "CuTe DSL", "nvidia-cutlass-dsl"),
          ("flash_sparse_attn", "flash-sparse-attn", "flash-sparse-attn"),
          ("flash_dmattn", "flash-dmattn (its Triton kernel also ships inside flash-sparse-attn)",
           "flash-dmattn"),
          ("fla", "flash-linear-attention", "flash-linear-attention"),
          ("flash_qla", "FlashQLA", "flash-qla"))


def _version(distribution: str, module: str) -> str | None:
    """The installed version of a package, without importing it (imports can take seconds)."""
    import importlib.metadata
    import importlib.util
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        try:
            return "installed" if importlib.util.find_spec(module) is not None else None
        except (ImportError, ValueError):
            return None


def env(args) -> int:
    import torch
    import triton

    from .runtime import config, tuning_cache
    from .runtime.hardware import device_info, interpreter_active
    print(f"flash-dma {__import__('flash_dma').__version__} | torch {torch.__version__} | "
          f"triton {triton.__version__} | CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        info = device_info(torch.device("cuda"))
        print(f"device: {info.name}, sm{info.arch}, {info.sm_count} SMs, "
              f"{info.shared_memory_per_block // 1024} KB shared memory per block, "
              f"{info.l2_bytes // 2 ** 20} MB L2")
    else:
        state = "on" if interpreter_active() else "off (set TRITON_INTERPRET=1 to run on the CPU)"
        print(f"device: no CUDA GPU; Triton's CPU interpreter {state}")
    print("backends: triton " + triton.__version__)
    for module, name, dist in _PEERS:
        version = _version(dist, module)
        print(f"  {name}: {version or 'not installed'}")
    path = tuning_cache.cache_dir()
    entries = len(tuning_cache.entries())
    print(f"tuning cache: {path} ({entries} entries); profiling log: set FLASH_DMA_PROFILE=1")
    print("choices (override with flash_dma.runtime.config.overrides):")
    for name, (default, allowed, doc) in sorted(config.declared_choices().items()):
        values = "/".join(map(str, allowed)) if allowed else "any"
        print(f"  {name} = {default!r} ({values}): {doc}")
    for op, shape in (("attention", args.attention), ("gdn", args.gdn)):
        if shape:
            print(f"{op} plan for {shape}:")
            if op == "attention":
                from .ops.dynamic_mask_attention.plan import describe as describe_attention
                lines = describe_attention(shape)
            else:
                from .ops.gated_delta_rule.plan import describe as describe_gdn
                lines = describe_gdn(shape)
            for line in lines:
                print("  " + line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-dma", description="flash-dma: trainable attention kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time the kernels beside their peers on this GPU")
    b.add_argument("op", nargs="?", default="all", choices=OPS + ("all",))
    b.add_argument("--quick", action="store_true", help="a few configurations (about a minute, plus FLA's first-call autotuning)")
    b.add_argument("--json", metavar="PATH", help="write every number with its metadata")
    b.add_argument("--plot", metavar="PATH", help="write a PNG of throughput against length")
    b.add_argument("--report", metavar="PATH", help="also write the text report to PATH")
    b.add_argument("--cases", metavar="LABELS", help="attention or gdn: some cases, by label, "
                   "comma-separated (e.g. 'B4 H16 S4096 D128,B4 H16 S4096 D128 causal' or "
                   "'B8 T4096 H32,B2 T8192 H8 K256 V256'); the peers' first calls (FLA's autotuning, "
                   "FlashQLA's TileLang compiles) take minutes per new shape")
    t = sub.add_parser("tune", help="sweep launch configurations on this GPU and store the fastest "
                       "in the tuning cache")
    t.add_argument("op", nargs="?", default="all", choices=("attention", "gdn", "all"))
    t.add_argument("--quick", action="store_true", help="a few candidates per kernel (a few minutes)")
    e = sub.add_parser("env", help="device facts, installed backends and peers, tuning cache, and "
                       "what would run for a shape")
    e.add_argument("--attention", metavar="SHAPE", help="e.g. 'B=2 S=4096 H=16 Hk=16 D=128 "
                   "bias=B,H,S,S causal'")
    e.add_argument("--gdn", metavar="SHAPE", help="e.g. 'B=1 T=32768 H=16 HV=16 K=128 V=128 gk "
                   "varlen' (gates: g unless gk is named; 'g gk' for both; N=<sequences> with varlen)")
    return parser


def parse_cases(text: str | None) -> list[str] | None:
    """'a, b' -> ['a', 'b']; None or empty -> None (every case). Commas inside brackets belong to
    the label ('B2 H16 S4096 D128 bias[B,H,S,S]')."""
    labels, part, depth = [], "", 0
    for ch in (text or "") + ",":
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"--cases: a ']' without its '[' in {text!r}")
        if ch == "," and depth == 0:
            labels.append(part.strip())
            part = ""
        else:
            part += ch
    if depth:
        raise ValueError(f"--cases: a '[' without its ']' in {text!r}")
    labels = [label for label in labels if label]
    return labels or None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench(args)
    if args.command == "env":
        return env(args)
    if args.command == "tune":
        return tune(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
