"""bwd_dhu taking on other passes' work: forming the intra-chunk dv itself (gdn_dhu_local_dv: no
local_dv pass) and applying w^T through T (gdn_dhu_w_from_t: no recompute of w). Every gradient
against the fp64 reference, with and without a gate, GQA, odd lengths, varlen with empty and
single-token sequences, the state passes cut into segments of one chunk; the same gradients as
without; and the rules (never with gk; w from T only where the state pass forms v_new from T)."""
import pytest
import torch

from conftest import ON_GPU
from flash_dma.ops.gated_delta_rule.layout import chunk_layout
from flash_dma.ops.gated_delta_rule.plan import plan_call
from flash_dma.runtime.config import overrides

from .cases import assert_same_gradients, check_against_reference, cu_from_lengths, make_inputs

DTYPE = torch.bfloat16 if ON_GPU else torch.float16

CASES = {  # name: (B, T, H, HV, K, V, gate, states, varlen lengths or None, chunks per segment)
    "g-odd-T": (2, 131, 2, 2, 32, 32, "g", True, None, None),
    "no-gate-gqa": (1, 100, 1, 2, 32, 16, "none", False, None, None),
    "varlen-empty-single": (1, 200, 1, 1, 32, 32, "g", True, [1, 70, 0, 129], None),
    "cut-one-chunk": (1, 200, 1, 1, 32, 32, "g", True, None, 1),
    # T kept from the forward (head dims of whole 64-wide tiles): w from T applies
    "K64-g-odd-T": (1, 131, 1, 1, 64, 64, "g", True, None, None),
    "K64-no-gate-varlen-gqa": (1, 150, 1, 2, 64, 64, "none", True, [1, 0, 85, 64], None),
}
FOLDS = {"local_dv": ("gdn_dhu_local_dv", {}),
         "w_from_t": ("gdn_dhu_w_from_t", {"gdn_backward_states_from_inverse": True})}


@pytest.mark.parametrize("fold, name", [("local_dv", n) for n in CASES if not n.startswith("K64")]
                         + [("w_from_t", n) for n in CASES if n.startswith("K64")]
                         + [("local_dv", "K64-g-odd-T")])
def test_dhu_folds(fold, name):
    B, T, H, HV, K, V, gate, states, lengths, cut = CASES[name]
    choice_name, needs = FOLDS[fold]
    torch.manual_seed(0)
    inputs = make_inputs(B, T, H, HV, K, V, DTYPE, gate, states, n_seqs=None if lengths is None else len(lengths))
    kwargs = {} if lengths is None else {"cu_seqlens": cu_from_lengths(lengths)}
    grads = {}
    for on in (True, False):
        chosen = {choice_name: on, **needs, **({"gdn_chunks_per_segment": cut} if cut else {})}
        with overrides(**chosen):
            layout = chunk_layout(B, T, kwargs.get("cu_seqlens"))
            plan = plan_call(inputs["q"], inputs["v"], gate != "none", False, layout)
            assert (plan.dhu_local_dv_on() if fold == "local_dv" else plan.dhu_w_from_t_on()) is on
            torch.manual_seed(1)  # the same output cotangents for both
            _, grads[on] = check_against_reference(inputs, DTYPE, **kwargs)
    assert_same_gradients(grads, 5e-3, f"{choice_name} on and off")


def test_dhu_fold_rules():
    """Off on the CPU by rule; never with gk, and w from T not where the backward's state pass
    reads w and u (forced: an error naming the choice)."""
    q = torch.empty(1, 128, 2, 64, dtype=torch.float16)
    layout = chunk_layout(1, 128, None)
    if not ON_GPU:
        plan = plan_call(q, q, True, False, layout)
        assert plan.dhu_local_dv.value is False and plan.dhu_w_from_t.value is False
    plan = plan_call(q, q, True, True, layout)
    assert plan.dhu_local_dv.value is False and plan.dhu_w_from_t.value is False
    for name in ("gdn_dhu_local_dv", "gdn_dhu_w_from_t"):
        with overrides(**{name: True}), pytest.raises(ValueError, match=f"{name}=True"):
            plan_call(q, q, True, True, layout)
    with overrides(gdn_dhu_w_from_t=True, gdn_backward_states_from_inverse=False), \
            pytest.raises(ValueError, match="gdn_dhu_w_from_t=True"):
        plan_call(q, q, True, False, layout)
