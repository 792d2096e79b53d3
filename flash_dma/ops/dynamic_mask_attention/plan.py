"""Every choice of a dynamic mask attention call, made in one place.

plan_forward and plan_backward turn the call's problem (shapes, flags), its mask and bias and the
device into one frozen plan: the backend, each kernel pass's launch configuration (a
runtime.config.Chosen naming its source: table, tuning cache, rule, override, interpreter), how
each pass walks the keys, where dq comes from, and how dbias is reduced. The backend's launchers
(triton/) read the plan and decide nothing.

Strategy choices are declared below (runtime.config.declare_choice); tests and benchmarks change
them only through runtime.config.overrides(...), never through module globals:
    attention_backend               "auto", "triton" or "cute" (FLASH_DMA_BACKEND when not
                                    overridden; cute/select.py decides what "auto" runs)
    attention_dq_strategy           "fused", "atomic" or "kernel"
    attention_all_tiles_list_walk   True or False
    attention_dbias_by_descriptor   True or False
and each kernel's launch configuration by its kernel name (attn_fwd, attn_bwd_dkdv, attn_bwd_dq).

With FLASH_DMA_PROFILE=1 each pass logs its choice once per shape class (runtime/profile.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...runtime import profile, tma
from ...runtime.config import Chosen, LaunchConfig, ceil_div, choice, config_name, declare_choice, \
    head_dim_block, overridden
from ...runtime.hardware import device_info
from . import sparsity
from .cute.masked import BiasPath, backward_gap as masked_backward_gap, bias_path, dbias_reduce, \
    tma_layout
from .cute.select import BACKEND_CHOICES, auto_backward_on_triton, bias_layout, choose_backend, \
    requested_backend
from .launch_table import select_config
from .triton.host import DESCRIPTOR_MAX_HEAD_DIM, before_hopper, pair_tile_strides

declare_choice("attention_backend", "auto", BACKEND_CHOICES,
               "which backend runs dynamic mask attention: 'auto' (CuTe where it serves the call "
               "on SM90 with the hopper extra, else Triton), 'triton' or 'cute'; unset, "
               "FLASH_DMA_BACKEND decides")
declare_choice("attention_dq_strategy", "fused", ("fused", "atomic", "kernel"),
               "where dq comes from when dS is not stored: the key-major kernel adds dS k into an "
               "fp32 accumulator (TMA bulk reductions where the GPU has them: 'fused'; element "
               "atomics always: 'atomic'), or a separate query-major kernel ('kernel')")
declare_choice("attention_all_tiles_list_walk", True, (True, False),
               "without a mask, the key-major backward walks block lists of every tile instead of "
               "its dense walk (fixed lengths, padded head dim <= 128)")
declare_choice("attention_dbias_by_descriptor", True, (True, False),
               "a full-shape dbias goes out by TMA stores (Hopper, padded head dim <= 128)")

# Fused dq pays up to padded head dim 128; at 256 the key-major kernel spills with the extra
# product, so 'fused' hands dq to the separate kernel there (the 'atomic' choice does not).
FUSED_DQ_MAX_HEAD_DIM = 128
# The delta pass's query rows per program (the interpreter: small blocks)
DELTA_BLOCK_M_GPU = 128
DELTA_BLOCK_M_INTERPRETER = 16


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """Shapes and flags of one call, in the kernels' terms (the padded and the packed layouts
    both lower to it, so they share every line of launch code)."""
    batch: int  # B, or the number of packed sequences
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seqlen_q: int  # fixed length, or max_seqlen_q for varlen
    seqlen_k: int
    is_varlen: bool
    is_causal: bool
    softmax_scale: float
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None

    @property
    def block_d(self) -> int:
        """The head dim padded as the kernels hold it."""
        return head_dim_block(self.head_dim)

    @property
    def kv_group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def row_strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, token, head) strides of q/k/v-like tensors; varlen has no batch axis."""
        s = t.stride()
        if self.is_varlen:
            return 0, s[0], s[1]
        return s[0], s[1], s[2]

    def stat_strides(self, lse: torch.Tensor) -> tuple[int, int]:
        """lse/delta: [B, H, Sq] (batch, head strides) or varlen [H, total_q]."""
        if self.is_varlen:
            return 0, lse.stride(0)
        return lse.stride(0), lse.stride(1)

    def stat_shape(self, total_q: int) -> tuple[int, ...]:
        if self.is_varlen:
            return (self.num_heads, total_q)
        return (self.batch, self.num_heads, self.seqlen_q)


@dataclass(frozen=True, eq=False)
class PassPlan:
    """One kernel pass: its launch configuration and how it walks the keys (or, key-major, the
    queries)."""
    kernel: str  # the launch table's kernel name: attn_fwd, attn_bwd_dkdv, attn_bwd_dq
    variant: str  # the launch table's variant key
    config: Chosen  # a LaunchConfig, and where it came from
    kv_mode: int  # sparsity.KV_DENSE / KV_BLOCK_LIST / KV_GATHERED
    key_major: bool
    all_tiles: bool  # block lists of every tile (no mask), not lists made from the mask
    problem: AttentionProblem

    @property
    def cfg(self) -> LaunchConfig:
        return self.config.value

    def key_walk(self, mask: torch.Tensor | None, device: torch.device) -> sparsity.KeyWalk:
        """The lists this pass walks, for its tile sizes (remembered per mask and shape)."""
        pb, cfg = self.problem, self.cfg
        walk_args = dict(num_heads=pb.num_heads, seqlen_q=pb.seqlen_q, seqlen_k=pb.seqlen_k,
                         is_causal=pb.is_causal, block_m=cfg.block_m, block_n=cfg.block_n,
                         key_major=self.key_major, device=device)
        if self.all_tiles:
            return sparsity.all_tiles_walk(**walk_args)
        return sparsity.cached_key_walk(mask, self.kv_mode, cu_seqlens_q=pb.cu_q,
                                        cu_seqlens_k=pb.cu_k, **walk_args)


@dataclass(frozen=True)
class DbiasPlan:
    """How dbias is reduced over the dims the bias broadcasts, and where the kernel writes it.

    Within one program, reductions along queries (and keys of one tile) happen in registers.
    Contributions from several programs or heads to one entry (a bias shared by batch or by the
    query heads of a group, or broadcast along keys) are added with fp32 atomics ("atomic"), or,
    when deterministic, written to per-contributor slots summed in a fixed order afterwards
    ("slots"); otherwise each entry has one writer ("store")."""
    reduce: str  # "store", "atomic" or "slots"
    zero_fill: bool  # "store": entries no program writes (skipped tiles, padding) must read 0
    num_slots: int
    slot_strides: tuple[int, int, int]  # element offsets per (batch, head-in-share, key block)
    by_descriptor: bool  # "store" of whole tiles by TMA

    @property
    def atomic(self) -> bool:
        return self.reduce == "atomic"

    @property
    def slotted(self) -> bool:
        return self.reduce == "slots"

    def allocate(self, bias: torch.Tensor) -> torch.Tensor:
        if self.reduce == "store":
            alloc = torch.zeros if self.zero_fill else torch.empty
            return alloc(bias.shape, device=bias.device, dtype=bias.dtype)
        if self.reduce == "atomic":
            return torch.zeros(bias.shape, device=bias.device, dtype=torch.float32)
        return torch.zeros((self.num_slots, *bias.shape), device=bias.device, dtype=torch.float32)

    def finish(self, buffer: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        grad = buffer.sum(0) if self.slotted else buffer
        return grad.to(bias.dtype)


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    backend: Chosen
    problem: AttentionProblem
    kv_mode: int  # the forward's walk; the backward's passes start from it
    forward: PassPlan


@dataclass(frozen=True, eq=False)
class BackwardPlan:
    backend: Chosen
    problem: AttentionProblem
    kv_mode: int  # the forward's walk (the dq kernel's too)
    deterministic: bool
    dq_strategy: Chosen  # "matmul", "fused" or "kernel"
    dq_by_tma_reduce: bool  # fused: bulk reductions where the device has them (else atomics)
    zero_dq_in_delta: bool  # the delta pass clears the fp32 dq accumulator
    delta_block_m: int
    dkdv: PassPlan
    dkdv_key_programs: int
    dq: PassPlan | None  # the query-major dq kernel, where dq_strategy is "kernel"
    dbias: DbiasPlan | None


def _forward_variant(q: torch.Tensor, mask, bias) -> str:
    if bias is not None:
        return "bias" if bias.element_size() == q.element_size() else "bias-fp32"
    return "plain" if mask is not None else "plain-dense"


@dataclass(frozen=True, eq=False)
class CutePlan:
    """A call the CuTe backend runs (cute/backend.py): FA4 takes its launch choices itself; the
    plan says how dbias is reduced ("store", "atomic", or None without dbias) and how the
    kernels take a bias."""
    backend: Chosen
    problem: AttentionProblem
    deterministic: bool = False
    dbias_reduce: str | None = None
    bias_path: BiasPath | None = None
    chosen_by_auto: bool = False  # the backward then follows auto's rules too


def _requested() -> tuple[str, bool]:
    """(the backend asked for, whether by an override)."""
    forced = overridden("attention_backend")
    return (forced if forced is not None else requested_backend()), forced is not None


def _backend(pb: AttentionProblem, q: torch.Tensor, mask, bias) -> Chosen:
    requested, forced = _requested()
    key_wise = (mask is not None and requested != "triton"
                and sparsity.choose_mode(mask, pb.num_heads, pb.num_kv_heads) == sparsity.KV_GATHERED)
    name, reason = choose_backend(q.device, mask is not None, bias is not None, pb.head_dim,
                                  q.dtype, pb.is_varlen, requested, key_wise_mask=key_wise,
                                  bias_kind=bias_layout(bias))
    if name != "cute" and requested == "cute":
        profile.log_fallback("attention", "the CuTe backend", "Triton", reason)
    return Chosen(name, ("override, " if forced else "") + reason)


def _log_cute(pass_name: str, pb: AttentionProblem, device, mask, bias, backend: Chosen,
              bias_path: BiasPath | None, extra: tuple = ()) -> None:
    heads_word = lambda t: "H" if t is None or t.shape[1] == pb.num_heads else "Hk"  # noqa: E731
    path = ("fa4-plain" if mask is None and bias is None else "fa4-hooks")
    if bias_path is not None and (bias_path.direct_forward if pass_name == "fwd"
                                  else bias_path.direct_backward):
        path = "fa4-direct-bias" + (f"-{bias_path.prefetch}" if pass_name == "fwd" else "")
    profile.log_choice("attention", pass_name, "cute", device_info(device),
                       (("D", pb.head_dim), ("Sq", pb.seqlen_q), ("Sk", pb.seqlen_k),
                        ("B", pb.batch), ("H", pb.num_heads), ("Hk", pb.num_kv_heads),
                        ("varlen", pb.is_varlen), ("causal", pb.is_causal),
                        ("mask", _pair_shape(mask, ("B", heads_word(mask), "Sq", "Sk"))),
                        ("bias", _pair_shape(bias, ("B", heads_word(bias), "Sq", "Sk")))) + extra,
                       path, backend.source)


def plan_forward(pb: AttentionProblem, q: torch.Tensor, mask, bias) -> ForwardPlan | CutePlan:
    backend = _backend(pb, q, mask, bias)
    if backend.value == "cute":
        path = (bias_path(pb.head_dim, pb.is_causal, tma_layout(mask, bias),
                          tma_layout(mask, bias, loadable=True))
                if bias is not None else None)
        if profile.active():
            _log_cute("fwd", pb, q.device, mask, bias, backend, path)
        return CutePlan(backend, pb, bias_path=path, chosen_by_auto=_requested()[0] == "auto")
    return _triton_forward_plan(pb, q, mask, bias, backend)


def _triton_forward_plan(pb: AttentionProblem, q: torch.Tensor, mask, bias,
                         backend: Chosen) -> ForwardPlan:
    kv_mode = sparsity.choose_mode(mask, pb.num_heads, pb.num_kv_heads)
    variant = _forward_variant(q, mask, bias)
    cfg = select_config("attn_fwd", q.device, pb.head_dim, q.dtype, variant)
    fwd = PassPlan("attn_fwd", variant, cfg, kv_mode, False, False, pb)
    if profile.active():
        _log("fwd", backend, pb, q.device, mask, bias, cfg, ())
    return ForwardPlan(backend, pb, kv_mode, fwd)


def _dq_strategy(pb: AttentionProblem, q, bias, want_dbias: bool, kv_mode: int,
                 deterministic: bool) -> Chosen:
    """Where dq comes from: "matmul" (dS is stored anyway, as a full-shape dbias in q's dtype, and
    every tile is computed: dq = scale * dS k is one batched matmul), "fused" (the key-major
    kernel adds dS k into an fp32 accumulator: five matrix products in the backward instead of
    the seven that a separate query-major dq kernel needs, which recomputes q k^T and dO v^T), or
    "kernel" (that separate kernel: deterministic mode, since the accumulation order of atomics
    is not, and head dims where fusing is slower)."""
    if (want_dbias and not pb.is_varlen and kv_mode == sparsity.KV_DENSE and bias.dtype == q.dtype
            and tuple(bias.shape) == (pb.batch, pb.num_heads, pb.seqlen_q, pb.seqlen_k)):
        return Chosen("matmul", "rule")  # (such a bias is never shared across programs)
    if deterministic:
        return Chosen("kernel", "rule")
    wanted = choice("attention_dq_strategy")
    if wanted.value == "kernel":
        return Chosen("kernel", wanted.source)
    if wanted.value == "fused" and pb.block_d > FUSED_DQ_MAX_HEAD_DIM:
        return Chosen("kernel", "rule")
    return Chosen("fused", wanted.source)


def _bias_sharing(pb: AttentionProblem, shape) -> tuple[bool, int]:
    """(one bias entry serves every batch, query heads per bias head)."""
    return shape[0] == 1 and pb.batch > 1, pb.num_heads // shape[1]


def _dbias_by_descriptor(pb: AttentionProblem, bias: torch.Tensor) -> bool:
    """Whether the key-major kernel writes dbias by TMA stores: its buffer (fresh, packed, the
    bias's shape) is then written tile by tile by one program each (no batch or head sharing, no
    atomics or slots) and a descriptor can describe it."""
    if not choice("attention_dbias_by_descriptor").value or pb.is_varlen \
            or before_hopper(bias.device) or pb.block_d > DESCRIPTOR_MAX_HEAD_DIM:
        return False
    batch_shared, head_share = _bias_sharing(pb, bias.shape)
    _, H, Sq, Sk = bias.shape
    strides = pair_tile_strides(bias.shape, (H * Sq * Sk, Sq * Sk, Sk, 1))  # the packed buffer's
    return (not batch_shared and head_share == 1 and strides is not None
            and tma.strides_aligned16(strides, bias.element_size()))


def _plan_dbias(pb: AttentionProblem, bias: torch.Tensor, n_key_programs: int, kv_mode: int,
                deterministic: bool, by_descriptor: bool) -> DbiasPlan:
    shape = bias.shape
    batch_shared, head_share = _bias_sharing(pb, shape)
    key_shared = shape[3] == 1 and n_key_programs > 1
    if not (batch_shared or head_share > 1 or key_shared):
        complete = kv_mode == sparsity.KV_DENSE and not pb.is_causal and not pb.is_varlen
        return DbiasPlan("store", not complete, 1, (0, 0, 0), by_descriptor)
    if not deterministic:
        return DbiasPlan("atomic", False, 1, (0, 0, 0), False)
    n_n = n_key_programs if key_shared else 1
    n_h = head_share if head_share > 1 else 1
    n_b = pb.batch if batch_shared else 1
    numel = math.prod(shape)
    slot_n = numel if key_shared else 0
    slot_h = n_n * numel if head_share > 1 else 0
    slot_b = n_h * n_n * numel if batch_shared else 0
    return DbiasPlan("slots", False, n_b * n_h * n_n, (slot_b, slot_h, slot_n), False)


def plan_backward(fwd: ForwardPlan | CutePlan, q: torch.Tensor, mask, bias, want_dbias: bool,
                  deterministic: bool) -> BackwardPlan | CutePlan:
    if isinstance(fwd, CutePlan):
        fwd = _cute_backward_or_triton(fwd, q, mask, bias, want_dbias, deterministic)
        if isinstance(fwd, CutePlan):
            return fwd
    pb, kv_mode = fwd.problem, fwd.kv_mode
    dq_strategy = _dq_strategy(pb, q, bias, want_dbias, kv_mode, deterministic)
    fused = dq_strategy.value == "fused"
    variant = "bias" if bias is not None else "plain"

    # the key-major pass: without a mask it walks block lists of every tile where that is faster
    # than its dense walk (not with a bias broadcast along queries, nor varlen: lists would be
    # made per call)
    all_tiles = (choice("attention_all_tiles_list_walk").value and kv_mode == sparsity.KV_DENSE
                 and mask is None and (bias is None or dq_strategy.value == "matmul")
                 and not pb.is_varlen and pb.block_d <= 128)
    key_mode = sparsity.KV_BLOCK_LIST if all_tiles else kv_mode
    every_tile_full = all_tiles and not pb.is_causal
    # (gathered key tiles are not contiguous in the bias: pointer stores there)
    dbias_tma = (want_dbias and kv_mode != sparsity.KV_GATHERED
                 and _dbias_by_descriptor(pb, bias))
    dkdv_variant = (variant + ("-dbtma" if dbias_tma else "") + ("-dq" if fused else "")
                    + ("-list" if key_mode == sparsity.KV_BLOCK_LIST else "")
                    + ("-full" if every_tile_full else "")
                    + ("-fp32" if bias is not None and bias.element_size() > q.element_size() else ""))
    dkdv_cfg = select_config("attn_bwd_dkdv", q.device, pb.head_dim, q.dtype, dkdv_variant)
    dkdv = PassPlan("attn_bwd_dkdv", dkdv_variant, dkdv_cfg, key_mode, True, all_tiles, pb)
    n_key_programs = max(ceil_div(pb.seqlen_k, dkdv_cfg.value.block_n), 1)
    dbias = (_plan_dbias(pb, bias, n_key_programs, kv_mode, deterministic, dbias_tma)
             if want_dbias else None)

    dq = None
    if dq_strategy.value == "kernel":
        dq_cfg = select_config("attn_bwd_dq", q.device, pb.head_dim, q.dtype, variant)
        dq = PassPlan("attn_bwd_dq", variant, dq_cfg, kv_mode, False, False, pb)

    plan = BackwardPlan(
        backend=fwd.backend, problem=pb, kv_mode=kv_mode, deterministic=deterministic,
        dq_strategy=dq_strategy,
        dq_by_tma_reduce=choice("attention_dq_strategy").value != "atomic",
        zero_dq_in_delta=fused and not pb.is_varlen,
        delta_block_m=DELTA_BLOCK_M_GPU if q.device.type == "cuda" else DELTA_BLOCK_M_INTERPRETER,
        dkdv=dkdv, dkdv_key_programs=n_key_programs, dq=dq, dbias=dbias)
    if profile.active():
        walk = sparsity.WALK_NAMES[key_mode]
        dbias_field = (("dbias", dbias.reduce + ("-tma" if dbias.by_descriptor else "")),) \
            if dbias is not None else ()
        _log("bwd_dkdv", fwd.backend, pb, q.device, mask, bias, dkdv_cfg,
             (("walk", walk), ("dq", dq_strategy.value)) + dbias_field)
        if dq is not None:
            _log("bwd_dq", fwd.backend, pb, q.device, mask, bias, dq.config,
                 (("walk", sparsity.WALK_NAMES[kv_mode]),))
    return plan


def _cute_backward_or_triton(fwd: CutePlan, q: torch.Tensor, mask, bias, want_dbias: bool,
                             deterministic: bool) -> CutePlan | ForwardPlan:
    """The CuTe backward where it serves the call; else (a dbias or a deterministic mode that it
    lacks) the Triton forward plan to build the Triton backward from, logged: the Triton
    backward reads the CuTe forward's out and lse as its own (same layout and conventions)."""
    pb = fwd.problem
    if mask is None and bias is None:
        plan = CutePlan(fwd.backend, pb, deterministic)
    else:
        gap = masked_backward_gap(seqlen_q=pb.seqlen_q, seqlen_k=pb.seqlen_k, batch=pb.batch,
                                  num_heads=pb.num_heads, mask=mask, bias=bias,
                                  want_dbias=want_dbias, deterministic=deterministic,
                                  head_dim=pb.head_dim, path=fwd.bias_path)
        if gap is not None:
            profile.log_fallback("attention", "the CuTe backward", "Triton", gap)
            return _triton_forward_plan(pb, q, mask, bias, Chosen("triton", f"CuTe backward: {gap}"))
        reduce = dbias_reduce(pb.batch, pb.num_heads, bias) if want_dbias else None
        if bias is not None and fwd.chosen_by_auto:
            why = auto_backward_on_triton(mask is not None, pb.head_dim, bias_layout(bias), reduce)
            if why is not None:  # a choice, not a fallback: the Triton backward leads here
                return _triton_forward_plan(pb, q, mask, bias, Chosen("triton", why))
        plan = CutePlan(fwd.backend, pb, deterministic, reduce, fwd.bias_path, fwd.chosen_by_auto)
    if profile.active():
        _log_cute("bwd", pb, q.device, mask, bias, fwd.backend, plan.bias_path,
                  (("dbias", plan.dbias_reduce),) if plan.dbias_reduce else ())
    return plan


_MASK_KINDS = {sparsity.KV_DENSE: "none", sparsity.KV_BLOCK_LIST: "tiles",
               sparsity.KV_GATHERED: "keys"}


def _pair_shape(t: torch.Tensor | None, words: tuple[str, str, str, str]) -> str:
    """A mask or bias shape as the log names it: B,H,Sq,Sk with 1 for broadcast dims (Hk for a
    bias per kv head)."""
    if t is None:
        return "none"
    return ",".join(w if n != 1 or w == "1" else "1" for w, n in zip(words, t.shape))


def _log(pass_name: str, backend: Chosen, pb: AttentionProblem, device, mask, bias,
         cfg: Chosen, extra: tuple) -> None:
    heads_word = lambda t: "H" if t is None or t.shape[1] == pb.num_heads else "Hk"  # noqa: E731
    mask_kind = "none" if mask is None else _MASK_KINDS[
        sparsity.choose_mode(mask, pb.num_heads, pb.num_kv_heads)]
    shape = (("D", pb.head_dim), ("Sq", pb.seqlen_q), ("Sk", pb.seqlen_k), ("B", pb.batch),
             ("H", pb.num_heads), ("Hk", pb.num_kv_heads),
             ("varlen", pb.is_varlen), ("causal", pb.is_causal), ("mask", mask_kind),
             ("bias", _pair_shape(bias, ("B", heads_word(bias), "Sq", "Sk")))) + extra
    profile.log_choice("attention", pass_name, backend.value, device_info(device), shape,
                       config_name(cfg.value), cfg.source)


def describe(shape: str, device: torch.device | None = None) -> list[str]:
    """What would run for a shape such as 'B=2 S=4096 H=16 Hk=16 D=128 bias=B,H,S,S causal'
    (also Sq=, Sk=, mask=B,H,S,S or mask=B,Hk,1,S, dtype=fp16; no data is allocated): one line
    per pass, as the profiling log prints them. For `flash-dma env --attention`."""
    fields = dict(part.split("=", 1) if "=" in part else (part, "1") for part in shape.split())
    sq = int(fields.get("Sq", fields.get("S", 1024)))
    sk = int(fields.get("Sk", fields.get("S", sq)))
    b, h = int(fields.get("B", 1)), int(fields.get("H", 16))
    hk, d = int(fields.get("Hk", h)), int(fields.get("D", 128))
    dtype = torch.float16 if fields.get("dtype") == "fp16" else torch.bfloat16
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = {"B": b, "H": h, "Hk": hk, "S": sq, "Sq": sq, "Sk": sk, "1": 1}

    def stand_in(kind: str, dt):  # a tensor of the shape without memory behind it (stride 0)
        if kind not in fields:
            return None
        dims = fields[kind].split(",")
        if len(dims) != 4:
            raise ValueError(f"{kind}: expected 4 dims such as B,H,S,S, got {fields[kind]!r}")
        dims[3] = "Sk" if dims[3] == "S" else dims[3]
        return torch.empty((), device=device, dtype=dt).expand([sizes[x] for x in dims])

    q = torch.empty((), device=device, dtype=dtype).expand(b, sq, h, d)
    mask, bias = stand_in("mask", torch.bool), stand_in("bias", dtype)
    pb = AttentionProblem(b, h, hk, d, sq, sk, False, "causal" in fields, 1.0 / math.sqrt(d),
                          None, None)
    fwd = plan_forward(pb, q, mask, bias)
    bwd = plan_backward(fwd, q, mask, bias, bias is not None, False)
    lines = [f"backend {fwd.backend.value} ({fwd.backend.source})"]
    direct_bias = bias is not None and choice("attention_cute_direct_bias").value
    if isinstance(fwd, CutePlan) and isinstance(bwd, CutePlan):
        what = ("plain attention" if mask is None and bias is None else
                "our bias hooks" if mask is None else
                "our mask hook and tile lists" + (", bias hooks" if bias is not None else ""))
        lines.append(f"forward and backward: FlashAttention-4's SM90 kernels ({what})")
        if direct_bias:
            lines.append("forward bias: added at the score fragment's coordinates (cute/forward_bias.py)")
        if bwd.dbias_reduce is not None:
            lines.append(f"dbias: {bwd.dbias_reduce}")
        return lines
    if isinstance(fwd, CutePlan):
        what = "the bias at the score fragment's coordinates" if direct_bias else "our mask/bias hooks"
        lines.append(f"forward: FlashAttention-4's SM90 kernels ({what}); "
                     f"backward: Triton ({bwd.backend.source})")
        fwd = None
    for p in ((fwd.forward,) if fwd is not None else ()) + (bwd.dkdv, bwd.dq):
        if p is not None:
            lines.append(f"{p.kernel}: {config_name(p.cfg)} ({p.config.source}; variant "
                         f"{p.variant!r}, walk {sparsity.WALK_NAMES[p.kv_mode]})")
    lines.append(f"dq: {bwd.dq_strategy.value} ({bwd.dq_strategy.source})")
    if bwd.dbias is not None:
        lines.append(f"dbias: {bwd.dbias.reduce}" + (" by TMA stores" if bwd.dbias.by_descriptor else ""))
    return lines
