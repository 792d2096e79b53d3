"""The launch sweep behind `flash-dma tune [attention|gdn] [--quick]` (and bench/tune_attention.py).

Each op lists its sweep cases beside its launch table (ops/<op>/tune.py): a kernel pass, the
problem bucket its winner is stored under, the candidate configurations and a function timing one
candidate on a representative shape. `sweep_case` times every candidate through
runtime.config.tune, which stores the fastest in the persistent tuning cache (runtime/
tuning_cache.py) and every timing in the profiling log beside it; a candidate that fails to
compile, launch or compute the right output is skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime import config

OPS = ("attention", "gdn")


@dataclass
class TuneCase:
    """One kernel pass to sweep at one problem bucket."""
    kernel: str  # the launch table's name (attn_fwd, ...; the delta rule: gdn_<pass>)
    device: torch.device
    head_dim: int
    dtype: torch.dtype
    variant: str
    candidates: list
    time_config: Callable[[Any], float]  # milliseconds of the op with this candidate in force
    cache_key: str | None = None  # where the op's launch table looks the winner up (None: config.cache_key)
    label: str = ""


@dataclass
class TuneOutcome:
    case: TuneCase
    best: Any
    timings_ms: dict = field(default_factory=dict)  # config name -> ms
    errors: dict = field(default_factory=dict)  # config name -> why it was skipped
    key: str = ""


def _name(cfg) -> str:
    from ..ops.gated_delta_rule.launch_table import GdnConfig, config_name as gdn_name
    return gdn_name(cfg) if isinstance(cfg, GdnConfig) else config.config_name(cfg)


def sweep_case(case: TuneCase, progress: Callable[[int], Any] | None = None) -> TuneOutcome:
    """Time every candidate of a case, store the fastest in the tuning cache. progress: makes a
    bar from a total (tqdm-like: update(n), close())."""
    outcome = TuneOutcome(case, None)
    bar = progress(len(case.candidates)) if progress else None

    def timed(cfg):
        try:
            ms = case.time_config(cfg)
        except Exception as exc:  # recorded here, skipped by config.tune
            outcome.errors[_name(cfg)] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            if bar is not None:
                bar.update(1)
        outcome.timings_ms[_name(cfg)] = ms
        return ms

    try:
        outcome.best = config.tune(case.kernel, case.device, case.head_dim, case.dtype, case.variant,
                                   timed, case.candidates, key=case.cache_key)
    finally:
        if bar is not None:
            bar.close()
    info = config.device_info(case.device)
    outcome.key = case.cache_key or config.cache_key(case.kernel, info, config.head_dim_block(case.head_dim),
                                                     case.dtype, case.variant)
    return outcome


def cases(op: str, quick: bool, device: torch.device) -> Iterable[TuneCase]:
    """The sweep cases of an op (a generator: each allocates its inputs when reached)."""
    if op == "attention":
        from ..ops.dynamic_mask_attention import tune as attention_tune
        return attention_tune.cases(device, quick)
    if op == "gdn":
        from ..ops.gated_delta_rule import tune as gdn_tune
        return gdn_tune.cases(device, quick)
    raise ValueError(f"op: expected one of {OPS}, got {op!r}")


def run(ops: Iterable[str], quick: bool, progress_factory: Callable[[str], Callable[[int], Any]] | None = None,
        device: torch.device | None = None) -> list[TuneOutcome]:
    """Sweep every case of the given ops on this GPU; a case where no candidate ran is reported
    (its error) and the sweep goes on."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    outcomes = []
    for op in ops:
        for case in cases(op, quick, device):
            progress = progress_factory(case.label or case.kernel) if progress_factory else None
            try:
                outcome = sweep_case(case, progress)
            except RuntimeError as exc:  # no candidate ran
                outcome = TuneOutcome(case, None, errors={"all": str(exc)})
            # the timing closure holds the shape's inputs and reference results: let them go
            outcome.case = dataclasses.replace(case, time_config=None)
            outcomes.append(outcome)
            del case
    return outcomes


def summary_lines(outcomes: list[TuneOutcome]) -> list[str]:
    """One line per case: what was stored under which key (or why nothing was)."""
    lines = []
    for o in outcomes:
        if o.best is None:
            lines.append(f"{o.case.label or o.case.kernel}: nothing stored ({'; '.join(o.errors.values())})")
            continue
        ms = o.timings_ms.get(_name(o.best))
        skipped = f", {len(o.errors)} skipped" if o.errors else ""
        lines.append(f"{o.case.label or o.case.kernel}: {_name(o.best)} {ms:.3f} ms "
                     f"({len(o.timings_ms)} timed{skipped}) -> {o.key}")
    return lines
