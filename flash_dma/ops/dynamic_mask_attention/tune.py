"""Attention's launch sweep (`flash-dma tune attention`, bench/tune_attention.py): the candidate
configurations of each kernel in launch_table.py and the representative shapes they are timed on.

Each kernel is timed with each candidate while the others keep their current choice, through
runtime.config.overrides(<kernel>=LaunchConfig(...)); the winner is stored under the variant
the op asks for at that shape (e.g. "plain-dq-list-full" for the fused-dq key-major pass), which
is the key plan.py looks up.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ...runtime import config
from ...runtime.hardware import device_info
from . import autograd, launch_table

C = config.LaunchConfig
CANDIDATES = {
    "attn_fwd": [C(128, 64, 8, 3), C(128, 64, 8, 2), C(128, 128, 8, 2), C(128, 128, 8, 3), C(128, 64, 4, 3),
                 C(128, 64, 8, 3, exp2_poly=True), C(128, 64, 4, 3, exp2_poly=True),
                 C(128, 128, 8, 2, exp2_poly=True), C(64, 64, 4, 3)],
    "attn_bwd_dkdv": [C(64, 64, 4, 2), C(64, 64, 8, 2), C(64, 64, 4, 3), C(32, 64, 4, 3),
                      C(128, 64, 8, 2), C(64, 128, 8, 2), C(32, 128, 8, 2), C(32, 128, 8, 3), C(128, 32, 4, 2),
                      C(32, 32, 4, 2), C(64, 32, 4, 2), C(32, 64, 8, 2), C(64, 32, 8, 2)],
    "attn_bwd_dq": [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 32, 8, 3), C(64, 64, 4, 3),
                    C(64, 128, 8, 2), C(128, 128, 8, 2), C(64, 32, 4, 3), C(128, 64, 4, 2),
                    C(64, 64, 8, 1), C(64, 32, 8, 2), C(32, 64, 4, 2)],
}
QUICK_CANDIDATES = 3  # with --quick: the table's entry and the first few others
HEAD_DIMS, QUICK_HEAD_DIMS = (64, 128, 256), (128,)
VARIANTS = ("bias", "plain")
# a candidate whose output or gradients differ more than this (relative norm) from the table's
# configuration computed something else (a miscompile): skipped, never stored
WRONG_RESULT = 5e-2


def candidates_for(kernel: str, block_d: int, dtype: torch.dtype, variant: str, info, quick: bool) -> list:
    """The table's entry first (the baseline of the sweep), then the listed candidates whose
    staged tiles fit the device's shared memory."""
    first = launch_table.default_config(kernel, info, block_d, dtype.itemsize, variant)
    bias_bytes = launch_table.variant_bias_bytes(kernel, variant, dtype.itemsize)
    fits = [c for c in CANDIDATES[kernel] if c != first and launch_table.estimate_shared_memory(
        kernel, c, block_d, dtype.itemsize, bias_bytes) <= info.shared_memory_per_block]
    out = [first] + fits
    return out[:QUICK_CANDIDATES] if quick else out


def _record_plans(backward) -> tuple:
    """(forward plan, backward plan) of the one backward `backward` runs."""
    seen, real = [], autograd.plan_backward
    autograd.plan_backward = lambda fwd, *a: seen.append((fwd, real(fwd, *a))) or seen[-1][1]
    try:
        backward()
    finally:
        autograd.plan_backward = real
    return seen[0]


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = ours.double(), ref.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cases(device: torch.device, quick: bool, head_dims: Sequence[int] | None = None,
          variants: Sequence[str] = VARIANTS, kernels: Sequence[str] = launch_table.KERNELS,
          causal: bool = False, timer=None) -> Iterator:
    """Sweep cases on a representative shape per head dim and variant: B=2, S=4096, 16 heads
    (8 at head dim 256), bf16, a full [B, H, S, S] bias for "bias"."""
    from ...benchmarks.common import time_ms
    from ...benchmarks.tune import TuneCase
    from . import flash_dma_func
    timer = timer or time_ms
    info = device_info(device)
    dtype = torch.bfloat16
    for d in head_dims or (QUICK_HEAD_DIMS if quick else HEAD_DIMS):
        for variant in variants:
            # one generator per shape, which owns its tensors: each yielded case's timing closure
            # keeps them for as long as the case is kept (the sweep drops it once timed)
            yield from _shape_cases(device, quick, d, variant, kernels, causal, timer, info, dtype,
                                    TuneCase, flash_dma_func)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _shape_cases(device, quick, d, variant, kernels, causal, timer, info, dtype, TuneCase,
                 flash_dma_func) -> Iterator:
    H = 16 if d <= 128 else 8
    B, S = 2, 4096
    q, k, v = (torch.randn(B, S, H, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    bias = (torch.randn(B, H, S, S, device=device, dtype=dtype, requires_grad=True)
            if variant == "bias" else None)
    leaves = [q, k, v] + ([bias] if bias is not None else [])
    dout = torch.randn_like(q)

    def forward():
        return flash_dma_func(q, k, v, attn_bias=bias, is_causal=causal)

    # what the op runs at this shape with its current choices: the variant each kernel
    # asks for, and the results a candidate must reproduce
    out = forward()
    plans = _record_plans(lambda: torch.autograd.grad(out, leaves, dout))
    reference = [out.detach()] + [g.detach() for g in torch.autograd.grad(forward(), leaves, dout)]
    passes = [plans[0].forward, plans[1].dkdv, plans[1].dq]
    for kernel in kernels:
        asked = next((p.variant for p in passes if p is not None and p.kernel == kernel), None)
        if asked is None:  # (e.g. the dq kernel where dq is fused into the key-major pass)
            continue

        def time_config(cfg, kernel=kernel):
            with config.overrides(**{kernel: cfg}):
                out = forward()
                grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
                for ours, ref in zip([out] + list(grads), reference):
                    err = _relative_error(ours, ref)
                    if not err <= WRONG_RESULT:  # (NaN fails too)
                        raise ValueError(f"wrong result: relative error {err:.3g}")
                if kernel == "attn_fwd":
                    return timer(forward)
                return timer(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))

        yield TuneCase(kernel, device, d, dtype, asked,
                       candidates_for(kernel, config.head_dim_block(d), dtype, asked, info, quick),
                       time_config, label=f"{kernel} D{d} {asked}" + (" causal" if causal else ""))


def spills_seen(kernel: str, device: torch.device) -> list[int]:
    """Register spills of the kernel's compiled variants so far (for the sweep's summary)."""
    try:
        fn = launch_table.triton_kernel(kernel)
        return sorted({ck.n_spills for ck in fn.device_caches[device.index or 0][0].values()})
    except Exception:  # noqa: BLE001 - Triton internals, best effort
        return []
