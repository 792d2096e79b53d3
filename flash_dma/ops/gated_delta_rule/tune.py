"""The gated delta rule's launch sweep (`flash-dma tune gdn`): candidate configurations of its
passes around launch_table.py's entries, timed on a representative shape through
runtime.config.overrides(gdn_<pass>=GdnConfig(...)), the winner stored under the key
launch_table.choose looks up (launch_table.cache_key: pass, padded K and V, GPU).

Not swept: the sequential state passes (fwd_h, fwd_h_from_t, bwd_dhu), whose tile width follows
the number of sequences x heads by rule (launch_table._sequential) while the cache key has no
such count, so one stored winner would replace the rule at every batch size; gate_grad, which
has nothing to tune. Candidates keep K tiles at least 64 wide (pair_grad's 32, the table's) and
intra's V tile at 64: narrower tiles miscompiled on Triton 3.6 / Hopper (launch_table.py), and a
candidate whose output or gradients differ from the table's configuration is skipped, never
stored.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from ...runtime import config
from . import launch_table
from .launch_table import GdnConfig
from .plan import DeltaRulePlan

SEQUENTIAL = ("fwd_h", "fwd_h_from_t", "bwd_dhu")
# (the blockwise gated-pair kernels run only where strong decays flag chunks: not at the
# representative shape's gates)
UNTUNED = SEQUENTIAL + ("gate_grad",) + tuple(launch_table.BLOCKWISE_PARENT)
# Passes whose tiles are fixed by what one program holds (a chunk's products, the gates' chunk):
# only warps and stages are swept.
FIXED_TILES = ("gated_pairs", "pair_grad", "intra")
QUICK_CANDIDATES = 4
WRONG_RESULT = 5e-2  # relative norm error against the table's configuration: a miscompile
# The representative shape: B=2, T=8192, 16 heads, K=V=128, bf16; with g (Gated DeltaNet) and
# with gk (Kimi Delta Attention: its gate passes).
SHAPE = dict(B=2, T=8192, H=16, K=128, V=128)
GATES = ("g", "gk")


def candidates_for(pass_name: str, K: int, V: int, quick: bool) -> list[GdnConfig]:
    """The table's entry first, then variations of it: warps and stages, the compiler's own
    register count where the table caps it, and for passes that tile
    K and V freely, K tiles of 64 up to all of K (the state passes: all of K) and V tiles of 32
    up to 64."""
    kp, vp = config.head_dim_block(K), config.head_dim_block(V)
    first = launch_table._default(pass_name, kp, vp)
    if pass_name == "intra":
        first = replace(first, block_v=64)
    out = [first]

    def add(cfg):
        if cfg not in out:
            out.append(cfg)

    if first.max_registers:  # the table's register cap against the compiler's own count (quick too)
        add(replace(first, max_registers=0))

    # The state passes hold all of K in one tile. At K = 256 three stages overflow their shared
    # memory, and one made an illegal address (fwd_h and bwd_dhu, 16-wide tiles, H200, Triton 3.6)
    sequential = pass_name in launch_table.SEQUENTIAL
    wide_state = sequential and kp > 128
    for warps in (2, 4, 8):
        for stages in ((2,) if wide_state else (1, 2, 3)):
            add(replace(first, num_warps=warps, num_stages=stages))
    if pass_name not in FIXED_TILES:
        for block_k in ((kp,) if sequential else sorted({64, kp})):
            for block_v in sorted({min(32, vp), min(64, vp)}):
                for warps in (4, 8):
                    for stages in ((2,) if wide_state else (2, 3)):
                        add(GdnConfig(block_k, block_v, warps, stages))
    return out[:QUICK_CANDIDATES] if quick else out


class _PassRecorder:
    """The passes a call launches (the plan's launch(), observed for one call)."""

    def __init__(self):
        self.seen: list[str] = []

    def __enter__(self):
        self._real = DeltaRulePlan.launch
        recorder = self

        def launch(plan, pass_name):
            if pass_name not in recorder.seen:
                recorder.seen.append(pass_name)
            return recorder._real(plan, pass_name)
        DeltaRulePlan.launch = launch
        return self

    def __exit__(self, *exc):
        DeltaRulePlan.launch = self._real


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = ours.double(), ref.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_inputs(device, gate: str, B: int, T: int, H: int, K: int, V: int, dtype=torch.bfloat16, seed: int = 0):
    """Leaves (q, k, v, gate, beta) with gates in their working range."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device)

    q, k, v = randn(B, T, H, K).to(dtype), randn(B, T, H, K).to(dtype), randn(B, T, H, V).to(dtype)
    decay = torch.nn.functional.logsigmoid(randn(B, T, H, K) if gate == "gk" else randn(B, T, H)) / 16
    beta = torch.sigmoid(randn(B, T, H)).to(dtype)
    leaves = [t.requires_grad_() for t in (q, k, v, decay.to(dtype), beta)]
    return leaves


def cases(device: torch.device, quick: bool, shape: dict | None = None, gates=GATES, timer=None) -> Iterator:
    from ...benchmarks.common import time_ms
    from ...benchmarks.tune import TuneCase
    from . import chunk_gated_delta_rule
    timer = timer or time_ms
    shape = dict(shape or SHAPE)
    for gate in gates:
        # one generator per gate, which owns its tensors: each yielded case's timing closure
        # keeps them for as long as the case is kept (the sweep drops it once timed)
        yield from _gate_cases(device, gate, shape, quick, timer, TuneCase, chunk_gated_delta_rule)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _gate_cases(device, gate, shape, quick, timer, TuneCase, chunk_gated_delta_rule) -> Iterator:
    K, V = shape["K"], shape["V"]
    leaves = make_inputs(device, gate, **shape)
    q, k, v, decay, beta = leaves

    def forward():
        g, gk = (None, decay) if gate == "gk" else (decay, None)
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, gk=gk)
        return o

    with _PassRecorder() as fwd_passes:
        out = forward()
    do = torch.randn_like(out)
    with _PassRecorder() as bwd_passes:
        grads = torch.autograd.grad(out, leaves, do)
    reference = [out.detach()] + [g.detach() for g in grads]
    label_shape = " ".join(f"{n}={shape[n]}" for n in ("B", "T", "H", "K", "V"))
    for pass_name in fwd_passes.seen + [p for p in bwd_passes.seen if p not in fwd_passes.seen]:
        if pass_name in UNTUNED:
            continue
        forward_only = pass_name not in bwd_passes.seen

        def time_config(cfg, pass_name=pass_name, forward_only=forward_only):
            with config.overrides(**{f"gdn_{pass_name}": cfg}):
                out = forward()
                grads = torch.autograd.grad(out, leaves, do)
                for ours, ref in zip([out] + list(grads), reference):
                    err = _relative_error(ours, ref)
                    if not err <= WRONG_RESULT:  # (NaN fails too)
                        raise ValueError(f"wrong result: relative error {err:.3g}")
                if forward_only:
                    return timer(forward)
                return timer(lambda: torch.autograd.grad(forward(), leaves, do))

        yield TuneCase(f"gdn_{pass_name}", device, K, q.dtype, f"V{V}",
                       candidates_for(pass_name, K, V, quick), time_config,
                       cache_key=launch_table.cache_key(pass_name, K, V, device),
                       label=f"gdn {pass_name} {label_shape} {gate}")

