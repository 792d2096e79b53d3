"""Decoding with a KV cache beside its peers: SDPA (each backend that takes one query row:
flash, memory-efficient, cuDNN, math), FlexAttention (its decoding path) and flash-sparse-attn's
dense decode when importable, each skipped with a note when missing and reported as refused when
it rejects a configuration.

Decoding reads the whole cache once per call, so the rows report GB/s of cache bytes read,
beside a measured ceiling: torch's device-to-device copy of a 2 GiB tensor, counted as bytes
read plus written (the card's ~4.3 TB/s on an H200, ~3.35 on an H100). Sparse rows (a key-wise
top-w mask) read only the kept keys: their dense byte count would flatter them, so they report
times, and the kept bytes' rate in a note.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .common import Row, Section, compare, compiled_flex_attention, time_ms

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class DecodeCase:
    label: str
    B: int
    H: int
    Hk: int
    D: int
    S: int  # cache capacity, every row full
    Sq: int = 1
    page_size: int | None = None
    topk: int | None = None  # key-wise top-w mask [B, Hk, 1, S] with its bias
    append: bool = False  # Sq new tokens written at S - Sq (the rows then hold S tokens)
    peers: tuple[str, ...] = ()

    def cache_bytes(self) -> float:
        return 2.0 * self.B * self.S * self.Hk * self.D * torch.finfo(DTYPE).bits / 8


@dataclass
class Inputs:
    q: torch.Tensor
    k_cache: torch.Tensor  # [B, S, Hk, D]
    v_cache: torch.Tensor
    lengths: torch.Tensor  # int32 [B]: tokens cached before the call
    bias: torch.Tensor | None
    mask: torch.Tensor | None
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    bhsd: dict  # the peers' [B, Hk, S, D] copies, made on first use


def make_inputs(case: DecodeCase, device="cuda") -> Inputs:
    from ..ops.dynamic_mask_attention import topk_mask_from_bias
    B, H, Hk, D, S, Sq = case.B, case.H, case.Hk, case.D, case.S, case.Sq
    q = torch.randn(B, Sq, H, D, device=device, dtype=DTYPE)
    k_cache = torch.randn(B, S, Hk, D, device=device, dtype=DTYPE)
    v_cache = torch.randn(B, S, Hk, D, device=device, dtype=DTYPE)
    cached = S - Sq if case.append else S
    lengths = torch.full((B,), cached, device=device, dtype=torch.int32)
    bias = mask = None
    if case.topk:
        bias = torch.randn(B, Hk, 1, S, device=device, dtype=DTYPE)
        mask = topk_mask_from_bias(bias, case.topk)
    k_new = v_new = None
    if case.append:
        k_new, v_new = k_cache[:, cached:].clone(), v_cache[:, cached:].clone()
    return Inputs(q, k_cache, v_cache, lengths, bias, mask, k_new, v_new, {})


def _paged(case: DecodeCase, x: Inputs):
    """The cache's contents in a pool of pages, rows' pages scattered across it."""
    page = case.page_size
    per_row = case.S // page
    order = torch.randperm(case.B * per_row, device=x.q.device).view(case.B, per_row).to(torch.int32)
    pools = []
    for cache in (x.k_cache, x.v_cache):
        pool = torch.empty(case.B * per_row, page, case.Hk, case.D, device=cache.device, dtype=cache.dtype)
        pool[order.long()] = cache.view(case.B, per_row, page, case.Hk, case.D)
        pools.append(pool)
    return pools[0], pools[1], order


Runner = Callable[[], torch.Tensor]


def ours(case: DecodeCase, x: Inputs, *, contiguous: bool = False, use_mask: bool = True) -> Runner:
    from ..ops.decode import flash_dma_with_kvcache
    k_cache, v_cache, table = x.k_cache, x.v_cache, None
    if case.page_size and not contiguous:
        k_cache, v_cache, table = _paged(case, x)
    mask = x.mask if use_mask else None

    def run():
        return flash_dma_with_kvcache(x.q, k_cache, v_cache, x.k_new, x.v_new, cache_seqlens=x.lengths,
                                      block_table=table, attn_mask=mask, attn_bias=x.bias,
                                      is_causal=True)
    return run


def _bhsd(x: Inputs):
    """SDPA's and Flex's native layout, [B, Hk, S, D] contiguous, made once per case."""
    if not x.bhsd:
        x.bhsd["q"] = x.q.transpose(1, 2).contiguous()
        x.bhsd["k"] = x.k_cache.transpose(1, 2).contiguous()
        x.bhsd["v"] = x.v_cache.transpose(1, 2).contiguous()
    return x.bhsd["q"], x.bhsd["k"], x.bhsd["v"]


def sdpa(backend_name: str):
    def build(case: DecodeCase, x: Inputs) -> Runner:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend_name]
        q, k, v = _bhsd(x)
        bias = None
        if x.bias is not None:  # the same scores as ours: bias, -inf where the mask drops a key
            bias = x.bias.float().masked_fill(~x.mask, float("-inf")).to(DTYPE)
            bias = bias.repeat_interleave(case.H // case.Hk, 1)

        def run():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, enable_gqa=True).transpose(1, 2)
        return run
    return build


def flex(case: DecodeCase, x: Inputs) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask
    flex_attention = compiled_flex_attention()
    q, k, v = _bhsd(x)
    score_mod = block_mask = None
    if x.mask is not None:  # the key-wise top-w case: bias as a score_mod, the mask as a mask_mod
        bias, keep, group = x.bias, x.mask, case.H // case.Hk

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, h // group, 0, kv_idx]

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[b, h // group, 0, kv_idx]
        block_mask = create_block_mask(mask_mod, case.B, case.H, case.Sq, case.S, device=q.device)

    def run():
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=True).transpose(1, 2)
    return run


def flash_sparse_attn_dense(case: DecodeCase, x: Inputs) -> Runner:
    from flash_sparse_attn import flash_dense_attn_with_kvcache_func  # a peer, not a dependency
    q = x.q[:, 0].contiguous()

    def run():
        return flash_dense_attn_with_kvcache_func(q, x.k_cache, x.v_cache)[:, None]
    return run


PEERS: dict[str, Callable] = {
    "sdpa-flash": sdpa("flash"),
    "sdpa-efficient": sdpa("efficient"),
    "sdpa-cudnn": sdpa("cudnn"),
    "sdpa-math": sdpa("math"),
    "flex": flex,
    "flash-sparse-attn": flash_sparse_attn_dense,
    "ours-no-mask": lambda case, x: ours(case, x, use_mask=False),
    "ours-contiguous": lambda case, x: ours(case, x, contiguous=True),
}


def peer_available(name: str) -> str | None:
    try:
        if name == "flex":
            import torch.nn.attention.flex_attention  # noqa: F401
        elif name == "flash-sparse-attn":
            import flash_sparse_attn  # noqa: F401
    except ImportError as exc:
        return f"{name} not installed ({exc.name}): skipped"
    return None


def copy_ceiling_row() -> Row:
    """What the card's memory moves at best here: a device-to-device copy, read plus written."""
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return Row("torch copy_ of 2 GiB (bytes read + written)", "-", None, ms, bytes=4.0 * n,
               note="the ceiling the GB/s columns compare with")


def run_case(case: DecodeCase, notes: list[str], ceiling_gbs: float | None, progress=None) -> list[Row]:
    x = make_inputs(case)
    mine = ours(case, x)
    our_out = mine().float()
    our_ms = time_ms(mine)
    dense = case.topk is None
    nbytes = case.cache_bytes() if dense else None
    kept_note = ""
    if not dense:
        kept = 2.0 * case.B * case.Hk * case.topk * case.D * 2
        kept_note = f"kept keys read at {kept / our_ms / 1e6:.0f} GB/s"
    our_note = kept_note
    if dense and ceiling_gbs:
        our_note = f"ours at {nbytes / our_ms / 1e6 / ceiling_gbs * 100:.0f}% of the copy rate"
    rows = []
    for peer in case.peers:
        reason = peer_available(peer)
        if reason is not None:
            if reason not in notes:
                notes.append(reason)
            continue
        if peer == "sdpa-math" and case.S * case.B * case.H * case.D * 2 * 2 > 24 * 2 ** 30:
            rows.append(Row(case.label, peer, None, our_ms, bytes=nbytes,
                            note="skipped: math expands k/v to every query head (over 24 GiB)"))
            continue
        try:
            fn = PEERS[peer](case, x)
            out = fn().float()
            peer_ms = time_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a peer refusing a configuration is a result
            msg = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            rows.append(Row(case.label, peer, None, our_ms, bytes=nbytes, note=msg))
            continue
        max_abs = max_rel = None
        if not peer.startswith("ours"):
            max_abs, max_rel = compare(our_out, out)
        rows.append(Row(case.label, peer, peer_ms, our_ms, max_abs, max_rel, bytes=nbytes,
                        seqlen=case.S, direction="decode", note=our_note))
        if progress:
            progress()
    if not case.peers:
        rows.append(Row(case.label, "-", None, our_ms, bytes=nbytes, seqlen=case.S, note=our_note))
    del x
    torch.cuda.empty_cache()
    return rows


def sections(quick: bool) -> list[tuple[str, list[DecodeCase]]]:
    sdpa_peers = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "flex", "flash-sparse-attn")
    lengths = (8192,) if quick else (8192, 32768)
    plain = [DecodeCase(f"B64 Sq1 H32 Hk8 D128 cache {S}", 64, 32, 8, 128, S, peers=sdpa_peers)
             for S in lengths]
    if not quick:
        plain.append(DecodeCase("B1 Sq1 H32 Hk8 D128 cache 32768 (splits)", 1, 32, 8, 128, 32768,
                                peers=("sdpa-flash", "flex")))
        plain.append(DecodeCase("B64 Sq4 H32 Hk8 D128 cache 8192, 4 appended (speculative)", 64, 32,
                                8, 128, 8192, Sq=4, append=True))
    sparse = [DecodeCase("B64 Sq1 H32 Hk8 D128 cache 32768, top-1024 keys bias[B,Hk,1,S]", 64, 32,
                         8, 128, 32768, topk=1024, peers=("ours-no-mask", "flex", "sdpa-efficient"))]
    paged = [DecodeCase(f"B64 Sq1 H32 Hk8 D128 cache 8192, pages of {p}", 64, 32, 8, 128, 8192,
                        page_size=p, peers=("ours-contiguous",)) for p in (16, 256)]
    return [("decoding over a full cache (GB/s of cache bytes read)", plain),
            ("key-wise top-w mask: only the kept keys are read", sparse),
            ("paged cache against the contiguous one", paged)]


def run_decode_report(quick: bool = False, progress_factory=None) -> tuple[list[Section], list[str]]:
    """(sections, notes) for common.format_report; the first section is the copy ceiling."""
    notes: list[str] = []
    ceiling = copy_ceiling_row()
    ceiling_gbs = ceiling.bytes / ceiling.ours_ms / 1e6
    out = [Section("memory-bandwidth ceiling on this card", [ceiling])]
    plan = sections(quick)
    total = sum(len(c.peers) or 1 for _, cases in plan for c in cases)
    bar = progress_factory(total) if progress_factory else None
    for title, cases in plan:
        sec = Section(title)
        for case in cases:
            sec.rows += run_case(case, notes, ceiling_gbs, bar.update if bar else None)
        out.append(sec)
    if bar:
        bar.close()
    notes.append("flash-sparse-attn's top-k decode (gather_kv_indices) is not compared: it applies "
                 "a thresholded softmax, not the spec's")
    return out, notes


run = run_decode_report  # the signature flash_dma.cli's runners take: (quick, progress_factory)
