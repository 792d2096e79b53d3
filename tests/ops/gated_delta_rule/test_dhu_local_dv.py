"""bwd_dhu forming the intra-chunk dv itself (gdn_dhu_local_dv: no local_dv pass): every gradient
against the fp64 reference, with and without a gate, GQA, odd lengths, varlen with empty and
single-token sequences, the state passes cut into segments of one chunk; the same gradients as
with the local_dv pass; and the rule (never with gk)."""
import pytest
import torch

from conftest import ON_GPU
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides

from .cases import check_against_reference, cu_from_lengths, make_inputs

DTYPE = torch.bfloat16 if ON_GPU else torch.float16

CASES = {  # name: (B, T, H, HV, K, V, gate, states, varlen lengths or None, chunks per segment)
    "g-odd-T": (2, 131, 2, 2, 32, 32, "g", True, None, None),
    "no-gate-gqa": (1, 100, 1, 2, 32, 16, "none", False, None, None),
    "varlen-empty-single": (1, 200, 1, 1, 32, 32, "g", True, [1, 70, 0, 129], None),
    "cut-one-chunk": (1, 200, 1, 1, 32, 32, "g", True, None, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dhu_local_dv(name):
    B, T, H, HV, K, V, gate, states, lengths, cut = CASES[name]
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, DTYPE, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    grads = {}
    for fold in (True, False):
        chosen = {"gdn_dhu_local_dv": fold, **({"gdn_chunks_per_segment": cut} if cut else {})}
        with overrides(**chosen):
            layout = chunk_layout(B, T, kwargs.get("cu_seqlens"))
            assert plan_call(inputs["q"], inputs["v"], gate != "none", False, layout).dhu_local_dv_on() is fold
            torch.manual_seed(1)  # the same output cotangents for both
            _, grads[fold] = check_against_reference(inputs, DTYPE, **kwargs)
    for leaf, got in grads[True].items():
        want = grads[False][leaf].double()
        err = float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < 5e-3, f"d{leaf}: relative error {err:.2e} between the folded dv and the local_dv pass"


def test_dhu_local_dv_rule():
    """Off on the CPU by rule; never with gk (forced: an error naming the choice)."""
    q = torch.empty(1, 128, 2, 32, dtype=torch.float16)
    layout = chunk_layout(1, 128, None)
    if not ON_GPU:
        assert plan_call(q, q, True, False, layout).dhu_local_dv.value is False
    assert plan_call(q, q, True, True, layout).dhu_local_dv.value is False
    with overrides(gdn_dhu_local_dv=True), pytest.raises(ValueError, match="gdn_dhu_local_dv=True"):
        plan_call(q, q, True, True, layout)
