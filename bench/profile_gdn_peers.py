"""Where the time of one gated-delta-rule call goes, ours beside FlashQLA (and FLA's Triton path
with --fla): for each case of `flash-dma bench gdn`'s op plan, the CUDA kernels of one forward
and of one forward + backward under torch.profiler, summed per kernel name (us, calls), in
first-launch order, then each side's kernel total. bf16, the op report's inputs.

    python bench/profile_gdn_peers.py [--cases "B8 T4096 H32,B1 T32768 H16"] [--fla] [--out DIR]

KDA cases (per-key gate) run our op with gk and FLA's chunk_kda; FlashQLA is left out where it
has no path (K = V = 256, KDA).

Writes the tables to DIR/gdn-kernels-<device>-<date>.txt as well as to stdout.
"""
import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flash_dma.benchmarks import gdn  # noqa: E402
from flash_dma.benchmarks.common import write_lines  # noqa: E402


def kernel_table(fn):
    """[(name, total us, calls)] of the CUDA kernels one call of fn launches, first launch first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                    key=lambda e: e.time_range.start)
    table: dict[str, list] = {}
    for e in events:
        entry = table.setdefault(e.name, [0.0, 0])
        entry[0] += e.device_time_total
        entry[1] += 1
    return [(name, us, calls) for name, (us, calls) in table.items()]


def short(name: str, width: int = 70) -> str:
    name = name.split("(")[0]
    return name if len(name) <= width else name[:width - 3] + "..."


def calls_of(fn, case: gdn.OpCase, x: dict):
    """(forward, forward + backward) closures of fn on the case's inputs."""
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    packed = {} if x.get("cu_seqlens") is None else {"cu_seqlens": x["cu_seqlens"]}

    def fwd():
        return fn(*leaves, initial_state=None, output_final_state=False, **packed)

    def fwd_bwd():
        o = fwd()[0]
        return torch.autograd.grad(o, leaves, x["do"])
    return fwd, fwd_bwd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="B8 T4096 H32,B1 T32768 H16")
    parser.add_argument("--fla", action="store_true", help="FLA's Triton path too")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_gdn_peers.py: no CUDA GPU here")
    notes: list[str] = []
    ours = gdn.load_ours("chunk_gated_delta_rule", notes)
    # who -> (op, op for the per-key gate cases: KDA, as FLA's chunk_kda is called)
    sides = {"ours": (ours, None if ours is None else gdn.with_per_key_gate(ours))}
    qla = gdn.load_flash_qla(notes)
    if qla is not None:
        sides["FlashQLA"] = (qla.op, None)
    if args.fla:
        fla = gdn.load_fla(notes)
        if fla is not None:
            sides["FLA"] = (fla.op, getattr(fla, "kda", None))
    lines = [f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"] + notes
    for case in gdn.op_plan(False, [c.strip() for c in args.cases.split(",")]):
        x = gdn.make_op_inputs(case, "cuda", seed=case.T + case.H + case.B)
        for who, (op, kda) in sides.items():
            fn = kda if case.per_key_gate else op
            if fn is None or (who == "FlashQLA" and gdn.flash_qla_no_path(case, qla)):
                continue
            fwd, fwd_bwd = calls_of(fn, case, x)
            for what, call in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                try:
                    table = kernel_table(call)
                except Exception as exc:  # noqa: BLE001 - one side failing is a line of the report
                    lines.append(f"== {case.label} {who} {what}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                total = sum(us for _, us, _ in table)
                lines.append(f"== {case.label} {who} {what}: {total:.0f} us of kernels")
                lines += [f"  {us:8.1f} us {calls:3d}x  {short(name)}" for name, us, calls in table if us >= 2.0]
            print("\n".join(lines[-40:]), flush=True)
        del x
        torch.cuda.empty_cache()
    write_lines(args.out, "gdn-kernels", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
