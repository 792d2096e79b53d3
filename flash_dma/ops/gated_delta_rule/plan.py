"""One frozen plan per call of the gated delta rule: the backend, the strategy of the passes and
the launch configuration of each pass, each with where it came from.

Strategies (declared choices, overridden with `runtime.config.overrides`):
  gdn_split_prepare          where T is kept for the backward, the forward writes T in prepare and
                             w, u in the recompute kernel (or the state pass forms them from T)
                             instead of one prepare kernel doing all, which spills;
  gdn_states_from_inverse    the forward's state pass forms w, u from T itself (no w, u in
                             memory) rather than reading those of the recompute kernel;
  gdn_backward_states_from_inverse   the same in the backward (the recompute writes w only);
  gdn_chunks_per_segment     the state passes cut each sequence into segments of this many chunks,
                             run side by side and joined (segments.py); None: not cut.
Launch configurations come from launch_table.choose (overridden with gdn_<pass>=GdnConfig(...)).

`plan.launch(pass)` hands a pass its configuration and, with FLASH_DMA_PROFILE=1, logs the
choice the first time each shape class meets it (runtime/profile.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime import tuning_cache
from ...runtime.config import Chosen, active_overrides, choice, declare_choice
from ...runtime.hardware import DeviceInfo, device_info
from ...runtime.profile import log_choice
from . import launch_table
from .launch_table import GdnConfig
from .layout import ChunkLayout

OP = "gated_delta_rule"
# The kernels of one backend live in ops/gated_delta_rule/<backend>/; "triton" is the one there is.
BACKENDS = ("triton",)

declare_choice("gdn_split_prepare", True, (True, False),
               "where T is kept for the backward: prepare writes T only, w and u come after it")
declare_choice("gdn_states_from_inverse", None, (True, False),
               "the forward's state pass forms w and u from T (default: launch_table's rule)")
declare_choice("gdn_backward_states_from_inverse", None, (True, False),
               "the backward's state pass forms v_new from T (default: launch_table's rule)")
# Not cut by default: when a cut pays (few sequences x heads for the SMs, long sequences) is to
# be derived from GPU sweeps (bench/sweep_gdn_segments.py); a positive int forces it.
declare_choice("gdn_chunks_per_segment", None, (),
               "chunks per segment of the state passes' sequence split (None: no split)")


@dataclass(frozen=True)
class DeltaRulePlan:
    backend: str
    info: DeviceInfo
    shape: tuple  # (name, value) pairs of the shape class, as the profiling log prints them
    per_key_gate: bool  # gk given
    inverse_precision: str  # products of the blockwise inverse: "ieee" or "tf32"
    keep_inverse: bool  # the forward keeps T and the gate cumsums; the backward recomputes from them
    split_prepare: Chosen  # bool
    states_from_inverse: Chosen  # bool, forward
    backward_states_from_inverse: Chosen  # bool
    launches: dict  # pass -> Chosen(GdnConfig); read-only by convention (the plan is shared)
    chunks_per_segment: Chosen = Chosen(None, "table")  # int or None (sequences not cut)

    def launch(self, pass_name: str) -> GdnConfig:
        chosen = self.launches[pass_name]
        log_choice(OP, pass_name, self.backend, self.info, self.shape,
                   launch_table.config_name(chosen.value), chosen.source)
        return chosen.value

    def segment_chunks(self) -> int | None:
        """Chunks per segment of the state passes, or None (not cut); logged like a launch."""
        chosen = self.chunks_per_segment
        name = "unsplit" if chosen.value is None else f"chunks_per_segment={chosen.value}"
        log_choice(OP, "segments", self.backend, self.info, self.shape, name, chosen.source)
        return chosen.value

    @property
    def prepare_pass(self) -> str:
        """The prepare kernel's table entry: with gk it only inverts and forms w, u; T alone in
        tf32 is light enough for one warp per chunk; w, u or exact products want two."""
        if self.per_key_gate:
            return "prepare_gk"
        if self.split_prepare.value and self.inverse_precision == "tf32":
            return "prepare_t"
        return "prepare"


def inverse_precision(dtype: torch.dtype) -> str:
    """Products of the blockwise inverse T = (I + A)^-1: on tf32 tensor cores for 16-bit inputs,
    whose w = T diag(beta e^B) K and u = T diag(beta) V are rounded to 8 or 11 significant bits
    anyway (as T itself is, where it is stored for the backward); errors against fp64 unchanged.
    fp32 inputs keep exact fp32 products."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _strategy(name: str, rule) -> Chosen:
    chosen = choice(name)
    if chosen.value is None:
        return Chosen(rule(), "rule")
    return chosen


_PLANS: dict = {}


def plan_call(q: torch.Tensor, v: torch.Tensor, has_g: bool, has_gk: bool, layout: ChunkLayout) -> DeltaRulePlan:
    """The plan of one chunk_gated_delta_rule call (forward and backward). Memoised on what it
    depends on, except while overrides are in force (tests and sweeps)."""
    overrides = active_overrides()
    key = (q.device, q.dtype, layout.batch, layout.seq_len, q.shape[2], v.shape[2], q.shape[3], v.shape[3],
           layout.num_seqs, layout.is_varlen, has_g, has_gk, tuning_cache.generation())
    if not overrides:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan
    plan = _build(*key[:12])
    if not overrides:
        if len(_PLANS) > 4096:  # varying lengths: bounded
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _gates(has_g: bool, has_gk: bool) -> str:
    return "+".join(name for name, on in (("g", has_g), ("gk", has_gk)) if on) or "none"


def _chunks_per_segment() -> Chosen:
    chosen = choice("gdn_chunks_per_segment")
    value = chosen.value
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"gdn_chunks_per_segment must be None or a positive int, got {value!r}")
    return chosen


def _build(device, dtype, B, T, H, HV, K, V, num_seqs, varlen, has_g, has_gk) -> DeltaRulePlan:
    pairs = num_seqs * HV
    keep = launch_table.keeps_inverse(K, V, has_gk)
    split = choice("gdn_split_prepare")
    if not keep:
        split = Chosen(False, "rule")
    forward_from_t = _strategy("gdn_states_from_inverse",
                               lambda: launch_table.states_from_inverse(K, pairs, device, backward=False))
    backward_from_t = _strategy("gdn_backward_states_from_inverse",
                                lambda: launch_table.states_from_inverse(K, pairs, device, backward=True))
    passes = ["prepare", "prepare_t", "recompute_wu", "fwd_h", "fwd_h_from_t", "intra", "bwd_dhu",
              "bwd_dqkw", "bwd_wy"]
    if has_gk:
        passes += ["chunk_cumsum", "gated_pairs", "prepare_gk", "pair_grad", "gate_grad"]
    launches = {name: launch_table.choose(name, K, V, device, pairs) for name in passes}
    shape = (("B", B), ("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("varlen", varlen),
             ("gates", _gates(has_g, has_gk)))
    return DeltaRulePlan("triton", device_info(device), shape, has_gk, inverse_precision(dtype), keep, split,
                         forward_from_t, backward_from_t, launches, _chunks_per_segment())


def plan_bwd_dhu(device: torch.device, B: int, T: int, H: int, HV: int, K: int, V: int,
                 layout: ChunkLayout, has_g: bool, has_gk: bool) -> DeltaRulePlan:
    """The plan of a public chunk_gated_delta_rule_bwd_dhu call: its one pass."""
    pairs = layout.num_seqs * HV
    off = Chosen(False, "rule")
    shape = (("B", B), ("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("varlen", layout.is_varlen),
             ("gates", _gates(has_g, has_gk)))
    return DeltaRulePlan("triton", device_info(device), shape, has_gk, "ieee", False, off, off, off,
                         {"bwd_dhu": launch_table.choose("bwd_dhu", K, V, device, pairs)},
                         _chunks_per_segment())
