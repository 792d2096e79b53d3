"""The fp64 references themselves (no kernels: fast): the recurrence equals the chunk form, the
state-gradient reference equals autograd through the chunk form, packed sequences are separate."""
import pytest
import torch

from conftest import DEVICE
from helpers import rel_err
from flash_dma.ops.gated_delta_rule.reference import (bwd_dhu_reference, chunk_form_reference,
                                                      chunk_local_cumsum, gated_delta_rule_reference)

from .cases import cu_from_lengths, make_inputs


@pytest.mark.parametrize("gate,lengths", [("g", None), ("gk", None), ("g+gk", [1, 64, 0, 37, 70])])
def test_reference_chunk_form_and_state_gradient(gate, lengths):
    """The recurrence equals the chunk form; the state gradients of autograd through the chunk
    form are what bwd_dhu_reference computes (dh, dv2, dh0)."""
    B, HV, K, V = (2 if lengths is None else 1), 2, 16, 32
    T = 150 if lengths is None else sum(lengths)
    cu = None if lengths is None else cu_from_lengths(lengths)
    n = B if lengths is None else len(lengths)
    x = make_inputs(B, T, 1, HV, K, V, torch.float64, gate, True, n_seqs=n)
    x["initial_state"] = x["initial_state"].double()
    scale = 0.3
    o, final = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                          x["initial_state"], True, cu_seqlens=cu, gk=x["gk"])
    cf = chunk_form_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                              x["initial_state"], cu, x["gk"])
    assert rel_err(cf["o"], o) < 1e-12 and rel_err(cf["final_state"], final) < 1e-12

    state_probe = torch.zeros_like(cf["h_end"], requires_grad=True)
    v_new_probe = torch.zeros_like(cf["v_new"], requires_grad=True)
    h0 = x["initial_state"].clone().requires_grad_()
    probed = chunk_form_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, h0, cu, x["gk"],
                                  state_probe=state_probe, v_new_probe=v_new_probe)
    do, dht = torch.randn_like(o), torch.randn_like(final)
    want_dh, want_dv2, want_dh0 = torch.autograd.grad((probed["o"], probed["final_state"]),
                                                      (state_probe, v_new_probe, h0), (do, dht))
    # dv: the gradient of v_new through the intra-chunk part of o alone
    gate_cum = cf["g_cum"][..., None] + (cf["gk_cum"] if x["gk"] is not None else 0)
    v_new = cf["v_new"].detach().requires_grad_()
    q_up = x["q"].repeat_interleave(HV, 2) * torch.exp(gate_cum)
    k_down = x["k"].repeat_interleave(HV, 2) * torch.exp(-gate_cum)
    intra = torch.zeros_like(o)
    starts = [0] + ([] if cu is None else cu.tolist()[1:-1])
    for s, e in zip(starts, ([T] if cu is None else cu.tolist()[1:])):
        for c in range(s, e, 64):
            rows = slice(c, min(c + 64, e))
            scores = torch.einsum("bihk,bjhk->bhij", q_up[:, rows], k_down[:, rows]).tril()
            intra[:, rows] = scale * torch.einsum("bhij,bjhv->bihv", scores, v_new[:, rows])
    (dv,) = torch.autograd.grad(intra, v_new, do)
    dh, dh0, dv2 = bwd_dhu_reference(cf["q_gated"], cf["k_gated"], cf["w"], do, dv,
                                     g=cf["g_cum"] if x["g"] is not None else None, gk=cf["gk_cum"],
                                     h0=h0, dht=dht, scale=scale, cu_seqlens=cu)
    assert want_dh.norm() > 0 and want_dh0.norm() > 0
    for name, got, want in (("dh", dh, want_dh), ("dv2", dv2, want_dv2), ("dh0", dh0, want_dh0)):
        assert rel_err(got, want) < 1e-12, name
    # and dh0 through the recurrence itself
    h0_rec = x["initial_state"].clone().requires_grad_()
    o_rec, final_rec = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                                  h0_rec, True, cu_seqlens=cu, gk=x["gk"])
    (dh0_rec,) = torch.autograd.grad((o_rec, final_rec), h0_rec, (do, dht))
    assert rel_err(dh0, dh0_rec) < 1e-12


def test_reference_varlen_is_separate_sequences():
    lengths = [3, 0, 64, 1, 70]
    cu = cu_from_lengths(lengths)
    x = make_inputs(1, sum(lengths), 2, 2, 16, 16, torch.float64, "g+gk", True, n_seqs=len(lengths))
    o, final = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                          initial_state=x["initial_state"], output_final_state=True,
                                          cu_seqlens=cu, gk=x["gk"])
    for n, (s, e) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
        if s == e:
            assert torch.equal(final[n], x["initial_state"][n])
            continue
        part = {name: t[:, s:e] for name, t in x.items() if name != "initial_state"}
        o_n, final_n = gated_delta_rule_reference(part["q"], part["k"], part["v"], part["g"],
                                                  part["beta"],
                                                  initial_state=x["initial_state"][n:n + 1],
                                                  output_final_state=True, gk=part["gk"])
        assert rel_err(o[:, s:e], o_n) < 1e-14 and rel_err(final[n:n + 1], final_n) < 1e-14


def test_chunk_local_cumsum():
    lengths = [1, 64, 0, 70]
    cu = cu_from_lengths(lengths)
    x = torch.randn(1, sum(lengths), 3, device=DEVICE)
    got = chunk_local_cumsum(x, 64, cu)
    for s, e in ((0, 1), (1, 65), (65, 129), (129, 135)):
        assert torch.allclose(got[:, s:e], x[:, s:e].double().cumsum(1).float(), atol=1e-6)
    y = torch.randn(2, 130, 2, 4, device=DEVICE)
    got = chunk_local_cumsum(y, 64)
    for s, e in ((0, 64), (64, 128), (128, 130)):
        # (against an fp64 cumsum: a GPU's fp32 scan rounds differently from the fp64 reference)
        assert torch.allclose(got[:, s:e], y[:, s:e].double().cumsum(1).float(), atol=1e-6)
