import torch

# Relative-error bounds against an fp64 reference (||x - ref|| / ||ref||). bf16 at 1e-2 since the
# WY-backward race fix (session 9): every GPU test passed there on the H200
# (bench/results/gpu-tests-H200-20261121-s9c.log).
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, ref64 = x.double(), ref.double()
    assert not torch.isnan(x64).any(), "NaN in the result"
    denom = ref64.norm().item()
    diff = (x64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
                 magnitude: float | None = None):
    """magnitude: measure the error against this norm when the reference itself may be ~0."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(x, ref)
    if magnitude is not None:
        diff = (x.double() - ref.double()).norm().item()
        err = diff / magnitude if magnitude > 0 else diff
    bound = TOLERANCE[dtype] * scale
    assert err <= bound, f"{name}: relative error {err:.2e} > {bound:.1e}"
    return err


def assert_as_accurate_as(name: str, x: torch.Tensor, peer: torch.Tensor, ref: torch.Tensor, factor: float = 2.0,
                          floor: float = 1e-3, magnitude: float | None = None):
    """x is at most `factor` times as far from the fp64 `ref` as `peer` is, where peer is the same
    computation in eager PyTorch at x's precision (FlashAttention's test rule: a half-precision
    result is judged by what that precision costs a plain implementation, not by a fixed bound).
    magnitude: measure both errors against this norm instead of ref's."""
    assert x.shape == ref.shape == peer.shape, f"{name}: shapes {tuple(x.shape)}, {tuple(peer.shape)}, {tuple(ref.shape)}"
    scale = magnitude if magnitude is not None else ref.double().norm().item()
    scale = scale if scale > 0 else 1.0
    assert not torch.isnan(x).any(), f"{name}: NaN in the result"
    err = (x.double() - ref.double()).norm().item() / scale
    peer_err = (peer.double() - ref.double()).norm().item() / scale
    bound = max(factor * peer_err, floor)
    assert err <= bound, (f"{name}: relative error {err:.2e} > {bound:.1e} ({factor}x the eager peer's "
                          f"{peer_err:.2e}, at least {floor:.0e})")
    return err, peer_err


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor):
    """Same +inf pattern (rows with no visible key), finite entries close."""
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), "lse: +inf rows differ from the reference"
    finite = torch.isfinite(ref)
    if finite.any():
        assert (lse[finite].double() - ref[finite]).abs().max().item() < 1e-2


def assert_same(name: str, got, ref):
    """Bit-equal to the eager call (and present, and not NaN)."""
    assert got is not None and ref is not None, f"{name}: missing"
    assert not torch.isnan(got).any(), f"{name}: NaN"
    assert torch.equal(got, ref), f"{name}: differs from the eager call"


def assert_compiled_matches_eager(compiled, fn, leaves):
    """The compiled and the eager function give the same loss and the same gradient of every
    leaf, bit for bit (the custom ops run the same kernels)."""
    ref = fn(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    got = compiled(*leaves)
    grads = torch.autograd.grad(got, leaves)
    assert_same("loss", got, ref)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_same(f"grad of input {i}", g, r)
