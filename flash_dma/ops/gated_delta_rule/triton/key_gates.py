"""With the per-key gate gk: tiles of the chunk-local gate cumsums and of the gated k (and q) that
the state passes read (formed inside the forward's gated-pair kernel, and the gated q, k again in
the backward's recompute of w and u), and the last step of the gates' backward: dbeta's and dg's
per-K-tile shares summed (the pair-gradient kernels write dgk, the reverse cumsum of the per-key
gate terms, themselves)."""
import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from ..layout import ChunkLayout
from .common import (
    CHUNK, chunk_args, chunk_of_slot, last_row_of, load_tile, load_vec, reverse_cumsum, store_tile, store_vec
)


@triton.jit
def scalar_gate_cumsum(g, g_cum, tok0, rows, hv, HV: tl.constexpr, n_valid):
    """The chunk-local cumsum of the scalar log decay (fp32), stored to g_cum and returned."""
    cum = tl.cumsum(load_vec(g, tok0, rows, HV, hv, n_valid).to(tl.float32), 0)
    store_vec(g_cum, cum, tok0, rows, HV, hv, n_valid)
    return cum


@triton.jit
def store_gated_qk(key_cum, k_rows, q_rows, q_gated, k_gated, tok0, rows, hv, cols, n_valid,
                   HV: tl.constexpr, K: tl.constexpr, STORE_Q_GATED: tl.constexpr):
    """The gated k and q of the state passes for one [64, BK] tile, per value head in k's dtype:
    k e^(C_last - C) to k_gated and (STORE_Q_GATED) q e^C to q_gated, C the per-key cumsum alone
    (key_cum, fp32), k_rows and q_rows the k and q tiles in fp32."""
    decay_to_end = tl.exp(last_row_of(key_cum, n_valid)[None, :] - key_cum)
    store_tile(k_gated, k_rows * decay_to_end, tok0, rows, HV, hv, K, cols, n_valid)
    if STORE_Q_GATED:
        store_tile(q_gated, q_rows * tl.exp(key_cum), tok0, rows, HV, hv, K, cols, n_valid)


@triton.jit
def key_gate_tile(gk, gk_cum, q, k, q_gated, k_gated, tok0, rows, hv, head, cols, n_valid,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, STORE_Q_GATED: tl.constexpr):
    """One [64, BK] tile of the per-key gate: its chunk-local cumsum C (fp32), stored to gk_cum,
    and the gated k (and q) of store_gated_qk. -> (C, the k and q tiles in fp32); rows past
    n_valid of C repeat the last valid row."""
    key_cum = tl.cumsum(load_tile(gk, tok0, rows, HV, hv, K, cols, n_valid).to(tl.float32), 0)
    store_tile(gk_cum, key_cum, tok0, rows, HV, hv, K, cols, n_valid)
    k_rows = load_tile(k, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
    q_rows = load_tile(q, tok0, rows, H, head, K, cols, n_valid).to(tl.float32)
    store_gated_qk(key_cum, k_rows, q_rows, q_gated, k_gated, tok0, rows, hv, cols, n_valid, HV, K, STORE_Q_GATED)
    return key_cum, k_rows, q_rows


@triton.jit
def sum_of_parts(parts, part_stride, NK: tl.constexpr, tok0, rows, hv, HV: tl.constexpr, n_valid):
    """The NK per-K-tile shares [NK, B, T, HV] of a chunk's rows, summed in tile order (a fixed
    order: atomics across tiles made the sums vary in their last bits from run to run)."""
    total = load_vec(parts, tok0, rows, HV, hv, n_valid)
    for k_tile in tl.static_range(1, NK):
        total += load_vec(parts + part_stride.to(tl.int64) * k_tile, tok0, rows, HV, hv, n_valid)
    return total


@triton.jit(do_not_specialize=["T", "part_stride"])
def gdn_gate_grad_kernel(dg, dbeta, dbeta_parts, dg_parts, dbeta_out, chunk_map, cu_seqlens, T, part_stride,
                         HV: tl.constexpr, NK: tl.constexpr, HAS_G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """With gk, after the pair-gradient pass (which writes dgk itself): dbeta finished from the WY
    pass's part (fp32) plus the pair pass's NK per-K-tile shares, into dbeta_out in beta's dtype;
    and (HAS_G) dg, the reverse cumsum down the chunk of the shares of its terms (the per-key gate
    terms summed over keys)."""
    slot = tl.program_id(0)
    bhv = tl.program_id(1)
    hv = bhv % HV
    tok0, n_valid, _ = chunk_of_slot(slot, bhv // HV, chunk_map, cu_seqlens, T, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    if HAS_G:
        store_vec(dg, reverse_cumsum(sum_of_parts(dg_parts, part_stride, NK, tok0, rows, hv, HV, n_valid)),
                  tok0, rows, HV, hv, n_valid)
    shares = sum_of_parts(dbeta_parts, part_stride, NK, tok0, rows, hv, HV, n_valid)
    store_vec(dbeta_out, load_vec(dbeta, tok0, rows, HV, hv, n_valid) + shares, tok0, rows, HV, hv, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def gated_qk_buffers(q, k, HV: int, store_q_gated: bool):
    """The gated k and (store_q_gated) q of the state passes, per value head: (k_gated, q_gated
    or None)."""
    B, T, _, K = k.shape
    k_gated = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    q_gated = torch.empty(B, T, HV, K, device=q.device, dtype=q.dtype) if store_q_gated else None
    return k_gated, q_gated


def gate_buffers(q, k, g, gk, store_q_gated: bool):
    """The outputs of the gate pass: (g_cum or None without g, gk_cum, k_gated, q_gated or None)."""
    B, T, HV, K = gk.shape
    g_cum = torch.empty(B, T, HV, device=k.device, dtype=torch.float32) if g is not None else None
    gk_cum = torch.empty(B, T, HV, K, device=k.device, dtype=torch.float32)
    return (g_cum, gk_cum, *gated_qk_buffers(q, k, HV, store_q_gated))


def gate_gradients(plan, layout: ChunkLayout, dg, dbeta, dbeta_parts, dg_parts, beta_dtype: torch.dtype):
    """With gk, after pair_gradients (which wrote dgk): dbeta finished from the WY pass's part
    (fp32) and the pair pass's per-K-tile shares dbeta_parts [NK, B, T, HV], and (dg not None)
    dg from the shares of its terms dg_parts, reverse-cumsummed within each chunk.
    -> dbeta in beta_dtype (dg is written in place)."""
    NK, B, T, HV = dbeta_parts.shape
    dbeta_out = torch.empty(B, T, HV, device=dbeta.device, dtype=beta_dtype)
    cfg = plan.launch("gate_grad")
    chunk_map, cu = chunk_args(layout)
    launch(gdn_gate_grad_kernel, (layout.num_slots, B * HV),
           dg, dbeta, dbeta_parts, dg_parts, dbeta_out, chunk_map, cu, T, B * T * HV, HV=HV, NK=NK,
           HAS_G=dg is not None, IS_VARLEN=layout.is_varlen, **cfg.launch_options())
    return dbeta_out
