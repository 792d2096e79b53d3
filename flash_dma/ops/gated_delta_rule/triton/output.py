"""The output o = scale (q e^B) h[c] + P v_new with P = scale Tril(q k^T . Gamma); the same kernel
computes the backward's local dv = P^T do."""
import torch
import triton
import triton.language as tl

from ....runtime.launch import launch
from ..layout import ChunkLayout
from .common import (
    CHUNK, chunk_args, chunk_program, load_tile, load_vec, scalar_gamma, square_ptrs, state_ptrs,
    store_tile
)


@triton.jit
def _intra_matrix(q, k, g_cum, aqk, tok0, hv, head, n_valid, scale,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                  HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """P = scale Tril(q k^T . Gamma) of one chunk, [64, 64]: fp32, or read back in q's dtype where
    the gated-pair kernel made it (gk)."""
    rows = tl.arange(0, CHUNK)
    if HAS_GK:
        ptrs, mask = square_ptrs(aqk, tok0, rows, HV, hv, rows, n_valid)
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        p = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        for k_start in range(0, K, BK):
            cols = k_start + tl.arange(0, BK)
            p += tl.dot(load_tile(q, tok0, rows, H, head, K, cols, n_valid),
                        tl.trans(load_tile(k, tok0, rows, H, head, K, cols, n_valid)))
        if HAS_G:
            bt = load_vec(g_cum, tok0, rows, HV, hv, n_valid)
            return p * scalar_gamma(bt, bt, True, rows < n_valid) * scale
        else:
            return tl.where(rows[:, None] >= rows[None, :], p * scale, 0.0)


@triton.jit
def _query_gate(g_cum, gk_cum, tok0, rows, hv, HV: tl.constexpr, K: tl.constexpr, cols, n_valid,
                HAS_G: tl.constexpr, HAS_GK: tl.constexpr):
    """e^B of a [64, BK] query tile (broadcastable: [64, 1] without gk)."""
    if HAS_G:
        e = tl.exp(load_vec(g_cum, tok0, rows, HV, hv, n_valid))[:, None]
    else:
        e = tl.full([CHUNK, 1], 1.0, dtype=tl.float32)
    if HAS_GK:
        e = e * tl.exp(load_tile(gk_cum, tok0, rows, HV, hv, K, cols, n_valid))
    return e


@triton.jit(do_not_specialize=["T"])
def gdn_intra_kernel(q, k, g_cum, gk_cum, aqk, h, v_new, do, out, chunk_map, cu_seqlens, T, scale,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr,
                     HAS_G: tl.constexpr, HAS_GK: tl.constexpr, IS_VARLEN: tl.constexpr,
                     IS_DV: tl.constexpr):
    """IS_DV=False: o = scale (q e^B) h[c] + P v_new.  IS_DV=True: dv_local = P^T do.
    One program per (chunk, head); BK covers all of K, V in tiles of BV."""
    hv, head, tok0, n_valid, chunk = chunk_program(chunk_map, cu_seqlens, T, H, HV, IS_VARLEN)
    rows = tl.arange(0, CHUNK)
    krows = tl.arange(0, BK)
    p = _intra_matrix(q, k, g_cum, aqk, tok0, hv, head, n_valid, scale, H, HV, K, BK, HAS_G, HAS_GK)
    dt = out.dtype.element_ty
    if IS_DV:
        pt = tl.trans(p).to(dt)
    else:
        pt = p.to(dt)
        qt = load_tile(q, tok0, rows, H, head, K, krows, n_valid)
        qg = (qt * _query_gate(g_cum, gk_cum, tok0, rows, hv, HV, K, krows, n_valid, HAS_G, HAS_GK)
              * scale).to(dt)
    for v_start in range(0, V, BV):
        vcols = v_start + tl.arange(0, BV)
        if IS_DV:
            acc = tl.dot(pt, load_tile(do, tok0, rows, HV, hv, V, vcols, n_valid).to(dt))
        else:
            ptrs, mask = state_ptrs(h, chunk, hv, HV, K, V, krows, vcols)
            acc = tl.dot(qg, tl.load(ptrs, mask=mask, other=0.0).to(dt))
            acc += tl.dot(pt, load_tile(v_new, tok0, rows, HV, hv, V, vcols, n_valid).to(dt))
        store_tile(out, acc, tok0, rows, HV, hv, V, vcols, n_valid)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def output(plan, layout: ChunkLayout, q, k, g_cum, gk_cum, aqk, h, v_new, scale: float):
    """o = scale (q e^B) h[c] + P v_new, in q's dtype."""
    return _intra(plan, layout, q, k, g_cum, gk_cum, aqk, h, v_new, None, scale, q.dtype)


def local_dv(plan, layout: ChunkLayout, q, k, g_cum, gk_cum, aqk, do, scale: float, dtype):
    """The backward's dv through the intra-chunk part of o alone: P^T do."""
    return _intra(plan, layout, q, k, g_cum, gk_cum, aqk, None, None, do, scale, dtype)


def _intra(plan, layout, q, k, g_cum, gk_cum, aqk, h, v_new, do, scale, out_dtype):
    B, T, H, K = q.shape
    is_dv = do is not None
    src = do if is_dv else v_new
    HV, V = src.shape[2], src.shape[3]
    out = torch.empty(B, T, HV, V, device=q.device, dtype=out_dtype)
    cfg = plan.launch("intra")
    chunk_map, cu = chunk_args(layout)
    launch(gdn_intra_kernel, (layout.num_slots, B * HV),
           q, k, g_cum, gk_cum, aqk, h, v_new, do, out, chunk_map, cu, T, scale,
           H=H, HV=HV, K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, HAS_G=g_cum is not None,
           HAS_GK=gk_cum is not None, IS_VARLEN=layout.is_varlen, IS_DV=is_dv,
           **cfg.launch_options())
    return out
