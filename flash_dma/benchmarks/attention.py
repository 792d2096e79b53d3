"""Dynamic mask attention beside its peers: FlexAttention, SDPA (cuDNN, flash, memory-efficient),
FlashAttention-4 (flash-attn-4, CuTe DSL; plain attention), flash-sparse-attn's Triton dense
kernel (plain attention) and flash-dmattn's Triton backend, each used when importable and skipped
with a note when not.

Every configuration is timed forward and backward (dq, dk, dv and, with a trainable bias,
dbias), ours and the peer in the same process, and the outputs are compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .common import Row, Section, compare, compiled_flex_attention, time_ms

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class AttnCase:
    label: str
    B: int
    H: int
    S: int
    D: int
    causal: bool = False
    bias: str | None = None  # "full" [B, H, S, S] | "key" [B, H, 1, S] | "key-shared" [1, H, 1, S]
    mask: str | None = None  # "tiles-1/8" (1/8 of 128x128 tiles kept) | "topk-1024" (key-wise)
    peers: tuple[str, ...] = ()

    def flops(self, backward: bool) -> float | None:
        if self.mask is not None:
            return None  # sparse: the dense count would flatter, so report times only
        f = 4.0 * self.B * self.H * self.S * self.S * self.D * (0.5 if self.causal else 1.0)
        return f * 2.5 if backward else f


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor | None
    mask: torch.Tensor | None
    tile_keep: torch.Tensor | None  # [B, H, S/128, S/128] for block-sparse cases
    dout: torch.Tensor


def make_inputs(case: AttnCase, device="cuda") -> Inputs:
    from ..ops.dynamic_mask_attention import topk_mask_from_bias
    B, H, S, D = case.B, case.H, case.S, case.D
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=DTYPE) for _ in range(3))
    bias = None
    if case.bias == "full":
        bias = torch.randn(B, H, S, S, device=device, dtype=DTYPE)
    elif case.bias == "key":
        bias = torch.randn(B, H, 1, S, device=device, dtype=DTYPE)
    elif case.bias == "key-shared":  # one bias row per head for the whole batch
        bias = torch.randn(1, H, 1, S, device=device, dtype=DTYPE)
    mask, tile_keep = None, None
    if case.mask == "tiles-1/8":
        n = S // 128
        tile_keep = torch.rand(B, H, n, n, device=device).argsort(-1) < max(n // 8, 1)
        mask = tile_keep.repeat_interleave(128, 2).repeat_interleave(128, 3)
    elif case.mask == "topk-1024":
        mask = topk_mask_from_bias(bias if bias is not None else torch.randn(B, H, 1, S, device=device),
                                   1024, is_causal=case.causal)
    return Inputs(q, k, v, bias, mask, tile_keep, torch.randn(B, S, H, D, device=device, dtype=DTYPE))


Runner = Callable[[], torch.Tensor]


def _leaves(x: Inputs, bias_grad: bool, layout_bhsd: bool):
    qkv = [t.detach().transpose(1, 2).contiguous() if layout_bhsd else t.detach() for t in (x.q, x.k, x.v)]
    qkv = [t.requires_grad_() for t in qkv]
    bias = x.bias.detach().clone().requires_grad_(bias_grad) if x.bias is not None else None
    return qkv, bias


def ours(case: AttnCase, x: Inputs):
    from .. import flash_dma_func
    (q, k, v), bias = _leaves(x, True, False)

    def fwd():
        return flash_dma_func(q, k, v, attn_mask=x.mask, attn_bias=bias, is_causal=case.causal)
    return fwd, [q, k, v] + ([bias] if bias is not None else []), x.dout, False


def ours_without_mask(case: AttnCase, x: Inputs):
    return ours(case, Inputs(x.q, x.k, x.v, x.bias, None, None, x.dout))


def ours_all_tiles(case: AttnCase, x: Inputs):
    return ours(case, Inputs(x.q, x.k, x.v, x.bias, torch.ones_like(x.mask), None, x.dout))


def ours_walk(case: AttnCase, x: Inputs):
    """Ours with a top-k key-wise mask through the gathered-key walk (attention_keywise_compaction
    off), where the default runs dense attention over the gathered kept keys; the backward
    follows the graph the forward built."""
    from ..ops.dynamic_mask_attention import compaction
    from ..runtime.config import overrides
    if compaction.kept_keys(x.mask) is None or case.causal:
        raise ValueError("no top-k key-wise mask here: nothing the walk would be compared with")
    fwd, leaves, dout, bhsd = ours(case, x)

    def walked():
        with overrides(attention_keywise_compaction="off"):
            return fwd()
    return walked, leaves, dout, bhsd


def sdpa(backend_name: str):
    def build(case: AttnCase, x: Inputs):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
        (q, k, v), bias = _leaves(x, True, True)
        dout = x.dout.transpose(1, 2).contiguous()

        def fwd():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, is_causal=case.causal)
        return fwd, [q, k, v] + ([bias] if bias is not None else []), dout, True
    return build


def flex(case: AttnCase, x: Inputs):
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    flex_attention = compiled_flex_attention()
    (q, k, v), bias = _leaves(x, True, True)
    dout = x.dout.transpose(1, 2).contiguous()
    score_mod = None
    if bias is not None:
        if case.bias == "full":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, q_idx, kv_idx]
        elif case.bias == "key-shared":
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[0, h, 0, kv_idx]
        else:
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, 0, kv_idx]
    block_mask = None
    B, H, S = case.B, case.H, case.S
    if x.tile_keep is not None:
        keep = x.tile_keep
        kv_num = keep.sum(-1, dtype=torch.int32)
        kv_idx = keep.to(torch.uint8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        # every kept tile is fully kept, so all listed blocks are "full" (no mask_mod calls)
        block_mask = BlockMask.from_kv_blocks(torch.zeros_like(kv_num), kv_idx, kv_num, kv_idx,
                                              BLOCK_SIZE=128, mask_mod=None, seq_lengths=(S, S))
    elif case.mask == "topk-1024":
        keep = x.mask  # [B, H, 1, S]

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, h, 0, kv_idx]
        block_mask = create_block_mask(mask_mod, B, H, S, S, device=q.device)
    elif case.causal:
        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        block_mask = create_block_mask(causal, None, None, S, S, device=q.device)

    def fwd():
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return fwd, [q, k, v] + ([bias] if bias is not None else []), dout, True


def _flash_dmattn_func():
    """flash-dmattn 1.2.2's Triton mask+bias kernel: shipped inside flash-sparse-attn 2.0.6 as
    flash_sparse_attn.deprecated.flash_dmattn_triton, or importable on its own."""
    try:
        from flash_sparse_attn.deprecated.flash_dmattn_triton import triton_dmattn_func
    except ImportError:
        from flash_dmattn_triton import triton_dmattn_func
    return triton_dmattn_func


def flash_dmattn(case: AttnCase, x: Inputs):
    triton_dmattn_func = _flash_dmattn_func()  # the peer, from .peers/ (not a dependency)
    (q, k, v), bias = _leaves(x, True, False)
    B, H, S = case.B, case.H, case.S
    mask = x.mask if x.mask is not None else torch.ones(B, H, S, S, device=q.device, dtype=torch.bool)
    full_bias = bias if bias is not None else torch.zeros(B, H, S, S, device=q.device, dtype=DTYPE)

    def fwd():
        return triton_dmattn_func(q, k, v, attn_mask=mask.expand(B, H, S, S),
                                  attn_bias=full_bias.expand(B, H, S, S), is_causal=case.causal)
    return fwd, [q, k, v] + ([bias] if bias is not None else []), x.dout, False


def fa4(case: AttnCase, x: Inputs):
    """FlashAttention-4's own entry point (the kernels the CuTe backend runs for plain attention):
    plain rows only (it has no additive bias with a gradient)."""
    from flash_attn.cute import flash_attn_func
    if x.mask is not None or x.bias is not None:
        raise ValueError("plain attention only")
    (q, k, v), _ = _leaves(x, False, False)

    def fwd():
        out = flash_attn_func(q, k, v, causal=case.causal)
        return out[0] if isinstance(out, tuple) else out
    return fwd, [q, k, v], x.dout, False


def flash_sparse_attn(case: AttnCase, x: Inputs):
    """flash-sparse-attn's Triton dense kernel (flash-dmattn's successor; its own autotuning on),
    plain rows only: it takes no mask or bias tensor."""
    from flash_sparse_attn import flash_dense_attn_func
    if x.mask is not None or x.bias is not None:
        raise ValueError("plain attention only")
    (q, k, v), _ = _leaves(x, False, False)

    def fwd():
        return flash_dense_attn_func(q, k, v, is_causal=case.causal)
    return fwd, [q, k, v], x.dout, False


PEERS: dict[str, Callable] = {
    "fa4": fa4,
    "flash-sparse-attn": flash_sparse_attn,
    "flex": flex,
    "sdpa-cudnn": sdpa("cudnn"),
    "sdpa-flash": sdpa("flash"),
    "sdpa-efficient": sdpa("efficient"),
    "flash-dmattn": flash_dmattn,
    "ours-no-mask": ours_without_mask,
    "ours-all-tiles": ours_all_tiles,
    "ours-walk": ours_walk,
}


def peer_available(name: str) -> str | None:
    """None when the peer can run here, else a one-line reason."""
    try:
        if name == "flex":
            import torch.nn.attention.flex_attention  # noqa: F401
        elif name.startswith("sdpa"):
            import torch.nn.attention  # noqa: F401
        elif name == "flash-dmattn":
            _flash_dmattn_func()
        elif name == "fa4":
            import flash_attn.cute  # noqa: F401
        elif name == "flash-sparse-attn":
            import flash_sparse_attn  # noqa: F401
    except ImportError as exc:
        return f"{name} not installed ({exc.name})"
    except Exception as exc:  # noqa: BLE001 - a peer that breaks on import is a note, not a crash
        return f"{name} failed to import ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None


def _measure(build, case: AttnCase, x: Inputs):
    """(fwd ms, bwd ms, out, grads) with out/grads in [B, S, H, D] layout for comparison."""
    fwd, leaves, dout, bhsd = build(case, x)
    out = fwd()
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    fwd_ms = time_ms(fwd)
    bwd_ms = time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    if bhsd:
        out = out.transpose(1, 2)
        grads = [g.transpose(1, 2) if i < 3 else g for i, g in enumerate(grads)]
    return fwd_ms, bwd_ms, out.detach(), [g.detach() for g in grads]


def _grad_compare(a, b) -> tuple[float, float]:
    pairs = [compare(x, y) for x, y in zip(a, b)]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def run_case(case: AttnCase, notes: list[str], progress=None) -> list[Row]:
    x = make_inputs(case)
    our_fwd, our_bwd, our_out, our_grads = _measure(ours, case, x)
    rows = []
    for peer in case.peers:
        reason = peer_available(peer)
        if reason is not None:
            if reason not in notes:
                notes.append(reason)
            continue
        try:
            p_fwd, p_bwd, p_out, p_grads = _measure(PEERS[peer], case, x)
        except Exception as exc:  # noqa: BLE001 - a peer refusing a configuration is a result
            msg = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            rows.append(Row(f"{case.label} fwd", peer, None, our_fwd, note=msg, flops=case.flops(False),
                            seqlen=case.S, direction="fwd"))
            rows.append(Row(f"{case.label} bwd", peer, None, our_bwd, note=msg, flops=case.flops(True),
                            seqlen=case.S, direction="bwd"))
            continue
        if peer.startswith("ours"):  # another call of ours on another mask: nothing to compare
            fa = fr = ba = br = None
        else:
            fa, fr = compare(our_out, p_out)
            ba, br = _grad_compare(our_grads, p_grads)
        rows.append(Row(f"{case.label} fwd", peer, p_fwd, our_fwd, fa, fr, case.flops(False),
                        seqlen=case.S, direction="fwd"))
        rows.append(Row(f"{case.label} bwd", peer, p_bwd, our_bwd, ba, br, case.flops(True),
                        seqlen=case.S, direction="bwd"))
        if progress:
            progress()
    if not case.peers:
        rows.append(Row(f"{case.label} fwd", "-", None, our_fwd, flops=case.flops(False),
                        seqlen=case.S, direction="fwd"))
        rows.append(Row(f"{case.label} bwd", "-", None, our_bwd, flops=case.flops(True),
                        seqlen=case.S, direction="bwd"))
    del x
    torch.cuda.empty_cache()
    return rows


def sections(quick: bool) -> list[tuple[str, list[AttnCase]]]:
    dense_peers = ("flex", "sdpa-efficient") + (() if quick else ("flash-dmattn",))
    biased = [AttnCase("B2 H16 S4096 D128 bias[B,H,S,S]", 2, 16, 4096, 128, bias="full",
                       peers=dense_peers)]
    if not quick:
        biased += [
            AttnCase("B2 H16 S4096 D128 bias[B,H,S,S] causal", 2, 16, 4096, 128, True, "full", peers=("flex",)),
            AttnCase("B2 H16 S4096 D64 bias[B,H,S,S]", 2, 16, 4096, 64, bias="full", peers=("flex",)),
            AttnCase("B2 H8 S4096 D256 bias[B,H,S,S]", 2, 8, 4096, 256, bias="full", peers=("flex",)),
            AttnCase("B2 H16 S4096 D128 bias[B,H,1,S]", 2, 16, 4096, 128, bias="key", peers=("flex",)),
        ]
    plain = []
    for d, h in ((128, 16),) if quick else ((64, 16), (128, 16), (256, 8)):
        for causal in (False, True):
            plain.append(AttnCase(f"B4 H{h} S4096 D{d}{' causal' if causal else ''}", 4, h, 4096, d,
                                  causal, peers=("sdpa-cudnn", "sdpa-flash", "fa4", "flash-sparse-attn")))
    sparse = [
        # the case (a mask alone), then with a full bias, whose [B, H, S, S] gradient must
        # be written whole (zeros where tiles are skipped) however sparse the mask
        AttnCase("B2 H16 S4096 D128 1/8 tiles", 2, 16, 4096, 128, mask="tiles-1/8",
                 peers=("ours-all-tiles", "flex")),
        AttnCase("B2 H16 S4096 D128 1/8 tiles bias[B,H,S,S]", 2, 16, 4096, 128, bias="full",
                 mask="tiles-1/8", peers=("ours-all-tiles", "flex")),
        AttnCase("B1 H16 S16384 D128 top-1024 keys bias[B,H,1,S]", 1, 16, 16384, 128, bias="key",
                 mask="topk-1024", peers=("ours-no-mask",) if quick else ("ours-no-mask", "ours-walk", "flex")),
    ]
    sweep = [AttnCase(f"B{16384 // S} H16 S{S} D128 bias[B,H,S,S]", 16384 // S, 16, S, 128, bias="full",
                      peers=("flex",)) for S in ((1024, 4096) if quick else (1024, 2048, 4096, 8192))]
    return [("attention with a trainable bias (dq, dk, dv, dbias)", biased),
            ("sequence-length sweep, tokens per batch fixed at 16384", sweep),
            ("softmax attention, no mask, no bias", plain),
            ("sparsity: masked vs unmasked, and vs FlexAttention's BlockMask", sparse)]


def run(quick: bool = False, progress_factory=None, cases=None) -> tuple[list[Section], list[str]]:
    """cases: labels of cases to run (every case when None)."""
    notes: list[str] = []
    out = []
    plan = sections(quick)
    if cases:
        known = {c.label for _, group in plan for c in group}
        unknown = [label for label in cases if label not in known]
        if unknown:
            raise ValueError(f"cases: {unknown} are not attention cases; the labels: {sorted(known)}")
        plan = [(title, [c for c in group if c.label in cases]) for title, group in plan]
        plan = [(title, group) for title, group in plan if group]
    total = sum(len(c.peers) or 1 for _, cases in plan for c in cases)
    bar = progress_factory(total) if progress_factory else None
    for title, cases in plan:
        sec = Section(title)
        for case in cases:
            sec.rows += run_case(case, notes, bar.update if bar else None)
        out.append(sec)
    if bar:
        bar.close()
    return out, notes
