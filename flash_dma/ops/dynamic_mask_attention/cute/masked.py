"""Attention with a keep-mask and/or an additive bias (and dbias) on SM90, through FA4's CuTe DSL
kernels with our hooks (hooks.py) and our tile lists (block_sparse.py).

What this serves: fixed-length fp16/bf16 at head dims 64, 128 and 256, GQA/MQA, bottom-right
causal, mask and bias in every broadcast shape of the contract, fully masked rows (out 0, lse
+inf, zero gradients), dbias where the bias has full query and key dims (stored directly when it
has one writer per entry, else added into an fp32 buffer of the bias's own shape and cast).
What it does not (the plan runs Triton instead, logged; see `feature_gap`, `backward_gap`):
varlen with a mask or bias, other head dims (FA4's D192 backward tiles are not validated here),
dbias of a bias broadcast along queries or keys (one fp32 atomic per score into a row or column
is slower than the Triton backward's register reductions), and deterministic=True with a mask
or an atomic dbias (FA4's ordered block-sparse dq needs write-order metadata we do not build).

How the pieces meet FA4:
- bias: in the forward, forward_bias.py's class adds bias[b, h, q, kv] to the scaled score
  from each thread's fragment coordinates; in the backward, backward_bias.py's class re-adds it
  and writes dbias from dS the same way (FA4's generic score_mod / score_mod_bwd hooks, hooks.py,
  where the declared choices turn these off). Bias-only calls keep FA4's own causal handling and
  tiles. The plan resolves the choices once per call into a `BiasPath`.
- mask: mask_mod reads the mask (as uint8) with the causal rule folded in (FA4 turns its causal
  off when given a mask_mod), and the tile lists make both passes skip empty tiles and skip the
  mask_mod on full ones.
- aux tensors: views in the full problem shape with stride 0 on broadcast dims (hooks.py), so
  one compiled kernel per broadcast pattern serves every length.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from ....runtime import profile
from ....runtime.config import choice, declare_choice
from ....runtime.hardware import device_guard
from . import block_sparse, plain

MASKED_HEAD_DIMS = (64, 128, 256)

# The bias's element type as forward_bias.py names it (a cutlass type)
CUTLASS_TYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}

# Fixed aux slots: the hooks index FA4's aux tensor list by these.
BIAS_SLOT, MASK_SLOT, DBIAS_SLOT = 0, 1, 2


# The bias hooks: the backward's GQA fault (FA4 b36's SM90 backward hands them GQA-packed
# indices, unfolded in hooks.py) fixed and checked on the GPU over cute_masked_check's grid
# (bench/results/cute-masked-NVIDIA-H200-20261126.txt, last section: every bias shape, GQA, causal, fp32 bias,
# stored and atomic dbias). The choice stays so that debugging can turn the path off; the
# auto rule (select.py) still keeps biases on Triton, whose forward measured faster.
BIAS_GAP = "the CuTe backend's bias path is turned off (declared choice attention_cute_bias)"
declare_choice("attention_cute_bias", True, (False, True),
               "let a forced CuTe backend take a bias through its score_mod hooks (auto keeps "
               "biases on Triton either way)")


declare_choice("attention_cute_direct_bias", True, (False, True),
               "the CuTe forward adds the bias from the score fragment's coordinates "
               "(cute/forward_bias.py) instead of through FA4's per-element score_mod hook")
declare_choice("attention_cute_direct_bias_backward", True, (False, True),
               "the CuTe backward re-adds the bias and writes dbias at the score fragments' "
               "coordinates (cute/backward_bias.py) instead of through FA4's per-element hooks")
declare_choice("attention_cute_bias_prefetch", "auto", ("auto", "none", "L2", "L1", "registers", "tma"),
               "the direct-bias forward prefetches the next key tile's bias: its lines to this "
               "cache level, or (\"registers\", with paired loads) its values into registers, or "
               "(\"tma\", a bias with full query and key dims) whole tiles into shared memory by "
               "TMA from a producer warp (cute/forward_bias_tma.py); auto: tma for such a bias at "
               "head dims 64 and 128 without causal, else registers at head dim 128 without "
               "causal, else L2")
declare_choice("attention_cute_bias_tma_evict_first", False, (False, True),
               "the TMA bias forward's loads ask L2 to evict the bias first (read once), keeping "
               "K and V resident")
declare_choice("attention_cute_dbias_tma", True, (False, True),
               "the CuTe backward stores dbias by TMA from the dS tile FA4 keeps in shared memory "
               "(cute/backward_bias_tma.py; one writer per entry, keys a multiple of 8)")
declare_choice("attention_cute_bias_tma_backward", True, (False, True),
               "the CuTe backward loads each round's bias tile by TMA into FA4's shared dS stage "
               "it is about to write (cute/backward_bias_tma.py; a bias in q's dtype with full "
               "query and key dims, keys a multiple of 8)")
declare_choice("attention_cute_bias_pairs", True, (False, True),
               "the direct-bias forward reads two neighbouring keys per load (where the bias's "
               "layout keeps every pair aligned, checked in the kernel)")

# The register prefetch holds a key tile's bias in each consumer thread: spill-free only at head
# dim 128 without causal (ptxas), where it led the L2 prefetch; at 64 and 256, and causal at 128,
# its spills made it slower (bench/results/cute-bias-20261126.txt, sections 1 and 2).
REGISTER_PREFETCH_HEAD_DIMS = (128,)
# The TMA bias forward: FA4 4.0.0b36's SM90 forward tiles leave room for two bias stages at
# these head dims (192x128 at D64, 128x128 at D128; D256's 128x80 leaves 2 KB); it led the
# register and L2 forms at both without causal (bench/results/cute-bias-20261126.txt, section
# 2). Under causal its times scattered between runs of one process (D128: 0.32 to
# 0.53 ms against the L2 form's steady 0.41), so auto keeps causal calls on the L2 form until that
# is understood.
TMA_BIAS_HEAD_DIMS = (64, 128)
# The TMA dbias store: FA4 4.0.0b36's SM90 backward double-buffers its dS tile at these head dims
# (the store's wait and the tile's next write are two rounds apart).
TMA_DBIAS_HEAD_DIMS = (64, 128)
# dbias of a bias broadcast along queries, summed per key tile in registers (backward_bias.py):
# where FA4 4.0.0b36's SM90 backward computes the scores transposed (keys as rows).
SUM_QUERIES_HEAD_DIMS = (64, 96, 128)


@dataclasses.dataclass(frozen=True)
class BiasPath:
    """How the CuTe kernels take a bias, resolved once per call from the declared choices (the
    plan carries it; masked.forward/backward read nothing else)."""
    direct_forward: bool
    pairs: bool  # still subject to the bias's layout (forward_bias.keys_contiguous)
    prefetch: str  # "none", "L2", "L1", "registers" or "tma"
    direct_backward: bool
    tma_evict_first: bool = False
    dbias_tma: bool = False
    bias_tma_backward: bool = False


def bias_path(head_dim: int, causal: bool, tma_layout: bool, tma_loadable: bool | None = None) -> BiasPath:
    """tma_layout: the bias has full query and key dims and comes without a mask, what the TMA
    form needs besides alignment (masked.forward checks that, and falls back logged);
    tma_loadable: TMA can also load it as it lies in memory (auto takes the TMA form only then;
    None: as tma_layout)."""
    prefetch = choice("attention_cute_bias_prefetch").value
    pairs = choice("attention_cute_bias_pairs").value
    loadable = tma_layout if tma_loadable is None else tma_loadable
    if prefetch == "auto" and loadable and head_dim in TMA_BIAS_HEAD_DIMS and not causal:
        prefetch = "tma"
    elif prefetch == "auto" or (prefetch == "tma" and not tma_layout):
        registers = head_dim in REGISTER_PREFETCH_HEAD_DIMS and not causal and pairs
        prefetch = "registers" if registers else "L2"
    return BiasPath(direct_forward=choice("attention_cute_direct_bias").value, pairs=pairs,
                    prefetch=prefetch,
                    direct_backward=choice("attention_cute_direct_bias_backward").value,
                    tma_evict_first=choice("attention_cute_bias_tma_evict_first").value,
                    dbias_tma=choice("attention_cute_dbias_tma").value,
                    bias_tma_backward=choice("attention_cute_bias_tma_backward").value)


def feature_gap(*, has_mask: bool, has_bias: bool, head_dim: int, dtype: torch.dtype,
                varlen: bool, key_wise_mask: bool = False) -> str | None:
    """None when this path computes the forward of such a call; else why not (device and
    software not looked at). key_wise_mask: the mask is one the Triton backend walks by gathered
    keys (sparsity.KV_GATHERED): it costs O(Sq * kept keys) there, while FA4 computes every tile
    holding a kept key, so such masks stay on Triton."""
    what = "mask and bias" if has_mask and has_bias else ("mask" if has_mask else "bias")
    if has_bias and not choice("attention_cute_bias").value:
        return BIAS_GAP
    if varlen:
        return f"the CuTe backend has no varlen path with a {what} yet"
    if has_mask and key_wise_mask:
        return ("a key-wise mask runs on the Triton backend's gathered keys (O(Sq * kept keys)); "
                "the CuTe backend would compute every tile holding a kept key")
    if dtype not in plain.PLAIN_DTYPES:
        return f"the CuTe backend takes fp16 or bf16, not {dtype}"
    if head_dim not in MASKED_HEAD_DIMS:
        return (f"the CuTe backend's {what} path is validated for head dims "
                f"{', '.join(map(str, MASKED_HEAD_DIMS))}, not {head_dim}")
    return None


def dbias_reduce(batch: int, num_heads: int, bias: torch.Tensor) -> str:
    """"store" where each dbias entry has one writer (a bias per batch and query head), else
    "atomic" (shared across batches or query heads). Query/key broadcast: see backward_gap."""
    if (bias.shape[0] == 1 and batch > 1) or bias.shape[1] != num_heads:
        return "atomic"
    return "store"


def sums_queries(bias, seqlen_q: int) -> bool:
    """Whether dbias sums dS over queries (a bias broadcast along them: backward_bias.py)."""
    return bias is not None and bias.shape[2] == 1 and seqlen_q > 1


def backward_gap(*, seqlen_q: int, seqlen_k: int, batch: int, num_heads: int, mask, bias,
                 want_dbias: bool, deterministic: bool, head_dim: int,
                 path: BiasPath | None = None) -> str | None:
    """None when this path computes the backward; else why not. path: the call's bias choices
    (`bias_path` when None)."""
    if want_dbias and bias.shape[3] == 1 and seqlen_k > 1:
        return ("the CuTe backend computes no dbias for a bias broadcast along keys "
                f"(bias shape {tuple(bias.shape)})")
    if want_dbias and sums_queries(bias, seqlen_q):
        direct = (path.direct_backward if path is not None
                  else choice("attention_cute_direct_bias_backward").value)
        if not direct or head_dim not in SUM_QUERIES_HEAD_DIMS:
            return ("the CuTe backend sums dbias over queries in its direct backward at head dims "
                    f"{', '.join(map(str, SUM_QUERIES_HEAD_DIMS))} only (bias shape "
                    f"{tuple(bias.shape)}, head dim {head_dim})")
    if deterministic and mask is not None:
        return "the CuTe backend has no deterministic backward with a mask"
    if deterministic and want_dbias and dbias_reduce(batch, num_heads, bias) == "atomic":
        return "the CuTe backend sums a shared dbias with atomics, which deterministic=True rules out"
    return None


def _pair_view(t: torch.Tensor, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int):
    """(view, grouped): t [B|1, H|Hk|1, Sq|1, Sk|1] in the full problem shape, stride 0 along
    every size-1 dim (also where the problem's size is 1: the compile key then depends on the
    broadcast pattern only). Heads: [B, H, Sq, Sk] for H or 1 heads; per kv head (GQA),
    [B, Hk, G, Sq, Sk] with stride 0 along G (hooks.py reads head h // G)."""
    def dim(i, size):
        return (size, 0) if t.shape[i] == 1 else (size, t.stride(i))
    b, q, k = dim(0, batch), dim(2, seqlen_q), dim(3, seqlen_k)
    heads = t.shape[1]
    if heads == 1 or heads == num_heads:
        h = dim(1, num_heads)
        dims, grouped = (b, h, q, k), False
    else:
        dims, grouped = (b, (heads, t.stride(1)), (num_heads // heads, 0), q, k), True
    size, stride = zip(*dims)
    return t.detach().as_strided(size, stride, t.storage_offset()), grouped


def _placeholder(device: torch.device) -> torch.Tensor:
    """An unused aux slot's tensor, never read: an allocation from the caching allocator, no
    kernel (not cached across calls: the CPU compile check runs each variant under its own fake
    tensor mode)."""
    return torch.empty(1, dtype=torch.uint8, device=device)


def _aux(pb_shape, mask, bias, dbias_buffer=None):
    """FA4's aux tensor list (fixed slots; a placeholder where a slot is unused) and the hooks'
    grouping flags."""
    batch, num_heads, seqlen_q, seqlen_k = pb_shape
    placeholder = None
    aux, grouped = [None, None, None], {}
    for slot, t in ((BIAS_SLOT, bias), (MASK_SLOT, mask), (DBIAS_SLOT, dbias_buffer)):
        if t is None:
            continue
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)
        aux[slot], grouped[slot] = _pair_view(t, batch, num_heads, seqlen_q, seqlen_k)
    device = next(t for t in aux if t is not None).device
    for slot in range(len(aux)):
        if aux[slot] is None:
            if placeholder is None:
                placeholder = _placeholder(device)
            aux[slot] = placeholder
    # trailing placeholders are dropped: the list's length is part of FA4's compile key, and
    # a forward needs no dbias slot
    while aux and aux[-1] is placeholder and placeholder is not None:
        aux.pop()
    return aux, grouped


@functools.lru_cache(maxsize=None)
def _bwd_hooks_see_packed_gqa() -> bool:
    """True while FA4's SM90 backward hands its score_mod / score_mod_bwd GQA-packed indices
    (4.0.0b36: flash_bwd_sm90.py's apply_score_mod and apply_score_mod_bwd pass
    qhead_per_kvhead=self.qhead_per_kvhead to softmax.py's apply_score_mod_inner /
    apply_score_mod_bwd_inner although the backward never packs GQA; the SM100 backward and the
    SM90 forward pass it only with pack_gqa). Read from FA4's source, so that a fixed FA4 turns
    the hooks' unfolding off instead of breaking it."""
    import inspect

    from flash_attn.cute import flash_bwd_sm90
    cls = flash_bwd_sm90.FlashAttentionBackwardSm90
    return all("qhead_per_kvhead=self.qhead_per_kvhead," in inspect.getsource(fn)
               for fn in (cls.apply_score_mod, cls.apply_score_mod_bwd))


def _hooks(mask, bias, grouped, causal: bool, dbias_mode: str | None, backward: bool,
           group_size: int = 1):
    """group_size: query heads per kv head (used by the backward's bias hooks only)."""
    from . import hooks
    fold = group_size if backward and group_size > 1 and _bwd_hooks_see_packed_gqa() else 1
    score_mod = (hooks.bias_score_mod(BIAS_SLOT, grouped[BIAS_SLOT], fold)
                 if bias is not None else None)
    mask_mod = (hooks.keep_mask_mod(MASK_SLOT, grouped[MASK_SLOT], causal)
                if mask is not None else None)
    score_mod_bwd = None
    if backward and bias is not None:
        if dbias_mode is None:
            score_mod_bwd = hooks.passthrough_score_mod_bwd()
        else:
            score_mod_bwd = hooks.bias_score_mod_bwd(DBIAS_SLOT, grouped[DBIAS_SLOT],
                                                     dbias_mode == "atomic", fold)
    return score_mod, mask_mod, score_mod_bwd


def _problem_shape(q, k):
    return q.shape[0], q.shape[2], q.shape[1], k.shape[1]


def forward(q, k, v, mask, bias, *, causal: bool, softmax_scale: float,
            path: BiasPath | None = None):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D], mask bool and bias broadcastable to [B, H, Sq, Sk]
    (checked by the caller, `feature_gap` None) -> (out like q, lse fp32 [B, H, Sq], +inf for
    rows that see no key). path: how the bias is taken (`bias_path` when None)."""
    batch, num_heads, seqlen_q, seqlen_k = shape = _problem_shape(q, k)
    if seqlen_q == 0 or seqlen_k == 0:  # no key anywhere (or no row): nothing to launch
        out = torch.zeros_like(q)
        lse = torch.full((batch, num_heads, seqlen_q), math.inf, device=q.device, dtype=torch.float32)
        return out, lse
    q, k, v = (plain._tma_ready(t) for t in (q, k, v))
    aux, grouped = _aux(shape, mask, bias)
    score_mod, mask_mod, _ = _hooks(mask, bias, grouped, causal, None, backward=False)
    kernel = contextlib.nullcontext()
    if bias is not None and path is None:
        path = bias_path(q.shape[-1], causal, tma_layout(mask, bias), tma_layout(mask, bias, True))
    pack_gqa = None  # FA4 decides
    if bias is not None and path.direct_forward and path.prefetch == "tma":
        tma_gap = _tma_bias_gap(q, mask, bias, seqlen_q, seqlen_k)
        if tma_gap is None:
            from . import forward_bias_tma, tma_operands
            tma_slot = len(aux)
            aux.append(tma_operands.tma_view(bias))
            score_mod = forward_bias_tma.tma_bias_score_mod(
                tma_slot, bias.shape[0] == 1, _tma_head_mode(bias, num_heads),
                CUTLASS_TYPE_NAMES[bias.dtype], path.tma_evict_first)
            kernel = forward_bias_tma.tma_bias_kernel()
            pack_gqa = False  # the bias warp reads one query head's rows per tile
        else:
            profile.log_fallback("attention", "the CuTe TMA bias forward",
                                 "the direct-bias forward (registers or L2 prefetch)", tma_gap)
            path = dataclasses.replace(path, prefetch=bias_path(q.shape[-1], causal, False).prefetch)
    if bias is not None and path.direct_forward and path.prefetch != "tma":
        from . import forward_bias
        contiguous = forward_bias.keys_contiguous(aux[BIAS_SLOT])
        if contiguous:
            aux[BIAS_SLOT] = forward_bias.mark_keys_contiguous(aux[BIAS_SLOT])
        pairs = contiguous and path.pairs
        score_mod = forward_bias.direct_bias_score_mod(
            BIAS_SLOT, grouped[BIAS_SLOT], path.prefetch, pairs, CUTLASS_TYPE_NAMES[bias.dtype])
        kernel = forward_bias.direct_bias_kernel()
    lists = _tile_lists(mask, shape, causal, q.shape[-1], key_major=False)
    with device_guard(q.device), kernel:
        out, lse = plain._fa4()._flash_attn_fwd(
            q, k, v, softmax_scale=softmax_scale, causal=causal and mask is None,
            score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux,
            block_sparse_tensors=lists, return_lse=True, pack_gqa=pack_gqa)[:2]
    # rows with no visible key (the mask, causal with Sq > Sk, or a bias of -inf): FA4's -inf
    plain._empty_rows_to_plus_inf(lse)
    return out, lse


def _tma_head_mode(bias, num_heads: int) -> str:
    """Which head's bias a query head reads in the TMA kernels: "each" (its own), "kv" (its kv
    head's) or "shared" (one for all)."""
    heads = bias.shape[1]
    return "each" if heads == num_heads else ("shared" if heads == 1 else "kv")


def tma_layout(mask, bias, loadable: bool = False) -> bool:
    """Whether a call's bias has the layout the TMA bias paths take (bias_path); loadable: and
    TMA can load it as it lies in memory (tma_operands.tma_ready)."""
    if not (mask is None and bias is not None and bias.shape[-2] > 1 and bias.shape[-1] > 1):
        return False
    from .tma_operands import tma_ready
    return not loadable or tma_ready(bias, bias.shape[-2], bias.shape[-1])


def _tma_gap(q, mask, tensor, seqlen_q: int, seqlen_k: int, head_dims, why_head_dims: str,
             why_layout: str) -> str | None:
    """What both TMA paths need: no mask, a head dim they fit, a tensor TMA can address."""
    from .tma_operands import tma_ready
    if mask is not None:
        return "it takes no mask"
    if q.shape[-1] not in head_dims:
        return f"{why_head_dims} at head dims {', '.join(map(str, head_dims))}, not {q.shape[-1]}"
    if not tma_ready(tensor, seqlen_q, seqlen_k):
        # no shape in the reason: the warning is logged once per reason, not once per length
        return why_layout
    return None


def _tma_bias_gap(q, mask, bias, seqlen_q: int, seqlen_k: int) -> str | None:
    """None where the TMA bias forward (cute/forward_bias_tma.py) serves this call; else why not."""
    gap = _tma_gap(q, mask, bias, seqlen_q, seqlen_k, TMA_BIAS_HEAD_DIMS,
                   "its two bias stages fit FA4's tiles",
                   "TMA needs a 16-bit bias with full query and key dims, keys contiguous, other "
                   "strides and the start 16-byte aligned (for a contiguous bias: keys a multiple of 8)")
    if gap is None:
        from . import forward_bias_tma
        if not forward_bias_tma.order_matches_fa4():
            return "the installed FA4 walks key tiles in an order the bias warp does not repeat"
    return gap


def _tma_backward_gap(q, mask, tensor, seqlen_q: int, seqlen_k: int, what: str) -> str | None:
    """None where the TMA backward (cute/backward_bias_tma.py) can take this bias or dbias
    buffer (what: "bias" or "dbias") by TMA; else why not."""
    if tensor.dtype != q.dtype:
        return f"FA4's dS tile is {q.dtype}, the {what} is {tensor.dtype}"
    gap = _tma_gap(q, mask, tensor, seqlen_q, seqlen_k, TMA_DBIAS_HEAD_DIMS,
                   "FA4 double-buffers dS",
                   f"TMA needs a {what} with full query and key dims, keys contiguous, other "
                   "strides and the start 16-byte aligned (for a contiguous one: keys a multiple of 8)")
    if gap is None:
        from . import backward_bias_tma
        if not backward_bias_tma.round_matches_fa4():
            return "the installed FA4's backward round is not the one the TMA backward was placed in"
    return gap


def _tile_lists(mask, shape, causal: bool, head_dim: int, key_major: bool):
    """FA4's tile lists of a mask (None without one): query-major at the forward's key tile,
    key-major at the backward's."""
    if mask is None:
        return None
    batch, num_heads, seqlen_q, seqlen_k = shape
    block_kv = (block_sparse.backward_block_kv if key_major else block_sparse.forward_block_kv)(head_dim)
    return block_sparse.block_lists(mask, batch=batch, num_heads=num_heads, seqlen_q=seqlen_q,
                                    seqlen_k=seqlen_k, is_causal=causal, block_kv=block_kv,
                                    key_major=key_major)


def backward(dout, q, k, v, out, lse, mask, bias, *, causal: bool, softmax_scale: float,
             dbias_mode: str | None, deterministic: bool = False, path: BiasPath | None = None):
    """Gradients of `forward` -> (dq, dk, dv, dbias or None). dbias_mode: None (no dbias),
    "store" or "atomic" (`dbias_reduce`); `backward_gap` must have been None (so with
    deterministic=True there is no mask and no atomic dbias: FA4 orders its dq and dk/dv sums).
    path: how the bias is taken (`bias_path` when None)."""
    batch, num_heads, seqlen_q, seqlen_k = shape = _problem_shape(q, k)
    if seqlen_q == 0 or seqlen_k == 0:
        dbias = torch.zeros_like(bias) if dbias_mode is not None else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias
    q, k, v, out, dout = (plain._tma_ready(t) for t in (q, k, v, out, dout))
    buffer = None
    if dbias_mode is not None:
        buffer = torch.zeros(bias.shape, device=bias.device,
                             dtype=bias.dtype if dbias_mode == "store" else torch.float32)
    aux, grouped = _aux(shape, mask, bias, buffer)
    score_mod, mask_mod, score_mod_bwd = _hooks(mask, bias, grouped, causal, dbias_mode, backward=True,
                                                group_size=num_heads // k.shape[2])
    kernel = contextlib.nullcontext()
    if bias is not None and path is None:
        path = bias_path(q.shape[-1], causal, tma_layout(mask, bias), tma_layout(mask, bias, True))
    if bias is not None and path.direct_backward:
        from . import backward_bias, forward_bias
        slots = (BIAS_SLOT, DBIAS_SLOT) if buffer is not None else (BIAS_SLOT,)
        for slot in slots:
            if forward_bias.keys_contiguous(aux[slot]):
                aux[slot] = forward_bias.mark_keys_contiguous(aux[slot])
        score_mod = forward_bias.direct_bias_score_mod(BIAS_SLOT, grouped[BIAS_SLOT], "none", False,
                                                       CUTLASS_TYPE_NAMES[bias.dtype])
        # a bias broadcast along queries is read per key (and its dbias summed per key) where the
        # backward computes the scores transposed; backward_gap keeps dbias to those head dims
        score_mod_bwd = backward_bias.direct_dbias_score_mod_bwd(
            DBIAS_SLOT, grouped.get(DBIAS_SLOT, False), dbias_mode or "none",
            sums_queries(bias, seqlen_q) and q.shape[-1] in SUM_QUERIES_HEAD_DIMS)
        kernel = backward_bias.direct_bias_backward_kernel()
        tma_bias = tma_dbias = None
        # at other head dims the per-element forms are the path, not a fallback
        tma_head_dim = q.shape[-1] in TMA_DBIAS_HEAD_DIMS
        if path.bias_tma_backward and tma_head_dim and tma_layout(mask, bias):
            gap = _tma_backward_gap(q, mask, bias, seqlen_q, seqlen_k, "bias")
            if gap is None:
                from . import tma_operands
                tma_bias = (len(aux), bias.shape[0] == 1, _tma_head_mode(bias, num_heads))
                aux.append(tma_operands.tma_view(bias))
            else:
                profile.log_fallback("attention", "the CuTe TMA bias read in the backward",
                                     "the bias read from the score fragments", gap)
        if path.dbias_tma and tma_head_dim and dbias_mode == "store":
            gap = _tma_backward_gap(q, mask, buffer, seqlen_q, seqlen_k, "dbias")
            if gap is None:
                from . import tma_operands
                tma_dbias = len(aux)
                aux.append(tma_operands.tma_view(buffer))
            else:
                profile.log_fallback("attention", "the CuTe TMA dbias store",
                                     "dbias stored from the score fragments", gap)
        if tma_bias is not None or tma_dbias is not None:
            from . import backward_bias_tma
            spec = backward_bias_tma.TmaBackwardSpec(bias=tma_bias, dbias_slot=tma_dbias)
            score_mod_bwd = backward_bias_tma.tma_score_mod_bwd(spec, score_mod_bwd.direct_dbias)
            kernel = backward_bias_tma.tma_backward_kernel()
    lists = _tile_lists(mask, shape, causal, q.shape[-1], key_major=True)
    with device_guard(q.device), kernel:
        dq, dk, dv = plain._fa4()._flash_attn_bwd(
            q, k, v, out, dout, lse.contiguous(), softmax_scale=softmax_scale,
            causal=causal and mask is None, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux, block_sparse_tensors=lists,
            deterministic=deterministic)[:3]
    dbias = None
    if buffer is not None:
        dbias = buffer if buffer.dtype == bias.dtype else buffer.to(bias.dtype)
    return dq, dk, dv, dbias
