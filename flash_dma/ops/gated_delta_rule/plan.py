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
                             run side by side and joined (segments.py); None: not cut;
  gdn_decay_reach            a cut's segments whose gates provably decay earlier state below
                             fp32's range skip their transition and start their local pass late
                             (segments.py: "Decayed segments"; scalar gate, no gk);
  gdn_fused_forward          the forward's state pass and output as one SM90 kernel: "ws" with
                             warp roles (gluon/forward_ws.py), 64 or 128 the V tile of the
                             one-role kernel (gluon/forward_fused.py); None: the Triton state
                             pass and output kernels;
  gdn_fused_forward_gk       with gk (and no g): the forward's state pass and output as one SM90
                             warp-role kernel (gluon/forward_ws_gk.py) over the gated-pair and
                             prepare passes' outputs, where the sequences are not cut;
  gdn_longest_first          packed sequences (varlen) run by the fused kernels longest first
                             (programs start in grid order: the longest chains first, the short
                             ones fill the tail) rather than in the order given;
  gdn_fused_backward         the backward's chunk-parallel passes (dq, dk, dw, then back through
                             the WY form) as one SM90 kernel (gluon/backward_chunk.py) instead of
                             the Triton bwd_dqkw and bwd_wy passes;
  gdn_dhu_local_dv           bwd_dhu forms the intra-chunk dv (P^T do) itself instead of reading
                             it from the local_dv pass (scalar gate or none);
  gdn_dhu_w_from_t           bwd_dhu applies w^T through T and the keys instead of reading w, so
                             the backward does not recompute w (scalar gate or none);
  gdn_dhu_warp_roles         bwd_dhu as one SM90 kernel with warp roles (gluon/bwd_dhu_ws.py) that
                             forms the intra-chunk dv and w itself off its chain: no local_dv pass
                             and no recompute of w;
  gdn_backward_warp_roles    the whole backward after the state pass as one SM90 kernel with warp
                             roles (gluon/backward_ws.py): bwd_dhu, its intra-chunk dv and the
                             chunk gradients fused, one program per sequence x value head.
Launch configurations come from launch_table.choose (overridden with gdn_<pass>=GdnConfig(...)).

`plan.launch(pass)` hands a pass its configuration and, with FLASH_DMA_PROFILE=1, logs the
choice the first time each shape class meets it (runtime/profile.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from ...runtime import tuning_cache
from ...runtime.config import Chosen, active_overrides, choice, declare_choice
from ...runtime.hardware import DeviceInfo, device_info
from ...runtime.profile import log_choice
from . import launch_table
from .launch_table import GdnConfig
from .layout import CHUNK, ChunkLayout, chunk_layout, longest_first
from .segments import SegmentLayout, join_segments, segment_bound

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
declare_choice("gdn_fused_forward", None, (0, 64, 128, "ws"),
               "the forward's state pass and output in one Hopper kernel: 'ws' with warp roles, 64 or 128 "
               "the V tile of the one-role kernel (0: the Triton passes; default: launch_table's rule)")
declare_choice("gdn_fused_forward_gk", None, (True, False),
               "with gk: the forward's state pass and output in one Hopper warp-role kernel (default: launch_table's "
               "rule)")
declare_choice("gdn_longest_first", None, (True, False),
               "packed sequences run by the fused kernels longest first (default: launch_table's rule)")
declare_choice("gdn_fused_backward", None, (True, False),
               "the backward's dqkw and WY passes as one Hopper kernel (default: launch_table's rule)")
declare_choice("gdn_dhu_local_dv", None, (True, False),
               "bwd_dhu forms the intra-chunk dv itself, no local_dv pass (default: launch_table's rule)")
declare_choice("gdn_dhu_w_from_t", None, (True, False),
               "bwd_dhu applies w^T through T, no recompute of w (default: launch_table's rule)")
declare_choice("gdn_dhu_warp_roles", None, (True, False),
               "bwd_dhu with warp roles on Hopper, forming the intra-chunk dv and w itself (default: "
               "launch_table's rule)")
declare_choice("gdn_backward_warp_roles", None, (True, False),
               "the backward after the state pass as one Hopper kernel with warp roles (default: launch_table's "
               "rule)")
declare_choice("gdn_decay_reach", None, (True, False),
               "a cut's decayed segments skip their transition and start their local pass where earlier state no "
               "longer reaches their end (default: on wherever it applies)")
declare_choice("gdn_chunks_per_segment", None, (),
               "chunks per segment of the state passes' sequence split (0: not cut; default: the rule)")


@dataclass(frozen=True)
class DeltaRulePlan:
    backend: str
    info: DeviceInfo
    shape: tuple  # (name, value) pairs of the shape class, as the profiling log prints them
    per_key_gate: bool  # gk given
    inverse_precision: str  # products of the blockwise inverse: "ieee" or "tf32"
    keep_inverse: bool  # the forward keeps T and the gate cumsums; the backward recomputes from them
    keep_gated_pairs: bool  # with gk: the forward keeps T, the gated query-key products and the gate cumsums
    split_prepare: Chosen  # bool
    states_from_inverse: Chosen  # bool, forward
    backward_states_from_inverse: Chosen  # bool
    launches: dict  # pass -> Chosen(GdnConfig); read-only by convention (the plan is shared)
    chunks_per_segment: Chosen = Chosen(None, "table")  # int or None (sequences not cut)
    dhu_chunks_per_segment: Chosen = Chosen(None, "table")  # the same for bwd_dhu
    # Where the segments' join gets the states entering each sequence (forward) and the state
    # gradients leaving it (backward, reverse): None joins within the call (segments.join_segments);
    # context parallelism (distributed/gated_delta_rule.py) joins across ranks. Same signature as
    # join_segments without `reverse`.
    forward_join: Callable | None = None
    backward_join: Callable | None = None
    fused_forward: Chosen = Chosen(None, "table")  # "ws", 64 or 128 (the fused forward's form), or None
    fused_forward_gk: Chosen = Chosen(False, "table")  # bool: gluon/forward_ws_gk.py (gk without g)
    fused_backward: Chosen = Chosen(False, "table")  # bool: gluon/backward_chunk.py for bwd_dqkw + bwd_wy
    longest_first: Chosen = Chosen(False, "table")  # bool: the fused kernels take varlen sequences longest first
    dhu_local_dv: Chosen = Chosen(False, "table")  # bool: bwd_dhu forms P^T do (no local_dv pass)
    dhu_w_from_t: Chosen = Chosen(False, "table")  # bool: bwd_dhu reads T, not w (no recompute of w)
    dhu_warp_roles: Chosen = Chosen(False, "table")  # bool: gluon/bwd_dhu_ws.py (forms dv_local and w itself)
    backward_warp_roles: Chosen = Chosen(False, "table")  # bool: gluon/backward_ws.py (bwd_dhu + chunk backward)
    decay_reach: Chosen = Chosen(False, "table")  # bool: the forward cut's decayed segments (segments.py)

    @property
    def keeps_t(self) -> bool:
        """Whether the forward keeps T for the backward (with the scalar gate's cumsums, or with
        gk the gated pair products and the gate cumsums)."""
        return self.keep_inverse or self.keep_gated_pairs

    def fused_forward_form(self) -> int | str | None:
        """The fused forward's form ("ws": warp roles; 64, 128: the one-role kernel's V tile),
        or None (the Triton passes); logged like a launch."""
        form = self.fused_forward.value
        name = "off" if not form else ("warp_roles block_v=64" if form == "ws" else f"one_role block_v={form}")
        log_choice(OP, "fused_forward", "gluon" if form else self.backend, self.info, self.shape, name,
                   self.fused_forward.source)
        return form

    def fused_forward_gk_on(self) -> bool:
        """Whether the forward with gk runs its state pass and output as the warp-role Gluon kernel;
        logged like a launch."""
        on = bool(self.fused_forward_gk.value)
        log_choice(OP, "fused_forward_gk", "gluon" if on else self.backend, self.info, self.shape,
                   "warp_roles block_v=64" if on else "off", self.fused_forward_gk.source)
        return on

    def sequence_order(self, layout: ChunkLayout) -> torch.Tensor | None:
        """The order the fused kernels run packed sequences in (layout.longest_first), or None
        (as given: equal lengths, or the choice off); logged like a launch."""
        if not layout.is_varlen:
            return None
        on = bool(self.longest_first.value)
        log_choice(OP, "sequence_order", "gluon", self.info, self.shape, "longest_first" if on else "as_given",
                   self.longest_first.source)
        return longest_first(layout.cu_seqlens) if on else None

    def fused_backward_on(self) -> bool:
        """Whether the backward's dqkw and WY passes run as the one Gluon kernel; logged like a
        launch."""
        on = bool(self.fused_backward.value)
        log_choice(OP, "fused_backward", "gluon" if on else self.backend, self.info, self.shape,
                   "one_kernel warps=8" if on else "off", self.fused_backward.source)
        return on

    def dhu_warp_roles_on(self) -> bool:
        """Whether bwd_dhu runs as the warp-role Gluon kernel that forms the intra-chunk dv and w
        itself (no local_dv pass, no recompute of w); logged like a launch."""
        on = bool(self.dhu_warp_roles.value)
        log_choice(OP, "bwd_dhu.warp_roles", "gluon" if on else self.backend, self.info, self.shape,
                   "warp_roles block_v=64" if on else "off", self.dhu_warp_roles.source)
        return on

    def backward_warp_roles_on(self) -> bool:
        """Whether the backward after the state pass runs as the one warp-role Gluon kernel
        (bwd_dhu, the intra-chunk dv and the chunk gradients); logged like a launch."""
        on = bool(self.backward_warp_roles.value)
        log_choice(OP, "backward.warp_roles", "gluon" if on else self.backend, self.info, self.shape,
                   "warp_roles warps=12" if on else "off", self.backward_warp_roles.source)
        return on

    def decay_reach_on(self) -> bool:
        """Whether the forward's cut drops the transitions of segments that decay earlier state
        below fp32's range (prepare writes each chunk's bound); logged like a launch."""
        on = bool(self.decay_reach.value)
        log_choice(OP, "fwd_h.decay_reach", self.backend, self.info, self.shape, "on" if on else "off",
                   self.decay_reach.source)
        return on

    def dhu_local_dv_on(self) -> bool:
        """Whether bwd_dhu forms the intra-chunk dv itself (no local_dv pass); logged like a
        launch."""
        on = bool(self.dhu_local_dv.value)
        log_choice(OP, "bwd_dhu.local_dv", self.backend, self.info, self.shape, "folded" if on else "own_pass",
                   self.dhu_local_dv.source)
        return on

    def dhu_w_from_t_on(self) -> bool:
        """Whether bwd_dhu applies w^T through T (the backward then recomputes no w); logged
        like a launch."""
        on = bool(self.dhu_w_from_t.value)
        log_choice(OP, "bwd_dhu.w", self.backend, self.info, self.shape, "from_T" if on else "read",
                   self.dhu_w_from_t.source)
        return on

    def launch(self, pass_name: str) -> GdnConfig:
        chosen = self.launches[pass_name]
        log_choice(OP, pass_name, self.backend, self.info, self.shape,
                   launch_table.config_name(chosen.value), chosen.source)
        return chosen.value

    def segment_chunks(self, pass_name: str = "fwd_h") -> int | None:
        """Chunks per segment of a state pass ("fwd_h": the forward's and the backward's
        recomputation; "bwd_dhu"), or None (not cut); logged like a launch."""
        chosen = self.dhu_chunks_per_segment if pass_name == "bwd_dhu" else self.chunks_per_segment
        name = "unsplit" if chosen.value is None else f"chunks_per_segment={chosen.value}"
        log_choice(OP, f"{pass_name}.segments", self.backend, self.info, self.shape, name, chosen.source)
        return chosen.value

    def join(self, transition: torch.Tensor, local: torch.Tensor, seg: SegmentLayout,
             initial: torch.Tensor | None, reverse: bool = False, transposed: bool = False):
        """The segments' join of a state pass (segments.py): (starts, final) of the forward's
        states, or with reverse (ends, dh0) of bwd_dhu's state gradients; transposed: the
        transitions are applied as their transposes (bwd_dhu over the forward's)."""
        hook = self.backward_join if reverse else self.forward_join
        if hook is None:
            return join_segments(transition, local, seg, initial, reverse=reverse, transposed=transposed)
        return hook(transition, local, seg, initial, transposed=transposed)

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


def _memoised(key: tuple, build: Callable[[], DeltaRulePlan]) -> DeltaRulePlan:
    """The plan for `key`, built once: a plan depends only on what its key holds, except while
    overrides are in force (tests and sweeps), when it is built every time."""
    if active_overrides():
        return build()
    plan = _PLANS.get(key)
    if plan is None:
        plan = build()
        if len(_PLANS) > 4096:  # varying lengths: bounded
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def plan_call(q: torch.Tensor, v: torch.Tensor, has_g: bool, has_gk: bool, layout: ChunkLayout) -> DeltaRulePlan:
    """The plan of one chunk_gated_delta_rule call (forward and backward), memoised."""
    return plan_for_sizes(q.device, q.dtype, layout.batch, layout.seq_len, q.shape[2], v.shape[2], q.shape[3],
                          v.shape[3], layout.num_seqs, layout.is_varlen, has_g, has_gk)


def plan_for_sizes(device: torch.device, dtype: torch.dtype, batch: int, seq_len: int, H: int, HV: int, K: int,
                   V: int, num_seqs: int, varlen: bool, has_g: bool, has_gk: bool) -> DeltaRulePlan:
    """plan_call's plan from the sizes alone (a custom op's fake function has sizes, not
    cu_seqlens' values)."""
    key = (device, dtype, batch, seq_len, H, HV, K, V, num_seqs, varlen, has_g, has_gk, tuning_cache.generation())
    return _memoised(key, lambda: _build(*key[:12]))


def plan_context_parallel(q: torch.Tensor, v: torch.Tensor, has_g: bool, has_gk: bool, layout: ChunkLayout,
                          forward_join: Callable, backward_join: Callable) -> DeltaRulePlan:
    """The plan of one rank's call under context parallelism: every state pass cut into segments
    (the join is where the ranks meet), the joins given. Segments of launch_table.SEGMENT_CHUNKS
    chunks unless gdn_chunks_per_segment says otherwise (0: one segment per sequence)."""
    key = ("context parallel", q.device, q.dtype, layout.batch, layout.seq_len, q.shape[2], v.shape[2],
           q.shape[3], v.shape[3], layout.num_seqs, layout.is_varlen, has_g, has_gk, tuning_cache.generation())

    def build():
        chosen = _chunks_per_segment()
        if chosen.value is None and chosen.source == "override":  # 0, "not cut": one segment each
            chosen = Chosen(max(1, -(-layout.seq_len // CHUNK)), "override")
        elif chosen.value is None:
            chosen = Chosen(launch_table.SEGMENT_CHUNKS, "rule")
        return _build(*key[1:13], segments=(chosen, chosen))
    plan = _memoised(key, build)
    return replace(plan, forward_join=forward_join, backward_join=backward_join)


def _gates(has_g: bool, has_gk: bool) -> str:
    return "+".join(name for name, on in (("g", has_g), ("gk", has_gk)) if on) or "none"


def _chunks_per_segment() -> Chosen:
    chosen = choice("gdn_chunks_per_segment")
    value = chosen.value
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"gdn_chunks_per_segment must be a positive int, or 0 for not cut, got {value!r}")
    if value == 0:  # forced whole (the rule may cut)
        return Chosen(None, "override")
    return chosen


def _segments(B: int, T: int, HV: int, num_seqs: int, varlen: bool, device) -> tuple[Chosen, Chosen]:
    """Chunks per segment of (the forward state passes, bwd_dhu): an override sets both; else
    launch_table.forward_segments' rule cuts the forward passes only (bwd_dhu alike only where
    decayed segments apply: _dhu_cut_alike)."""
    chosen = _chunks_per_segment()
    if chosen.source == "override":
        return chosen, chosen
    rule = launch_table.forward_segments(num_seqs * HV, T, varlen, device, num_seqs)
    if rule is None:
        return chosen, chosen
    return Chosen(rule, "rule"), Chosen(None, "rule")


def _dhu_cut_alike(segments: Chosen, dhu_segments: Chosen, decay_reach: Chosen, T: int, varlen: bool,
                   num_seqs: int) -> Chosen:
    """bwd_dhu's chunks per segment: the forward's rule cut where decayed segments shorten its
    local pass on long sequences (launch_table.dhu_segments_alike), else as _segments chose."""
    if (segments.source == "rule" and segments.value is not None and dhu_segments.value is None
            and decay_reach.value and launch_table.dhu_segments_alike(T, varlen, num_seqs)):
        return Chosen(segments.value, "rule")
    return dhu_segments


def forward_segment_chunks(B: int, T: int, HV: int, num_seqs: int, varlen: bool, device) -> int | None:
    """Chunks per segment of the forward state passes of a call of these shapes, as plan_call
    decides it, or None (not cut). Reads shapes only: the custom op's fake function sizes the
    forward's kept segments with it (custom_op.py)."""
    return _segments(B, T, HV, num_seqs, varlen, device)[0].value


def _state_pass_pairs(B: int, T: int, HV: int, num_seqs: int, varlen: bool, chunks_per_segment) -> int:
    """The independent (sequence or segment, value head) chains of the state passes: what their
    launch configurations and the states-from-T rule go by. Cut into segments, each segment is a
    chain of its own (a few times more programs than sequences x heads)."""
    if chunks_per_segment is None:
        return num_seqs * HV
    return segment_bound(B, T, num_seqs if varlen else None, chunks_per_segment) * HV


def _build(device, dtype, B, T, H, HV, K, V, num_seqs, varlen, has_g, has_gk,
           segments: tuple[Chosen, Chosen] | None = None) -> DeltaRulePlan:
    segments, dhu_segments = segments or _segments(B, T, HV, num_seqs, varlen, device)
    decay_reach = _decay_reach(has_g, has_gk, segments.value)
    dhu_segments = _dhu_cut_alike(segments, dhu_segments, decay_reach, T, varlen, num_seqs)
    pairs = num_seqs * HV
    chains = _state_pass_pairs(B, T, HV, num_seqs, varlen, segments.value)
    keep = launch_table.keeps_inverse(K, V, has_gk)
    backward_warp_roles, dhu_segments = _backward_warp_roles(K, V, pairs, chains, dtype, has_gk, keep, segments,
                                                             dhu_segments, device)
    dhu_chains = _state_pass_pairs(B, T, HV, num_seqs, varlen, dhu_segments.value)
    split = choice("gdn_split_prepare")
    if not keep:
        split = Chosen(False, "rule")
    forward_from_t = _strategy("gdn_states_from_inverse",
                               lambda: launch_table.states_from_inverse(K, chains, device, backward=False))
    backward_from_t = _strategy("gdn_backward_states_from_inverse",
                                lambda: launch_table.states_from_inverse(K, chains, device, backward=True))
    passes = ["prepare", "prepare_t", "recompute_wu", "fwd_h", "fwd_h_from_t", "intra", "bwd_dhu",
              "bwd_dqkw", "bwd_wy"]
    if has_gk:
        passes += ["gated_pairs", "gated_pair_blocks", "prepare_gk", "pair_grad", "pair_grad_blocks",
                   "gate_grad"]
    launches = {name: launch_table.choose(name, K, V, device,
                                          (dhu_chains if name == "bwd_dhu" else chains)
                                          if name in launch_table.SEQUENTIAL else pairs)
                for name in passes}
    for blockwise, parent in launch_table.BLOCKWISE_PARENT.items():
        if blockwise in launches:  # its tiles are its parent's (the same grid): the log shows those
            own = launches[blockwise]
            launches[blockwise] = Chosen(replace(own.value, block_k=launches[parent].value.block_k,
                                                 block_v=launches[parent].value.block_v), own.source)
    shape = (("B", B), ("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("varlen", varlen),
             ("gates", _gates(has_g, has_gk)))
    return DeltaRulePlan("triton", device_info(device), shape, has_gk, inverse_precision(dtype), keep,
                         launch_table.keeps_gated_pairs(K, V, has_gk), split,
                         forward_from_t, backward_from_t, launches, segments, dhu_segments,
                         fused_forward=_fused_forward(K, V, chains, dtype, has_gk, varlen, device),
                         fused_backward=_fused_backward(K, V, dtype, has_gk, device),
                         fused_forward_gk=_hopper_kernel(
                             "gdn_fused_forward_gk",
                             segments.value is None and launch_table.fused_forward_gk_fits(K, V, dtype, has_g, has_gk,
                                                                                            device),
                             lambda: launch_table.FUSED_FORWARD_GK_BY_DEFAULT,
                             "the warp-role forward with gk needs an SM90 GPU, gk without g, K 64 or 128, V a "
                             "multiple of 64, 16-bit inputs and sequences not cut into segments",
                             f"device {device}, g {has_g}, gk {has_gk}, K {K}, V {V}, dtype {dtype}, "
                             f"cut {segments.value}"),
                         longest_first=_strategy("gdn_longest_first", lambda: launch_table.LONGEST_FIRST),
                         dhu_local_dv=_dhu_fold("gdn_dhu_local_dv", has_gk),
                         dhu_w_from_t=_dhu_fold("gdn_dhu_w_from_t", has_gk or not keep or not backward_from_t.value),
                         dhu_warp_roles=_dhu_warp_roles(K, V, dhu_chains, dtype, has_gk, keep, dhu_segments.value,
                                                        device),
                         backward_warp_roles=backward_warp_roles,
                         decay_reach=decay_reach)


def _decay_reach(has_g: bool, has_gk: bool, cut) -> Chosen:
    """Whether the forward's cut drops provably decayed transitions (segments.py): wherever a
    cut has a scalar gate and no gk (the bound reads one decay per token); forced on elsewhere
    it is an error."""
    applies = cut is not None and has_g and not has_gk
    chosen = choice("gdn_decay_reach")
    if chosen.value is None:
        return Chosen(applies, "rule")
    if chosen.value and not applies:
        raise ValueError(f"gdn_decay_reach=True: needs sequences cut into segments, a scalar gate g and no gk; got "
                         f"cut {cut}, g {has_g}, gk {has_gk}")
    return chosen


def _backward_warp_roles(K: int, V: int, pairs: int, chains: int, dtype: torch.dtype, has_gk: bool, keep: bool,
                         segments: Chosen, dhu_segments: Chosen, device) -> tuple[Chosen, Chosen]:
    """-> (whether the backward after the state pass is the one warp-role kernel
    (gluon/backward_ws.py), bwd_dhu's chunks per segment). launch_table's rule counts its
    programs: the sequences x heads, or where the rule cut the forward's state passes, their
    segments x heads, bwd_dhu then cut the same way (the segments run from the state gradients at
    their ends, which the forward's kept transitions give), forced or by rule. An override of the
    segments is taken as given."""
    fits = keep and launch_table.fused_backward_fits(K, V, dtype, has_gk, device)
    if dhu_segments.value is None and segments.source == "rule" and segments.value is not None:
        # Few sequences x heads: the kernel runs over the forward's segments, forced or by rule.
        cut, programs = Chosen(segments.value, "rule"), chains
    elif dhu_segments.value is None:
        cut, programs = dhu_segments, pairs
    else:
        cut, programs = dhu_segments, chains if dhu_segments.value == segments.value else None
    chosen = _hopper_kernel(
        "gdn_backward_warp_roles", fits,
        lambda: programs is not None and launch_table.backward_warp_roles_rule(programs, device),
        "the warp-role backward needs an SM90 GPU, no gk, K and V 64 or 128, 16-bit inputs and T kept by the forward",
        f"device {device}, gk {has_gk}, K {K}, V {V}, dtype {dtype}, T kept {keep}")
    return chosen, cut if chosen.value else dhu_segments


def _dhu_warp_roles(K: int, V: int, chains: int, dtype: torch.dtype, has_gk: bool, keep: bool, cut,
                    device) -> Chosen:
    """Whether bwd_dhu runs with warp roles (gluon/bwd_dhu_ws.py)."""
    return _hopper_kernel(
        "gdn_dhu_warp_roles", keep and cut is None and launch_table.dhu_warp_roles_fit(K, V, dtype, has_gk, device),
        lambda: launch_table.dhu_warp_roles_rule(V, chains, device),
        "the warp-role bwd_dhu needs an SM90 GPU, no gk, K 64 or 128, V a multiple of 64, 16-bit inputs, T kept by "
        "the forward and bwd_dhu not cut into segments",
        f"device {device}, gk {has_gk}, K {K}, V {V}, dtype {dtype}, T kept {keep}, bwd_dhu cut {cut}")


def _hopper_kernel(name: str, fits: bool, rule, needs: str, got: str) -> Chosen:
    """A Gluon kernel's choice: where it fits, launch_table's rule (rule() -> bool), or the
    override; a forced kernel the call cannot take is an error naming what it needs, not a silent
    fallback."""
    chosen = choice(name)
    if chosen.value is None:
        return Chosen(fits and rule(), "rule")
    if chosen.value and not fits:
        raise ValueError(f"{name}={chosen.value!r}: {needs}; got {got}")
    return chosen


def _fused_forward(K: int, V: int, chains: int, dtype: torch.dtype, has_gk: bool, varlen: bool,
                   device) -> Chosen:
    """The fused forward's form: launch_table's rule, or the override (0: off); a forced form
    the call cannot take is an error, not a silent fallback."""
    chosen = choice("gdn_fused_forward")
    if chosen.value is None:
        return Chosen(launch_table.fused_forward_tile(K, V, chains, dtype, has_gk, device, varlen), "rule")
    if chosen.value == 0:
        return Chosen(None, "override")
    tile = 64 if chosen.value == "ws" else chosen.value
    if V % tile or not launch_table.fused_forward_fits(K, V, dtype, has_gk, device):
        raise ValueError(
            f"gdn_fused_forward={chosen.value!r}: the fused forward needs an SM90 GPU, no gk, K 64 or 128, V a "
            f"multiple of {tile} and 16-bit inputs; got device {device}, gk {has_gk}, K {K}, V {V}, dtype {dtype}")
    return chosen


def _fused_backward(K: int, V: int, dtype: torch.dtype, has_gk: bool, device) -> Chosen:
    """Whether the backward's dqkw and WY passes run fused (gluon/backward_chunk.py)."""
    return _hopper_kernel(
        "gdn_fused_backward", launch_table.fused_backward_fits(K, V, dtype, has_gk, device), lambda: True,
        "the fused backward needs an SM90 GPU, no gk, K and V 64 or 128 and 16-bit inputs",
        f"device {device}, gk {has_gk}, K {K}, V {V}, dtype {dtype}")


def _dhu_fold(name: str, excluded: bool) -> Chosen:
    """Whether bwd_dhu takes on work of another pass (gdn_dhu_local_dv: the intra-chunk dv;
    gdn_dhu_w_from_t: w from T): launch_table's rule, or the override; never where `excluded`
    (gk; for w from T also a backward that recomputes w for its state pass anyway)."""
    chosen = choice(name)
    if excluded:
        if chosen.value:
            raise ValueError(f"{name}=True: bwd_dhu does this only without gk (and, for w, where the "
                             f"backward's state pass forms v_new from T)")
        return Chosen(False, "rule")
    if chosen.value is None:
        return Chosen(launch_table.DHU_FOLDS_BY_DEFAULT, "rule")
    return chosen


def plan_bwd_dhu(device: torch.device, B: int, T: int, H: int, HV: int, K: int, V: int,
                 layout: ChunkLayout, has_g: bool, has_gk: bool) -> DeltaRulePlan:
    """The plan of a public chunk_gated_delta_rule_bwd_dhu call: its one pass, memoised (a short
    call's time is mostly the host's)."""
    key = ("bwd_dhu", device, B, T, H, HV, K, V, layout.num_seqs, layout.is_varlen, has_g, has_gk,
           tuning_cache.generation())

    def build():
        segments = _chunks_per_segment()
        chains = _state_pass_pairs(B, T, HV, layout.num_seqs, layout.is_varlen, segments.value)
        off = Chosen(False, "rule")
        shape = (("B", B), ("T", T), ("H", H), ("HV", HV), ("K", K), ("V", V), ("varlen", layout.is_varlen),
                 ("gates", _gates(has_g, has_gk)))
        return DeltaRulePlan("triton", device_info(device), shape, has_gk, "ieee", False, False, off, off, off,
                             {"bwd_dhu": launch_table.choose("bwd_dhu", K, V, device, chains)}, segments, segments)
    return _memoised(key, build)


_PREPARE_PASSES = ("prepare", "prepare_t", "prepare_gk")


def describe(shape: str, device: torch.device | None = None) -> list[str]:
    """What would run for a shape such as 'B=1 T=32768 H=16 HV=16 K=128 V=128 gk varlen' (HV
    defaults to H, K and V to 128; gates: g unless gk is named, 'g gk' for both; varlen packs
    N=<sequences> (default 4) along T with B=1; dtype=fp16 or fp32, else bf16; no data is
    allocated): the strategies, then one line per pass with its launch configuration and where
    it came from. For `flash-dma env --gdn`."""
    fields = dict(part.split("=", 1) if "=" in part else (part, "1") for part in shape.split())
    known = {"B", "T", "H", "HV", "K", "V", "N", "g", "gk", "varlen", "dtype"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"shape: unknown field(s) {unknown} in {shape!r}; expected some of {sorted(known)}")
    varlen = "varlen" in fields
    B, T = int(fields.get("B", 1)), int(fields.get("T", 4096))
    H = int(fields.get("H", 16))
    HV, K, V = int(fields.get("HV", H)), int(fields.get("K", 128)), int(fields.get("V", 128))
    has_gk = "gk" in fields
    has_g = "g" in fields or not has_gk
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(fields.get("dtype", "bf16"), torch.bfloat16)
    if varlen and B != 1:
        raise ValueError(f"shape: varlen packs the sequences along T, so B must be 1, got B={B}")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def stand_in(*size, dt=dtype):  # a tensor of the shape without memory behind it (stride 0)
        return torch.empty((), device=device, dtype=dt).expand(*size)

    q, v = stand_in(B, T, H, K), stand_in(B, T, HV, V)
    if varlen:
        N = int(fields.get("N", 4))
        slots = -(-T // CHUNK) + N
        layout = ChunkLayout(1, T, N, slots, slots, stand_in(N + 1, dt=torch.int32), None, None)
    else:
        layout = chunk_layout(B, T, None)
    plan = plan_call(q, v, has_g, has_gk, layout)
    lines = [f"backend {plan.backend}; gates {_gates(has_g, has_gk)}; inverse products {plan.inverse_precision}; "
             f"T kept for the backward: {plan.keeps_t}"
             f"{' (with the gated pair products)' if plan.keep_gated_pairs else ''}"]
    for name in ("split_prepare", "states_from_inverse", "backward_states_from_inverse", "chunks_per_segment",
                 "dhu_chunks_per_segment", "fused_forward", "fused_forward_gk", "longest_first",
                 "fused_backward", "dhu_local_dv",
                 "dhu_w_from_t", "dhu_warp_roles", "backward_warp_roles"):
        chosen = getattr(plan, name)
        lines.append(f"{name}: {chosen.value} ({chosen.source})")
    for pass_name, chosen in plan.launches.items():
        if pass_name in _PREPARE_PASSES and pass_name != plan.prepare_pass:
            continue  # another prepare kernel serves this call
        lines.append(f"{pass_name}: {launch_table.config_name(chosen.value)} ({chosen.source})")
    return lines
