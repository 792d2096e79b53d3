"""The remembered-launch path (flash_dma/launch.py): a compiled kernel is reused only for calls
that Triton would specialise the same way."""
import pytest
import torch
import triton
import triton.language as tl

from flash_dma.runtime import launch as fast
from conftest import DEVICE


def _key(*args, **kwargs):
    return fast.signature_key("kernel", args, kwargs, 0)


def test_signature_tells_apart_what_specialisation_reads():
    base = torch.zeros(64, dtype=torch.float16, device=DEVICE)
    assert _key(base, 16, 0.5, BLOCK=32) == _key(base.clone(), 16, 2.0, BLOCK=32)  # float values free
    different = [
        _key(base[1:], 16, 0.5, BLOCK=32),  # 2-byte offset: not 16-byte aligned
        _key(base.float(), 16, 0.5, BLOCK=32),  # dtype
        _key(base, 17, 0.5, BLOCK=32),  # integer values (divisibility, ==1) are kept exactly
        _key(base, 1, 0.5, BLOCK=32),
        _key(base, 16, 1, BLOCK=32),  # an int where a float was
        _key(base, 16, 0.5, BLOCK=64),  # constexprs and options
        _key(base, 16, None, BLOCK=32),
        _key(base, True, 0.5, BLOCK=32),  # a bool (i1) where an int was: True == 1 in Python
    ]
    assert len({_key(base, 16, 0.5, BLOCK=32), *different}) == len(different) + 1
    assert _key(base, 1, 0.5, BLOCK=32) != _key(base, True, 0.5, BLOCK=32)
    parameter = torch.nn.Parameter(base.clone())
    assert _key(parameter, 16, 0.5, BLOCK=32) == _key(base, 16, 0.5, BLOCK=32)


def test_unmodelled_arguments_take_tritons_path():
    with pytest.raises(fast._Unkeyable):
        _key([1, 2])


@triton.jit
def _strided_scale(src, dst, n, stride, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(src + offs * stride, mask=keep)
    tl.store(dst + offs, x * factor, mask=keep)


@pytest.mark.gpu
def test_reuse_only_where_specialisation_matches(monkeypatch):
    if not fast.fast_launch_enabled():
        pytest.skip("remembered launches are off for this Triton version")
    fast.forget()
    slow_calls = []
    real_run = _strided_scale.run
    monkeypatch.setattr(_strided_scale, "run", lambda *a, **k: slow_calls.append(1) or real_run(*a, **k))
    src = torch.randn(4096, device="cuda")
    calls = [(src, 1000, 1), (src, 1000, 1), (src[1:], 1000, 1), (src, 1000, 2), (src, 1001, 1),
             (src, 1, 1), (src, 1000, 1), (src[1:], 1000, 1)]
    for i, (s, n, stride) in enumerate(calls):
        out = torch.full((n,), float("nan"), device="cuda")
        factor = 0.5 + i
        fast.launch(_strided_scale, (triton.cdiv(n, 128),), s, out, n, stride, factor, BLOCK=128)
        torch.testing.assert_close(out, s[: n * stride : stride] * factor, rtol=0, atol=0)
    # five distinct signatures went through Triton; the three repeats were launched directly
    assert len(slow_calls) == 5
    assert len(fast._ENTRIES) == 5


@pytest.mark.gpu
def test_replayed_launches_reach_launch_hooks():
    """A launch hook (Triton's profilers use them) sees replayed launches too, with their
    metadata; without one the replay skips building it."""
    if not fast.fast_launch_enabled():
        pytest.skip("remembered launches are off for this Triton version")
    fast.forget()
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    src = torch.randn(1000, device="cuda")
    out = torch.empty_like(src)
    fast.launch(_strided_scale, (8,), src, out, 1000, 1, 2.0, BLOCK=128)  # Triton's path, remembered
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        fast.launch(_strided_scale, (8,), src, out, 1000, 1, 3.0, BLOCK=128)  # replayed
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    fast.launch(_strided_scale, (8,), src, out, 1000, 1, 4.0, BLOCK=128)  # replayed, no hook
    torch.testing.assert_close(out, src * 4.0, rtol=0, atol=0)
    assert seen == ["_strided_scale"]
