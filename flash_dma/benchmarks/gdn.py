"""The chunked gated delta rule beside flash-linear-attention (FLA) 0.6.0, in one process.

Two benchmarks:

* ``dhu``: the state-gradient pass ``chunk_gated_delta_rule_bwd_dhu`` on its own, over
  B x T x H at K = V = 128 in the five modes of the spec (A: no gate, no states; B: dht and h0;
  C: g; D: gk; E: g and gk) and on packed variable-length batches. It is bandwidth-bound, so
  every row carries the bytes it moves (read + written) and its share of the device's
  copy ceiling.
* ``gdn``: the whole op ``chunk_gated_delta_rule``, forward, backward and forward+backward;
  where FlashQLA (``flash_qla``, TileLang kernels) imports, each case also has rows beside its
  ``chunk_gated_delta_rule``.

The peers are optional: without one the sections show the others' times, with a note. Everything that
decides what is measured (configurations, bytes, inputs, references) is plain functions that
run on the CPU, so the tests check them without a GPU.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..ops.gated_delta_rule import reference
from .common import Row, Section, compare, geometric_mean, time_ms

DTYPE = torch.bfloat16
CHUNK = 64
PEER = "FLA"
QLA_PEER = "FlashQLA"
RCP_LN2 = 1.0 / math.log(2.0)  # FLA's kernels take gate cumsums in log2 units (they call exp2)

MODES = {
    "A": ("no gate, no states", ()),
    "B": ("dht and h0", ("dht", "h0")),
    "C": ("g", ("g",)),
    "D": ("gk", ("gk",)),
    "E": ("g and gk", ("g", "gk")),
}

# Device-to-device copy ceilings, bytes read + written per second, measured on that card
# (/work/shared/anchors.md). Keyed by a substring of torch.cuda.get_device_name(); a device not
# listed gets a copy measured in the run (copy_ceiling below).
COPY_CEILING = {"H200": 4.3e12}
# The op's sides (ours and each peer) are timed in this many alternating rounds per case: a peer's
# time moved by a third between two runs on one machine while ours stayed put.
ROUNDS = 3

Timer = Callable[[Callable[[], object]], float]


# --------------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class DhuShape:
    B: int
    T: int
    H: int
    K: int = 128
    V: int = 128
    seqlens: tuple[int, ...] | None = None  # packed sequences (B == 1, sum == T)

    @property
    def label(self) -> str:
        if self.seqlens is not None:
            return f"varlen N{len(self.seqlens)} T{self.T} H{self.H}"
        dims = "" if (self.K, self.V) == (128, 128) else f" K{self.K} V{self.V}"
        return f"B{self.B} T{self.T} H{self.H}{dims}"

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B

    def n_chunks(self, chunk: int = CHUNK) -> int:
        """Chunks over the whole batch: the leading dims of dh are [B, NT] (B == 1 packed)."""
        if self.seqlens is not None:
            return sum(-(-n // chunk) for n in self.seqlens)
        return self.B * -(-self.T // chunk)


def dhu_bytes(shape: DhuShape, mode: str, chunk: int = CHUNK, itemsize: int = 2) -> int:
    """Bytes one bwd_dhu call must move: read q, k, w, do, dv (16-bit), g, gk, dht (fp32) as
    present; write dh (16-bit, one [K, V] state per chunk and head), dv2 (16-bit), dh0 (fp32).
    h0 is not read (only its presence asks for dh0)."""
    s, flags = shape, MODES[mode][1]
    tok = s.B * s.T * s.H  # value heads == key heads here
    state = s.n_seqs * s.H * s.K * s.V
    read = tok * (3 * s.K + 2 * s.V) * itemsize  # q, k, w; do, dv
    if "g" in flags:
        read += tok * 4
    if "gk" in flags:
        read += tok * s.K * 4
    if "dht" in flags:
        read += state * 4
    written = s.n_chunks(chunk) * s.H * s.K * s.V * itemsize + tok * s.V * itemsize
    if "h0" in flags:
        written += state * 4
    return read + written


def varlen_lengths(total: int, seed: int, lo: int = 20, hi: int = 25) -> tuple[int, ...]:
    """lo..hi sequence lengths (at least 1 token each) summing to total, fixed by seed."""
    rng = random.Random(seed)
    n = rng.randint(lo, hi)
    cuts = sorted(rng.sample(range(1, total), n - 1))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


VARLEN_SEED = 2026


def dhu_plan(quick: bool) -> list[tuple[DhuShape, tuple[str, ...]]]:
    """(shape, modes) in run order: the shape's inputs are made once, each mode derives from them."""
    if quick:
        return [(DhuShape(1, 8192, 16), tuple(MODES)),
                (DhuShape(2, 4096, 32), ("A", "E")),
                (DhuShape(1, 8192, 64, seqlens=varlen_lengths(8192, VARLEN_SEED)), ("A", "E"))]
    plan = [(DhuShape(b, t, h), tuple(MODES))
            for b in (1, 2, 4) for t in (2048, 4096, 8192, 16384) for h in (16, 32)]
    plan += [(DhuShape(1, t, 64, seqlens=varlen_lengths(t, VARLEN_SEED)), tuple(MODES))
             for t in (8192, 32768)]
    return plan


def dhu_section_title(mode: str | None) -> str:
    if mode is None:
        return ("bwd_dhu, packed varlen batches (20-25 random lengths, seed "
                f"{VARLEN_SEED}), K=V=128, bf16, all modes")
    return f"bwd_dhu mode {mode} ({MODES[mode][0]}), K=V=128, bf16, chunk {CHUNK}"


@dataclass(frozen=True)
class OpCase:
    B: int
    T: int
    H: int
    K: int = 128
    V: int = 128
    states: bool = False  # initial_state given and output_final_state=True
    per_key_gate: bool = False  # Kimi Delta Attention: gk [B, T, H, K] instead of g (FLA's chunk_kda)
    # Decays near 1 (a chunk's log decay about -0.06 instead of about -12): a state then carries
    # across thousands of tokens, so no method may drop what a partition inherits (FlashQLA's
    # split of one sequence truncates below e^-10 and costs little with strong decays)
    slow_decay: bool = False
    # With per_key_gate: Kimi Linear's unbounded gate as initialised, -e^A_log softplus(x + dt_bias)
    # with x of spread 2 (most chunks have a key decaying faster than e^-1.9 a token: our gated
    # pairs take 16-row blocks there; FLA's chunk_kda does whatever the gate)
    strong_decay: bool = False
    seqlens: tuple[int, ...] | None = None  # packed sequences (B == 1, sum == T), given as cu_seqlens
    # With per_key_gate: both sides keep the forward's states for the backward
    # (disable_recompute=True; FLA's chunk_gated_delta_rule has no such option)
    keep_states: bool = False

    def __post_init__(self):
        if self.keep_states and not self.per_key_gate:
            raise ValueError("OpCase: keep_states is FLA chunk_kda's disable_recompute: it needs per_key_gate")
        if self.strong_decay and (not self.per_key_gate or self.slow_decay):
            raise ValueError("OpCase: strong_decay is a per-key (KDA) gate: it needs per_key_gate and not slow_decay")
        if self.seqlens is not None and (self.B != 1 or sum(self.seqlens) != self.T):
            raise ValueError(f"OpCase: packed sequences need B == 1 and lengths summing to T; got B={self.B}, "
                             f"T={self.T}, sum={sum(self.seqlens)}")

    @property
    def label(self) -> str:
        dims = "" if (self.K, self.V) == (128, 128) else f" K{self.K} V{self.V}"
        packed = f"varlen N{len(self.seqlens)} " if self.seqlens is not None else ""
        return (f"{packed}B{self.B} T{self.T} H{self.H}{dims}{' KDA' if self.per_key_gate else ''}"
                f"{' h0+ht' if self.states else ''}{' slow-decay' if self.slow_decay else ''}"
                f"{' strong-decay' if self.strong_decay else ''}{' no-recompute' if self.keep_states else ''}")

    @property
    def family(self) -> tuple:
        """What FLA's autotuning keys on (heads, head dims, its op): a new family autotunes again."""
        return (self.H, self.K, self.V, self.per_key_gate, self.seqlens is not None)


def op_plan(quick: bool, cases: Sequence[str] | None = None) -> list[OpCase]:
    """The op report's cases; `cases` picks some of the full plan by label (the whole report with
    FLA's first-call autotuning takes longer than some machines lend in one go)."""
    full = [OpCase(4, 4096, 16), OpCase(1, 8192, 16), OpCase(1, 32768, 16), OpCase(8, 4096, 32),
            OpCase(2, 8192, 8, 256, 256), OpCase(1, 8192, 16, states=True),
            OpCase(2, 4096, 16, per_key_gate=True), OpCase(2, 4096, 16, per_key_gate=True, strong_decay=True),
            OpCase(2, 4096, 16, per_key_gate=True, keep_states=True),
            OpCase(1, 32768, 16, slow_decay=True),
            # the packed batch: 20-25 sequences (seeded lengths) filling T = 32768
            OpCase(1, 32768, 16, seqlens=varlen_lengths(32768, VARLEN_SEED))]
    if cases:
        by_label = {c.label: c for c in full}
        unknown = [c for c in cases if c not in by_label]
        if unknown:
            raise ValueError(f"cases: {unknown} are not in the op plan; its labels: {list(by_label)}")
        return [by_label[c] for c in cases]
    return [OpCase(1, 8192, 16)] if quick else full


# --------------------------------------------------------------------------------------------
# bandwidth ceiling


def copy_ceiling(device_name: str | None = None, measure: bool = True) -> tuple[float | None, str]:
    """(bytes/s, where the number comes from) for the % of ceiling in the dhu rows."""
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    for key, value in COPY_CEILING.items():
        if device_name and key in device_name:
            return value, f"{value / 1e12:.1f} TB/s, the {key} device-to-device copy ceiling (anchors.md)"
    if measure and torch.cuda.is_available():
        n = 1 << 29  # 512 MiB each way
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = time_ms(lambda: dst.copy_(src))
        del src, dst
        rate = 2 * n / (ms * 1e-3)
        return rate, (f"{rate / 1e12:.2f} TB/s, a 512 MiB device-to-device copy measured in this run "
                      f"(no table entry for {device_name})")
    return None, f"unknown (no copy ceiling for {device_name})"


def bandwidth_note(nbytes: float, ours_ms: float | None, peer_ms: float | None,
                   ceiling: float | None) -> str:
    """'ours 71% FLA 40% of copy ceiling' (the GB/s themselves are in the rate columns)."""
    if not ceiling:
        return ""
    parts = [f"{name} {nbytes / (ms * 1e-3) / ceiling * 100:.0f}%"
             for name, ms in (("ours", ours_ms), (PEER, peer_ms)) if ms]
    return " ".join(parts) + " of copy ceiling" if parts else ""


# --------------------------------------------------------------------------------------------
# inputs and references (plain torch; the references are for tests and the self-check)


def chunk_bounds(T: int, chunk: int, seqlens: Sequence[int] | None = None, device=None):
    """(first, last) token index of each token's chunk; chunks restart at every sequence."""
    pos = torch.arange(T, device=device)
    if seqlens is None:
        seq_start = torch.zeros_like(pos)
        seq_end = torch.full_like(pos, T)
    else:
        cu = torch.tensor([0, *torch.tensor(list(seqlens)).cumsum(0).tolist()], device=device)
        seq = torch.searchsorted(cu[1:], pos, right=True)
        seq_start, seq_end = cu[seq], cu[seq + 1]
    first = pos - (pos - seq_start) % chunk
    last = torch.minimum(first + chunk, seq_end) - 1
    return first, last


def chunk_local_cumsum(x: torch.Tensor, chunk: int, seqlens: Sequence[int] | None = None) -> torch.Tensor:
    """Cumulative sum over dim 1 restarting at every chunk (and sequence), fp32 out."""
    cu = None if seqlens is None else _cu_seqlens(seqlens, x.device)
    return reference.chunk_local_cumsum(x.double(), chunk, cu).float()


def at_chunk_last(x: torch.Tensor, chunk: int, seqlens: Sequence[int] | None = None) -> torch.Tensor:
    """x at the last token of each token's chunk (dim 1)."""
    _, last = chunk_bounds(x.shape[1], chunk, seqlens, x.device)
    return x.index_select(1, last)


def _cu_seqlens(seqlens: Sequence[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(seqlens)).cumsum(0).tolist()], dtype=torch.int64,
                        device=device)


def make_dhu_base(shape: DhuShape, device="cuda", seed: int = 0, dtype=DTYPE) -> dict:
    """Random inputs of one shape, shared by its modes. Gates in natural-log units.

    k has unit rows and w = beta * k (gated like the chunk form's w), so the state gradient's
    per-chunk map I - w^T k is a contraction and nothing grows over hundreds of chunks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s = shape

    def randn(*size, dt=torch.float32):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dt)

    B, T, H, K, V = s.B, s.T, s.H, s.K, s.V
    x = {"q": randn(B, T, H, K, dt=dtype),
         "k": torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).to(dtype),
         "do": randn(B, T, H, V, dt=dtype),
         "dv": randn(B, T, H, V, dt=dtype),
         "beta": torch.rand(B, T, H, generator=gen, device=device) * 0.5 + 0.5}
    # per-token log decays near the slow end of a trained layer (mean about -0.03)
    x["g"] = chunk_local_cumsum(torch.nn.functional.logsigmoid(randn(B, T, H) + 4), CHUNK, s.seqlens)
    x["gk"] = chunk_local_cumsum(torch.nn.functional.logsigmoid(randn(B, T, H, K) + 4), CHUNK, s.seqlens)
    N = s.n_seqs
    x["dht"] = randn(N, H, K, V) * 0.1
    x["h0"] = torch.zeros(N, H, K, V, device=device)  # only its presence matters to bwd_dhu
    x["cu_seqlens"] = _cu_seqlens(s.seqlens, device) if s.seqlens is not None else None
    x["scale"] = K ** -0.5
    return x


def dhu_mode_inputs(base: dict, shape: DhuShape, mode: str, flags: Sequence[str] | None = None) -> dict:
    """The keyword arguments of bwd_dhu for one mode (or an explicit set of flags), gates in
    natural-log units.

    With g: w = beta exp(g) k, q is scaled by exp(g) inside the kernel. With gk the caller
    passes q and k already gated (q exp(gk), k exp(gk_last - gk)), as the spec says."""
    flags = MODES[mode][1] if flags is None else tuple(flags)
    dtype = base["q"].dtype
    q, k = base["q"].float(), base["k"].float()
    wscale = base["beta"].clone()
    if "g" in flags:
        wscale = wscale * base["g"].exp()
    w = k * wscale[..., None]
    if "gk" in flags:
        gk = base["gk"]
        w = w * gk.exp()
        q = q * gk.exp()
        k = k * (at_chunk_last(gk, CHUNK, shape.seqlens) - gk).exp()
    return {"q": q.to(dtype), "k": k.to(dtype), "w": w.to(dtype), "do": base["do"], "dv": base["dv"],
            "g": base["g"] if "g" in flags else None, "gk": base["gk"] if "gk" in flags else None,
            "h0": base["h0"] if "h0" in flags else None, "dht": base["dht"] if "dht" in flags else None,
            "scale": base["scale"], "cu_seqlens": base["cu_seqlens"], "chunk_size": CHUNK}


def scale_gates(args: dict, factor: float) -> dict:
    """The same call with g and gk multiplied by factor (RCP_LN2: natural log -> log2 units)."""
    if factor == 1.0:
        return dict(args)
    return {**args, "g": args["g"] * factor if args["g"] is not None else None,
            "gk": args["gk"] * factor if args["gk"] is not None else None}


def dhu_reference(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, cu_seqlens=None,
                  chunk_size=CHUNK):
    """bwd_dhu as the spec writes it (the package's fp64 reference), with the op's output dtypes:
    (dh in q's dtype, dh0 fp32 or None, dv2 in dv's dtype)."""
    dh, dh0, dv2 = reference.bwd_dhu_reference(q, k, w, do, dv, g=g, gk=gk, h0=h0, dht=dht, scale=scale,
                                               cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if cu_seqlens is not None:
        dh = dh.reshape(1, -1, *dh.shape[2:])
    return dh.to(q.dtype), (dh0.float() if dh0 is not None else None), dv2.to(dv.dtype)


def kimi_linear_gate(B: int, T: int, H: int, K: int, spread: float, gen: torch.Generator, device) -> torch.Tensor:
    """Kimi Linear's unbounded per-key log decay as initialised: -e^A_log softplus(x + dt_bias),
    A_log = log U(1, 16) per head, dt_bias with softplus(dt_bias) = dt log-uniform in [1e-3, 0.1]
    per (head, key), and x (the projection's output) normal of standard deviation `spread`.
    -> [B, T, H, K] fp32."""
    a_log = torch.rand(H, generator=gen, device=device).mul(15).add(1).log()
    dt = torch.rand(H, K, generator=gen, device=device).mul(math.log(100)).add(math.log(1e-3)).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    x = spread * torch.randn(B, T, H, K, generator=gen, device=device)
    return -a_log.exp()[:, None] * torch.nn.functional.softplus(x + dt_bias)


def make_op_inputs(case: OpCase, device="cuda", seed: int = 0, dtype=DTYPE) -> dict:
    """Inputs of the whole op: unit-norm q and k (as the l2norm of a GDN layer leaves them),
    natural-log decays g (with strong_decay Kimi Linear's initial gate), beta in (0.5, 0.73), the
    output gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device)

    norm = torch.nn.functional.normalize
    x = {"q": norm(randn(B, T, H, K), dim=-1).to(dtype), "k": norm(randn(B, T, H, K), dim=-1).to(dtype),
         "v": randn(B, T, H, V).to(dtype),
         # natural-log decays: per value head, or per key (KDA) with the same spread
         "g": torch.nn.functional.logsigmoid(randn(*((B, T, H, K) if case.per_key_gate else (B, T, H)))
                                             + (7 if case.slow_decay else 2)),
         "beta": torch.rand(B, T, H, generator=gen, device=device).sigmoid().to(dtype),
         "do": randn(B, T, H, V).to(dtype)}
    if case.strong_decay:  # replaces g: see OpCase.strong_decay
        x["g"] = kimi_linear_gate(B, T, H, K, 2.0, gen, device)
    N = B if case.seqlens is None else len(case.seqlens)
    x["h0"] = randn(N, H, K, V) * 0.1 if case.states else None
    x["dht"] = randn(N, H, K, V) * 0.1 if case.states else None
    x["cu_seqlens"] = None if case.seqlens is None else _cu_seqlens(case.seqlens, device)
    return x


def recurrence_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         gk=None):
    """The spec's token-by-token recurrence in fp64 (the package's reference; small sizes only)."""
    return reference.gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, gk=gk)


# --------------------------------------------------------------------------------------------
# implementations


def fla_available() -> str | None:
    """None when FLA's gated delta rule imports here, else a one-line reason."""
    try:
        import fla.ops.common.chunk_delta_h  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as exc:
        return (f"flash-linear-attention (FLA) not installed ({exc.name}): the gated delta rule "
                "sections show our times only")
    except Exception as exc:  # noqa: BLE001 - a broken peer is a note, not a failed run
        return f"flash-linear-attention (FLA) failed to import: {type(exc).__name__}: {exc}"
    return None


_FLA: SimpleNamespace | None = None


def load_fla(notes: list[str]) -> SimpleNamespace | None:
    """FLA's op and bwd_dhu with the gated-backward refusal lifted (noted), or None (noted)."""
    global _FLA
    if _FLA is not None:
        notes += [n for n in getattr(_FLA, "notes", []) if n not in notes]
        return _FLA
    # FLA's Triton kernels, not an optional tilelang / FlashQLA backend if one happens to be installed
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    reason = fla_available()
    if reason is not None:
        if reason not in notes:
            notes.append(reason)
        return None
    import fla
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets
    # FLA 0.6.0 refuses its gated backward (chunk_bwd_dqkwg) on Hopper with Triton < 3.7.1 (its
    # issue 640). The check reads a module global, so flip every copy of the flag that FLA holds.
    lifted = []
    for name, mod in list(sys.modules.items()):
        if (name == "fla" or name.startswith("fla.")) and getattr(mod, "TRITON_ABOVE_3_7_1", None) is False:
            mod.TRITON_ABOVE_3_7_1 = True
            lifted.append(name)
    version = getattr(fla, "__version__", "?")
    first_note = len(notes)
    notes.append(f"peer: flash-linear-attention {version} (Triton kernels"
                 + ("; backend dispatch off" if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1" else "")
                 + ")")
    if lifted:
        import triton
        notes.append(f"FLA {version} refuses its gated backward on Hopper with Triton < 3.7.1 (FLA issue "
                     f"640; Triton here {triton.__version__}): the refusal was lifted to time it "
                     f"(TRITON_ABOVE_3_7_1 = True in {', '.join(sorted(lifted))}); its results are "
                     "compared with ours in the max_abs / max_rel columns")
    try:  # Kimi Delta Attention (per-key gate): a row of its own where this FLA has it
        from fla.ops.kda import chunk_kda
    except Exception as exc:  # noqa: BLE001 - a missing peer op is a note
        chunk_kda = None
        notes.append(f"FLA {version}: no chunk_kda ({type(exc).__name__}: {exc}); the KDA row shows ours only")
    _FLA = SimpleNamespace(op=chunk_gated_delta_rule, kda=chunk_kda, dhu=chunk_gated_delta_rule_bwd_dhu,
                           chunk_indices=prepare_chunk_indices, chunk_offsets=prepare_chunk_offsets,
                           version=version, notes=notes[first_note:])
    return _FLA


def load_flash_qla(notes: list[str]) -> SimpleNamespace | None:
    """FlashQLA's chunk_gated_delta_rule (a second peer of the op), or None with a one-line note.

    Its API takes FLA's layout and natural-log decays g [B, T, HV]; its kernels exist for
    K = V = 128 only and it has no per-key gate, facts carried here for flash_qla_no_path."""
    try:
        import flash_qla
        op = flash_qla.chunk_gated_delta_rule
    except ImportError as exc:
        reason = f"FlashQLA not available ({type(exc).__name__}: {exc})"
    except Exception as exc:  # noqa: BLE001 - a broken peer is a note (it refuses GPUs it has no kernels for)
        reason = _refusal("FlashQLA import", exc)
    else:
        version = getattr(flash_qla, "__version__", "?")
        notes.append(f"peer: FlashQLA {version} (flash_qla.chunk_gated_delta_rule with its defaults, "
                     "automatic intra-card CP included); it compiles its TileLang kernels on the first "
                     "call of each new shape, untimed (the first-calls note says how long)")
        return SimpleNamespace(op=op, version=version, head_dims=((128, 128),), per_key_gate=False)
    reason = reason.splitlines()[0][:160] + ": the op rows have no FlashQLA peer"
    if reason not in notes:
        notes.append(reason)
    return None


def flash_qla_no_path(case: OpCase, qla: SimpleNamespace) -> str | None:
    """Why FlashQLA has no kernel for this case, or None when it has one."""
    if case.per_key_gate and not qla.per_key_gate:
        return f"{QLA_PEER}: no path (no per-key gate, KDA)"
    if (case.K, case.V) not in qla.head_dims:
        dims = ", ".join(f"K{k} V{v}" for k, v in qla.head_dims)
        return f"{QLA_PEER}: no path (head dims {dims} only)"
    return None


def load_ours(name: str, notes: list[str]):
    """flash_dma.<name>, or None with a note (the op may not have landed yet)."""
    try:
        import flash_dma
        return getattr(flash_dma, name)
    except (ImportError, AttributeError) as exc:
        msg = f"flash_dma.{name} not available ({type(exc).__name__}: {exc}): FLA's times only"
        if msg not in notes:
            notes.append(msg)
        return None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _refusal(who: str, exc: Exception) -> str:
    text = str(exc).splitlines()[0][:100] if str(exc) else ""
    return f"{who} failed: {type(exc).__name__}: {text}"


def _worst(pairs: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    if not pairs:
        return None, None
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def compare_outputs(ours: Sequence, ref: Sequence) -> tuple[float | None, float | None]:
    """Worst (max_abs, max_rel) over the outputs both sides returned (None entries skipped)."""
    return _worst([compare(a, b) for a, b in zip(ours, ref) if a is not None and b is not None])


# --------------------------------------------------------------------------------------------
# bwd_dhu


def _run_dhu(fn, args: dict, timer: Timer, device) -> tuple[float, tuple, float]:
    """(median ms, outputs, seconds of the first call) of one bwd_dhu implementation."""
    t0 = time.perf_counter()
    out = fn(**args)
    _sync(device)
    first = time.perf_counter() - t0
    ms = timer(lambda: fn(**args))
    return ms, tuple(out), first


def _fla_dhu_args(fla, args: dict) -> dict:
    a = scale_gates(args, RCP_LN2)
    if a["cu_seqlens"] is not None:  # precomputed once, as FLA's own op does, not inside the timing
        a["chunk_indices"] = fla.chunk_indices(a["cu_seqlens"], CHUNK)
        a["chunk_offsets"] = fla.chunk_offsets(a["cu_seqlens"], CHUNK)
    return a


def probe_gate_units(ours, fla, device="cuda") -> tuple[float, str]:
    """Which units our bwd_dhu takes g and gk in: the spec's natural log (factor 1) or FLA's
    log2 (factor 1/ln 2). Runs both on a small mode-E case and keeps the one that matches FLA."""
    shape = DhuShape(1, 256, 16)  # H16: FLA's autotuning here is reused by the H16 rows
    args = dhu_mode_inputs(make_dhu_base(shape, device, seed=7), shape, "E")
    ref = fla.dhu(**_fla_dhu_args(fla, args))
    errs = {}
    for factor in (1.0, RCP_LN2):
        out = ours(**scale_gates(args, factor))
        errs[factor] = compare_outputs((out[0], out[2]), (ref[0], ref[2]))[1]
    best = min(errs, key=lambda f: errs[f])
    units = "natural-log" if best == 1.0 else "log2 (as FLA's kernel)"
    text = (f"bwd_dhu gates: FLA's kernel applies exp2 to g and gk, so FLA gets them times log2(e); "
            f"ours took them in {units} units (probed on B1 T256 H16 mode E: max_rel "
            f"{errs[1.0]:.1e} natural, {errs[RCP_LN2]:.1e} log2)")
    if errs[best] > 0.05:
        text += " - NEITHER MATCHES FLA"
    return best, text


def run_dhu_shape(shape: DhuShape, modes: Sequence[str], ours, fla, notes: list[str], ceiling: float | None,
                  device="cuda", timer: Timer | None = None, ours_gate_factor: float = 1.0,
                  firsts: dict | None = None, progress=None) -> dict[str, Row]:
    """One row per mode for one shape; inputs made once, freed at the end."""
    timer = timer or (lambda fn: time_ms(fn, warmup=25, rep=100))
    base = make_dhu_base(shape, device, seed=shape.T * 131 + shape.H * 7 + shape.B)
    rows = {}
    for mode in modes:
        args = dhu_mode_inputs(base, shape, mode)
        label = shape.label + (f" {mode}" if shape.seqlens is not None else "")
        nbytes = dhu_bytes(shape, mode)
        o_ms = p_ms = o_out = p_out = None
        msgs = []
        if ours is not None:
            try:
                o_ms, o_out, first = _run_dhu(ours, scale_gates(args, ours_gate_factor), timer, device)
                if firsts is not None:
                    firsts.setdefault(("ours", shape.H, shape.seqlens is not None), (label, first))
            except Exception as exc:  # noqa: BLE001 - one failing configuration is a result
                msgs.append(_refusal("ours", exc))
        if fla is not None:
            try:
                p_ms, p_out, first = _run_dhu(fla.dhu, _fla_dhu_args(fla, args), timer, device)
                if firsts is not None:
                    firsts.setdefault(("FLA", shape.H, shape.seqlens is not None), (label, first))
            except Exception as exc:  # noqa: BLE001 - one failing configuration is a result
                msgs.append(_refusal(PEER, exc))
        max_abs = max_rel = None
        if o_out is not None and p_out is not None:
            # (dh, dh0, dv2): dh0 only in mode B
            max_abs, max_rel = compare_outputs(o_out, p_out)
        bw = bandwidth_note(nbytes, o_ms, p_ms, ceiling)
        rows[mode] = Row(label, PEER if fla is not None else "-", p_ms, o_ms, max_abs, max_rel,
                         bytes=float(nbytes), note="; ".join([bw] * bool(bw) + msgs), seqlen=shape.T,
                         direction="bwd_dhu")
        del args, o_out, p_out
        if progress:
            progress()
    del base
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def overall_geomean_note(what: str, sections: Sequence[Section], target: float | None = None,
                         peer: str = PEER) -> str | None:
    speedups = [r.speedup for s in sections for r in s.rows if r.speedup and r.peer == peer]
    if not speedups:
        return None
    text = (f"{what}: geometric mean speedup vs {peer} over all {len(speedups)} rows "
            f"{geometric_mean(speedups):.2f}x")
    if target is not None:
        text += f" (target >= {target:.1f}x)"
    return text


def _first_call_note(kind: str, firsts: dict) -> str | None:
    if not firsts:
        return None
    parts = [f"{who} {label}: {sec:.1f} s" for (who, *_), (label, sec) in sorted(firsts.items(), key=str)]
    return f"{kind} first calls (compile, autotune), untimed warm-up: " + "; ".join(parts)


def run_dhu(quick: bool = False, progress_factory=None, device="cuda",
            timer: Timer | None = None) -> tuple[list[Section], list[str]]:
    notes: list[str] = []
    plan = dhu_plan(quick)
    ours = load_ours("chunk_gated_delta_rule_bwd_dhu", notes)
    fla = load_fla(notes)
    ceiling, source = copy_ceiling() if torch.device(device).type == "cuda" else (None, "unknown (cpu)")
    notes.append(f"bwd_dhu bytes = read q, k, w, do, dv (bf16), g, gk, dht (fp32) as present + written "
                 f"dh, dv2 (bf16), dh0 (fp32); % of copy ceiling against {source}")
    factor = 1.0
    if ours is not None and fla is not None:
        try:
            factor, text = probe_gate_units(ours, fla, device)
            notes.append(text)
        except Exception as exc:  # noqa: BLE001 - a failed probe is a note
            notes.append("bwd_dhu gate-units probe: " + _refusal("probe", exc))
    elif ours is not None:
        notes.append("bwd_dhu gates given to ours as natural-log chunk-local cumsums (the spec)")
    total = sum(len(m) for _, m in plan)
    bar = progress_factory(total) if progress_factory else None
    by_mode = {m: Section(dhu_section_title(m)) for m in MODES}
    varlen = Section(dhu_section_title(None))
    firsts: dict = {}
    for shape, modes in plan:
        rows = run_dhu_shape(shape, modes, ours, fla, notes, ceiling, device, timer, factor, firsts,
                             bar.update if bar else None)
        for mode, row in rows.items():
            (varlen if shape.seqlens is not None else by_mode[mode]).rows.append(row)
    if bar:
        bar.close()
    sections = [s for s in (*by_mode.values(), varlen) if s.rows]
    for line in (overall_geomean_note("bwd_dhu", sections, 1.5), _first_call_note("bwd_dhu", firsts)):
        if line:
            notes.append(line)
    for shape, _ in plan:
        if shape.seqlens is not None:
            notes.append(f"{shape.label} lengths: {list(shape.seqlens)}")
    return sections, notes


# --------------------------------------------------------------------------------------------
# the whole op


@dataclass
class OpResult:
    fwd_ms: float
    bwd_ms: float
    fwdbwd_ms: float
    outputs: list  # o, final state (or None)
    grads: list  # q, k, v, g, beta (, h0)
    first_s: float
    note: str = ""
    peak_mib: float | None = None  # one fwd+bwd's peak allocation above the live set (CUDA only)
    host_ms: float | None = None  # host time of one fwd+bwd call with the device idle before it (CUDA only)


def _op_steps(fn, case: OpCase, x: dict, device) -> tuple[dict, OpResult]:
    """One side's first call (timed, with its outputs and gradients) and peak memory: -> (its
    steps to time, {"fwd", "fwd+bwd": callables; "bwd": a callable that builds a fresh graph and
    returns the backward to time on it}; an OpResult without times yet)."""
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = x["h0"].detach().clone().requires_grad_() if case.states else None
    if h0 is not None:
        leaves.append(h0)

    packed = {} if x.get("cu_seqlens") is None else {"cu_seqlens": x["cu_seqlens"]}

    def fwd():
        q, k, v, g, beta = leaves[:5]
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=case.states, **packed)

    def targets(out):
        o, ht = out
        return ([o, ht], [x["do"], x["dht"]]) if case.states else ([o], [x["do"]])

    t0 = time.perf_counter()
    out = fwd()
    outs, douts = targets(out)
    grads = torch.autograd.grad(outs, leaves, douts)
    _sync(device)
    first = time.perf_counter() - t0

    def fwd_bwd():
        o, d = targets(fwd())
        return torch.autograd.grad(o, leaves, d)
    peak = _peak_mib(fwd_bwd, device)
    host = _host_ms(fwd_bwd, device)

    def backward_on_a_fresh_graph():
        o, d = targets(fwd())
        return lambda: torch.autograd.grad(o, leaves, d, retain_graph=True)
    steps = {"fwd": fwd, "fwd+bwd": fwd_bwd, "bwd": backward_on_a_fresh_graph}
    return steps, OpResult(math.nan, math.nan, math.nan, [t.detach() if t is not None else None for t in out],
                           [gr.detach() for gr in grads], first, "", peak, host)


def _frees_what_it_saved(exc: Exception) -> bool:
    """A backward's RuntimeError on a second call over one graph, not an out-of-memory or CUDA
    error (those are failures of the side)."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError)
            and "CUDA error" not in str(exc))


def _time_in_rounds(sides: dict[str, dict], results: dict[str, OpResult], timer: Timer,
                    rounds: int) -> dict[str, Exception]:
    """Times every side's steps in alternating rounds and stores the median of each step's round
    times in results, so that a drift of the machine during a case falls on every side alike. The
    backward alone is timed on a graph built for it, freed before the next step (one side's graph
    at a time). A backward that frees what it saved (a RuntimeError on its second call, not out of
    memory or a CUDA error) is derived, (fwd+bwd) - fwd. -> {side: its exception} for the sides
    that failed (dropped from the later rounds)."""
    if rounds < 1:
        raise ValueError(f"rounds: at least 1, got {rounds}")
    times = {who: {step: [] for step in steps} for who, steps in sides.items()}
    failed: dict[str, Exception] = {}
    for _ in range(rounds):
        for who, steps in sides.items():
            for step, run in steps.items():
                if who in failed or times[who][step] is None:
                    continue
                timed = None
                try:
                    timed = run() if step == "bwd" else run
                    times[who][step].append(timer(timed))
                except Exception as exc:  # noqa: BLE001 - one failing side is a result
                    if step == "bwd" and _frees_what_it_saved(exc):
                        times[who][step] = None
                    else:
                        failed[who] = exc
                finally:
                    del timed
    for who, by_step in times.items():
        if who in failed:
            continue
        r = results[who]
        r.fwd_ms, r.fwdbwd_ms = statistics.median(by_step["fwd"]), statistics.median(by_step["fwd+bwd"])
        if by_step["bwd"] is None:
            r.bwd_ms, r.note = r.fwdbwd_ms - r.fwd_ms, "bwd = (fwd+bwd) - fwd"
        else:
            r.bwd_ms = statistics.median(by_step["bwd"])
    return failed


def _peak_mib(step, device) -> float | None:
    """MiB that one call of step allocates at its peak above what is live before it (CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    live = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - live) / 2**20


def _host_ms(step, device, calls: int = 5) -> float | None:
    """Median host time of one call of step, from its start to its return with the device idle
    before it (CUDA): where it comes close to the step's timed time, the timing measures this
    machine's host rather than the kernels."""
    if torch.device(device).type != "cuda":
        return None
    times = []
    for _ in range(calls):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def host_time_note(label: str, results: dict) -> str | None:
    """One line per case: each side's host ms of one fwd+bwd call beside its timed fwd+bwd."""
    parts = [f"{who} {r.host_ms:.3f} / {r.fwdbwd_ms:.3f}" for who, r in results.items()
             if r is not None and r.host_ms is not None]
    if not parts:
        return None
    return (f"host ms of one fwd+bwd call / its timed ms, {label}: " + ", ".join(parts)
            + " (where the two are close, that side times this machine's host, not its kernels)")


def peak_memory_note(label: str, results: dict) -> str | None:
    """One line per case: each side's peak MiB of one fwd+bwd (above the live set)."""
    parts = [f"{who} {r.peak_mib:.0f}" for who, r in results.items() if r is not None and r.peak_mib is not None]
    if not parts:
        return None
    return f"peak memory of one fwd+bwd above the live set, MiB, {label}: " + ", ".join(parts)


def with_per_key_gate(op):
    """Our op called as FLA's chunk_kda is: the gate argument is the per-key gk."""
    def kda(q, k, v, g, beta, **kwargs):
        return op(q, k, v, None, beta, gk=g, **kwargs)
    return kda


def run_op_case(case: OpCase, ours, fla, notes: list[str], device="cuda", timer: Timer | None = None,
                firsts: dict | None = None, qla: SimpleNamespace | None = None, rounds: int = ROUNDS) -> list[Row]:
    """Rows of one case: per direction, one row beside FLA ("-" without it) and, where FlashQLA
    loaded (qla), one beside FlashQLA; each peer's max_abs / max_rel are against our results.
    Every side is timed in `rounds` alternating rounds (_time_in_rounds)."""
    timer = timer or (lambda fn: time_ms(fn, warmup=25, rep=100))
    x = make_op_inputs(case, device, seed=case.T + case.H + case.B)
    fla_fn = None if fla is None else (getattr(fla, "kda", None) if case.per_key_gate else fla.op)
    peers = {PEER: (PEER if fla is not None else "-", fla_fn)}
    msgs: dict[str, list[str]] = {"ours": [], PEER: []}
    if qla is not None:
        no_path = flash_qla_no_path(case, qla)
        peers[QLA_PEER] = (QLA_PEER, None if no_path else qla.op)
        msgs[QLA_PEER] = [no_path] if no_path else []
    if case.per_key_gate and ours is not None:
        ours = with_per_key_gate(ours)
    if case.keep_states:
        ours = None if ours is None else functools.partial(ours, disable_recompute=True)
        peers = {who: (name, None if fn is None else functools.partial(fn, disable_recompute=True))
                 for who, (name, fn) in peers.items()}
    res: dict[str, OpResult | None] = {}
    steps = {}
    for who, fn in (("ours", ours), *((who, fn) for who, (_, fn) in peers.items())):
        res[who] = None
        if fn is None:
            continue
        try:
            steps[who], res[who] = _op_steps(fn, case, x, device)
        except Exception as exc:  # noqa: BLE001 - one failing configuration is a result
            msgs[who].append(_refusal(who, exc))
    for who, exc in _time_in_rounds(steps, res, timer, rounds).items():
        msgs[who].append(_refusal(who, exc))
        res[who] = None
    del steps
    if firsts is not None:
        firsts.update({(who, case.label): (case.label, r.first_s) for who, r in res.items() if r is not None})
    o = res["ours"]
    for line in (peak_memory_note(case.label, res), host_time_note(case.label, res)):
        if line:
            notes.append(line)
    acc = {}  # peer -> direction -> (max_abs, max_rel) against ours
    for who in peers:
        fwd = bwd = (None, None)
        if o is not None and res[who] is not None:
            fwd, bwd = compare_outputs(o.outputs, res[who].outputs), compare_outputs(o.grads, res[who].grads)
        acc[who] = {"fwd": fwd, "bwd": bwd, "fwd+bwd": _worst([a for a in (fwd, bwd) if a[0] is not None])}
    rows = []
    for direction, attr in (("fwd", "fwd_ms"), ("bwd", "bwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
        for who, (shown, _) in peers.items():
            p = res[who]
            extra = [f"{w} {res[w].note}" for w in ("ours", who)
                     if res[w] is not None and res[w].note and direction == "bwd"]
            rows.append(Row(f"{case.label} {direction}", shown, getattr(p, attr) if p else None,
                            getattr(o, attr) if o else None, *acc[who][direction],
                            note="; ".join(msgs["ours"] + msgs[who] + extra), seqlen=case.T,
                            direction=direction))
    del x, res, o
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_op(quick: bool = False, progress_factory=None, device="cuda", timer: Timer | None = None,
           cases: Sequence[str] | None = None, rounds: int = ROUNDS) -> tuple[list[Section], list[str]]:
    notes: list[str] = []
    plan = op_plan(quick, cases)
    ours = load_ours("chunk_gated_delta_rule", notes)
    fla = load_fla(notes)  # first: it sets FLA's dispatch switch before FLA is imported
    qla = load_flash_qla(notes)
    if fla is not None:
        families = len({c.family for c in plan})
        notes.append(f"FLA autotunes on the first call of each new shape family ({families} here, "
                     "about 75-110 s each on an H200); every case runs once untimed before timing")
    notes.append(f"each side timed in {rounds} alternating rounds per case (do_bench medians; the median of "
                 "the rounds)")
    bar = progress_factory(len(plan)) if progress_factory else None
    sec = Section(f"gated delta rule op (chunk_gated_delta_rule), bf16, g fp32, chunk {CHUNK}; "
                  "grads of q, k, v, g, beta (, h0); KDA rows: per-key gk beside FLA's chunk_kda")
    firsts: dict = {}
    for case in plan:
        sec.rows += run_op_case(case, ours, fla, notes, device, timer, firsts, qla, rounds)
        if bar:
            bar.update()
    if bar:
        bar.close()
    for peer, direction in itertools.product((PEER, QLA_PEER), ("fwd", "bwd", "fwd+bwd")):
        line = overall_geomean_note(f"op {direction}", [Section("", [r for r in sec.rows
                                                                     if r.direction == direction])],
                                    peer=peer)
        if line:
            notes.append(line)
    line = _first_call_note("op", firsts)
    if line:
        notes.append(line)
    return [sec], notes


def run(quick: bool = False, progress_factory=None) -> tuple[list[Section], list[str]]:
    """Both benchmarks (the op, then bwd_dhu)."""
    s1, n1 = run_op(quick, progress_factory)
    s2, n2 = run_dhu(quick, progress_factory)
    return s1 + s2, n1 + [n for n in n2 if n not in n1]
