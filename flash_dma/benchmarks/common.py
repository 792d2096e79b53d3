"""Timing, correctness columns and report formatting shared by the benchmarks.

A report is a list of sections; a section is a list of rows; a row holds one configuration's
times (ours and one peer's), its work (FLOPs or bytes) and the difference between the outputs.
Everything is plain data, so the same rows print as a table and serialise to JSON.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch


@dataclass
class Row:
    config: str
    peer: str
    peer_ms: float | None  # None: the peer is missing or refused this configuration
    ours_ms: float | None
    max_abs: float | None = None
    max_rel: float | None = None
    flops: float | None = None  # work of one call, for TFLOP/s
    bytes: float | None = None  # bytes moved by one call, for GB/s
    note: str = ""
    seqlen: int | None = None  # for the throughput-against-length plot
    direction: str = ""  # "fwd" / "bwd"

    @property
    def speedup(self) -> float | None:
        if self.peer_ms and self.ours_ms:
            return self.peer_ms / self.ours_ms
        return None


@dataclass
class Section:
    title: str
    rows: list[Row] = field(default_factory=list)

    def geomean_speedup(self, peer: str | None = None) -> float | None:
        values = [r.speedup for r in self.rows if r.speedup and (peer is None or r.peer == peer)]
        return geometric_mean(values) if values else None


def geometric_mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("geometric mean of no values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def environment() -> dict:
    """The header of every report: device, versions and date."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, sm_count=props.multi_processor_count,
                   cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}")
    else:
        env.update(device="cpu (no CUDA GPU)", sm_count=None, cuda=None, capability=None)
    return env


def time_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn on the GPU (triton.testing.do_bench: events, L2 flushed)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """torch.compile'd flex_attention, shared by the reports. Every case is a new specialisation;
    past Dynamo's default limit (8) flex_attention would silently fall back to its slow eager
    path and the comparison would be wrong, so the limits are raised first."""
    import torch._dynamo as dynamo  # (not "import torch._dynamo": that would make torch local)
    from torch.nn.attention.flex_attention import flex_attention
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(dynamo.config, knob):
            setattr(dynamo.config, knob, max(getattr(dynamo.config, knob), 256))
    return torch.compile(flex_attention, dynamic=False)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |ours - ref|, max |ours - ref| / max |ref|) in fp32; NaN anywhere reads as inf."""
    a, b = ours.float(), ref.float()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.inf, math.inf
    diff = (a - b).abs().max().item()
    scale = b.abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def _fmt_ms(ms: float | None) -> str:
    return f"{ms:8.3f}" if ms is not None else "     n/a"


def _rate(row: Row, ms: float | None) -> str:
    if ms is None:
        return ""
    if row.flops:
        return f"{row.flops / ms / 1e9:6.0f} TF/s"
    if row.bytes:
        return f"{row.bytes / ms / 1e6:6.0f} GB/s"
    return ""


def format_report(title: str, env: dict, sections: Sequence[Section]) -> str:
    lines = [f"== {title} ==",
             f"device: {env.get('device')} ({env.get('sm_count')} SMs, sm {env.get('capability')}) | "
             f"torch {env.get('torch')} | triton {env.get('triton')} | CUDA {env.get('cuda')} | "
             f"{env.get('date')}"]
    for sec in sections:
        width = max([len(r.config) for r in sec.rows] + [30])
        lines.append("")
        lines.append(f"-- {sec.title} --")
        lines.append(f"{'Config':<{width}} | {'max_abs':>8} {'max_rel':>8} | {'peer':<16} "
                     f"{'peer(ms)':>8} {'ours(ms)':>8} {'Speedup':>7} | {'peer rate':>11} {'our rate':>11}")
        for r in sec.rows:
            acc = (f"{r.max_abs:8.1e} {r.max_rel:8.1e}" if r.max_abs is not None else f"{'':8} {'':8}")
            speed = f"{r.speedup:6.2f}x" if r.speedup else "    n/a"
            line = (f"{r.config:<{width}} | {acc} | {r.peer:<16} {_fmt_ms(r.peer_ms)} "
                    f"{_fmt_ms(r.ours_ms)} {speed} | {_rate(r, r.peer_ms):>11} {_rate(r, r.ours_ms):>11}")
            if r.note:
                line += f"  ({r.note})"
            lines.append(line)
        peers = sorted({r.peer for r in sec.rows if r.speedup})
        for p in peers:
            lines.append(f"{'geometric mean vs ' + p:<{width}} | {'':17} | {'':16} {'':8} {'':8} "
                         f"{sec.geomean_speedup(p):6.2f}x |")
    return "\n".join(lines)


def write_lines(folder: str, stem: str, lines: Sequence[str]) -> str:
    """A bench script's text report as folder/<stem>-<device>-<date>.txt; -> its path (printed)."""
    import os
    env = environment()
    os.makedirs(folder, exist_ok=True)
    device = str(env.get("device") or "cpu").split(" (")[0].replace(" ", "-")
    path = os.path.join(folder, f"{stem}-{device}-{datetime.date.today():%Y%m%d}.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path


def write_json(path: str, title: str, env: dict, sections: Sequence[Section],
               notes: Sequence[str] = ()) -> None:
    data = {"title": title, "environment": env, "notes": list(notes), "sections": [
        {"title": s.title, "rows": [{**asdict(r), "speedup": r.speedup} for r in s.rows],
         "geomean_speedup": {p: s.geomean_speedup(p) for p in sorted({r.peer for r in s.rows if r.speedup})}}
        for s in sections]}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def write_plot(path: str, title: str, env: dict, sections: Sequence[Section]) -> bool:
    """PNG of throughput against sequence length, ours beside each peer; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # only sections that sweep the length: elsewhere one length holds many unrelated configurations
    swept = [s for s in sections if len({r.seqlen for r in s.rows if r.seqlen and r.flops}) > 1]
    rows = [r for s in swept for r in s.rows if r.seqlen and r.flops and r.direction]
    directions = sorted({r.direction for r in rows})
    fig, axes = plt.subplots(1, max(len(directions), 1), figsize=(6 * max(len(directions), 1), 4.5),
                             squeeze=False)
    for ax, direction in zip(axes[0], directions):
        series: dict[str, dict[int, float]] = {}
        for r in rows:
            if r.direction != direction:
                continue
            if r.ours_ms:
                series.setdefault("flash-dma", {})[r.seqlen] = r.flops / r.ours_ms / 1e9
            if r.peer_ms:
                series.setdefault(r.peer, {})[r.seqlen] = r.flops / r.peer_ms / 1e9
        for name, points in sorted(series.items()):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=name,
                    linewidth=2.5 if name == "flash-dma" else 1.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{direction}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{', '.join(s.title for s in swept)}\n{env.get('device')}, {env.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def load_json(path: str) -> tuple[str, dict, list[Section], list[str]]:
    """Read back what write_json wrote (to re-plot or compare saved runs)."""
    with open(path) as f:
        data = json.load(f)
    fields = set(Row.__dataclass_fields__)
    sections = [Section(s["title"], [Row(**{k: v for k, v in r.items() if k in fields}) for r in s["rows"]])
                for s in data["sections"]]
    return data["title"], data["environment"], sections, data.get("notes", [])
