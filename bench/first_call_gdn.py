"""First-call time of the chunked gated delta rule on a new shape, as a fresh process pays it.

    python bench/first_call_gdn.py [--fla] [--B 2 --T 4096 --H 16 --K 128] [--gk] [--keep-tuning-cache]
    python bench/first_call_gdn.py --targets [--serial-too]   # issue 3's five shapes and KDA

Each implementation runs in a fresh Python process whose TRITON_CACHE_DIR is a new, empty
temporary folder (and, unless --keep-tuning-cache, so is flash-dma's tuning cache,
FLASH_DMA_CACHE_DIR), so every kernel compiles (and autotunes) from scratch. The child times
the import, then its first forward and first backward (synchronised, seconds), then one more
forward+backward for comparison. --fla does the same for flash-linear-attention 0.6.0, whose
first call autotunes for about 100 s (its gated-backward refusal on Triton < 3.7.1 lifted, as
in the benchmark). --targets runs the whole op's five target shapes and a per-key-gate (KDA)
shape; --serial-too also runs each with FLASH_DMA_COMPILE_AHEAD=0 (kernels compiled one after
another as the launches reach them, instead of in parallel ahead of the first call). The lines
printed are also written to bench/results/first-call-gdn-<GPU>-<date>.txt.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


TARGETS = ((4, 4096, 16, 128, False), (1, 8192, 16, 128, False), (1, 32768, 16, 128, False),
           (8, 4096, 32, 128, False), (2, 8192, 8, 256, False), (2, 4096, 16, 128, True))


def child(impl: str, B: int, T: int, H: int, K: int, per_key_gate: bool) -> dict:
    t0 = time.perf_counter()
    import torch
    sys.path.insert(0, ROOT)
    from flash_dma.benchmarks import gdn
    notes: list[str] = []
    if impl == "fla":
        fla = gdn.load_fla(notes)
        if fla is None:
            return {"impl": impl, "error": "; ".join(notes)}
        fn = fla.op
    else:
        fn = gdn.load_ours("chunk_gated_delta_rule", notes)
        if fn is None:
            return {"impl": impl, "error": "; ".join(notes)}
    torch.cuda.init()
    import_s = time.perf_counter() - t0
    case = gdn.OpCase(B, T, H, K, K, per_key_gate=per_key_gate)
    x = gdn.make_op_inputs(case, "cuda", seed=1)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    torch.cuda.synchronize()

    def call():
        if per_key_gate:
            return fn(leaves[0], leaves[1], leaves[2], None, leaves[4], gk=leaves[3])
        return fn(*leaves)

    def fwd_bwd():
        a = time.perf_counter()
        o, _ = call()
        torch.cuda.synchronize()
        b = time.perf_counter()
        torch.autograd.grad(o, leaves, x["do"])
        torch.cuda.synchronize()
        return b - a, time.perf_counter() - b

    first_fwd, first_bwd = fwd_bwd()
    second_fwd, second_bwd = fwd_bwd()
    return {"impl": impl, "shape": case.label, "import_s": import_s, "first_fwd_s": first_fwd,
            "first_bwd_s": first_bwd, "first_total_s": first_fwd + first_bwd,
            "second_fwd_bwd_ms": (second_fwd + second_bwd) * 1e3, "notes": notes}


def run_fresh(impl: str, args, shape: tuple, compile_ahead: bool = True) -> dict:
    B, T, H, K, per_key_gate = shape
    with tempfile.TemporaryDirectory(prefix="first-call-") as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   FLASH_DMA_COMPILE_AHEAD="1" if compile_ahead else "0")
        if not args.keep_tuning_cache:
            env["FLASH_DMA_CACHE_DIR"] = os.path.join(tmp, "flash_dma")
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--B", str(B),
               "--T", str(T), "--H", str(H), "--K", str(K)] + (["--gk"] if per_key_gate else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"impl": impl, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    result = json.loads(lines[-1])
    result["process_wall_s"] = wall
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fla", action="store_true", help="also FLA's first call (about 100 s)")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128, help="K = V")
    p.add_argument("--gk", action="store_true", help="per-key gate (Kimi Delta Attention) instead of g")
    p.add_argument("--targets", action="store_true", help="the five target shapes and a KDA shape")
    p.add_argument("--serial-too", action="store_true",
                   help="also time ours with compile-ahead off (FLASH_DMA_COMPILE_AHEAD=0)")
    p.add_argument("--keep-tuning-cache", action="store_true",
                   help="use the existing flash-dma tuning cache instead of an empty one")
    p.add_argument("--child", choices=("ours", "fla"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.B, args.T, args.H, args.K, args.gk)))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("first_call_gdn.py: no CUDA GPU here; nothing to time")
        return 1
    from flash_dma.benchmarks.common import environment
    env = environment()
    lines = [f"First call on a new shape, empty Triton cache, fwd+bwd: {env['device']}, torch "
             f"{env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}, {env['date']}"]
    print(lines[0], flush=True)
    shapes = TARGETS if args.targets else ((args.B, args.T, args.H, args.K, args.gk),)
    runs = [("ours", True)] + ([("ours", False)] if args.serial_too else []) + ([("fla", True)] if args.fla else [])
    failed = 0
    for shape in shapes:
        for impl, ahead in runs:
            r = run_fresh(impl, args, shape, ahead)
            name = "FLA" if impl == "fla" else "flash-dma" + ("" if ahead else " (compile-ahead off)")
            if "error" in r:
                failed += 1
                line = f"{name}: FAILED: {r['error']}"
            else:
                line = (f"{name} {r['shape']}: first fwd {r['first_fwd_s']:.1f} s, "
                        f"first bwd {r['first_bwd_s']:.1f} s, first fwd+bwd {r['first_total_s']:.1f} s; "
                        f"import {r['import_s']:.1f} s; process {r['process_wall_s']:.1f} s; second "
                        f"fwd+bwd {r['second_fwd_bwd_ms']:.1f} ms")
                line += "".join(f"\n  note: {n}" for n in r.get("notes", []))
            print(line, flush=True)
            lines.append(line)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    gpu = env["device"].replace("NVIDIA ", "").replace(" ", "-")
    path = os.path.join(out, f"first-call-gdn-{gpu}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
