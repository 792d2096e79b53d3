"""GatedDeltaNet and KimiDeltaAttention against an fp64 token-by-token reference: outputs and
gradients, padding and packing, generation state, argument errors; FLA checkpoints (where FLA is
installed)."""
import pytest
import torch

from conftest import DEVICE
from helpers import assert_close
from layer_reference import delta_layer_reference, double_params
from flash_dma import GatedDeltaNet, KimiDeltaAttention

# the interpreter runs fp32 (and fp16) here; one small shape keeps the CPU time low
CPU_DTYPE = torch.float32


def make(kind, dtype=CPU_DTYPE, **kw):
    torch.manual_seed(0)
    base = dict(hidden_size=32, head_dim=16, num_heads=2)
    if kind == "gdn":
        layer = GatedDeltaNet(expand_v=1, **base, **kw)
    else:
        layer = KimiDeltaAttention(**base, **kw)
    with torch.no_grad():  # a non-trivial output gate / norm
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer.to(DEVICE, dtype)


@pytest.mark.parametrize("kind, kw", [("gdn", dict(num_v_heads=4, allow_neg_eigval=True)),
                                      ("kda", {}), ("kda", dict(disable_recompute=True))])
def test_output_and_gradients_match_reference(kind, kw):
    layer = make(kind, **kw)
    x = torch.randn(1, 20, 32, device=DEVICE)
    y = layer(x)
    P = double_params(layer)
    ref = delta_layer_reference(layer, P, x)
    assert_close("out", y, ref, torch.float32, scale=20)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref.backward(grad.double())
    for name, param in layer.named_parameters():
        assert_close(name, param.grad, P[name].grad, torch.float32, scale=50)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_disable_recompute_reaches_the_op(kind, monkeypatch):
    from flash_dma.layers import gated_deltanet
    seen = []
    real = gated_deltanet.chunk_gated_delta_rule

    def recording(*args, **kwargs):
        seen.append(kwargs["disable_recompute"])
        return real(*args, **kwargs)
    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule", recording)
    for flag in (False, True):
        make(kind, disable_recompute=flag)(torch.randn(1, 8, 32, device=DEVICE))
    assert seen == [False, True]


def test_kda_gates_stay_bounded():
    layer = make("kda")
    with torch.no_grad():
        layer.A_log.fill_(5.0)  # steep decay rates: the bound holds the per-token gate in (-5, 0)
    x = torch.randn(1, 8, 32, device=DEVICE) * 4
    _, gk, _ = layer._gates(x)
    assert gk.min() >= -5 and gk.max() <= 0


def test_padding_and_packing_match_separate_rows():
    layer = make("gdn")
    x = torch.randn(2, 12, 32, device=DEVICE)
    real = torch.ones(2, 12, dtype=torch.bool, device=DEVICE)
    real[0, :5] = False  # left padding
    real[1, 9:] = False  # right padding
    y = layer(x, attention_mask=real)
    ref = delta_layer_reference(layer, double_params(layer), x, real)
    assert_close("padded", y, ref, torch.float32, scale=20)
    assert (y[~real] == 0).all()
    packed = torch.cat([x[0, real[0]], x[1, real[1]], x[0, :2]]).unsqueeze(0)  # 2 rows past the end
    cu = torch.tensor([0, 7, 16], dtype=torch.int32, device=DEVICE)
    yp = layer(packed, cu_seqlens=cu)
    assert_close("packed", yp[0, :16], torch.cat([y[0, real[0]], y[1, real[1]]]), torch.float32)
    assert (yp[0, 16:] == 0).all()


def test_generation_state_matches_full_forward():
    layer = make("gdn")
    x = torch.randn(1, 10, 32, device=DEVICE)
    full = layer(x)
    state = layer.init_state()
    parts = [layer(x[:, :7], past_key_values=state), layer(x[:, 7:8], past_key_values=state),
             layer(x[:, 8:], past_key_values=state)]  # a prompt, one token, two tokens
    # on the GPU fp32 products run as tf32 (Triton's default), here exactly
    assert_close("stepwise", torch.cat(parts, 1), full, torch.float32, scale=1 if DEVICE == "cpu" else 20)
    assert state.tokens_seen == 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3, num_v_heads=4), "num_v_heads"),
    (dict(head_dim=512), "head_dim"),
    (dict(expand_v=0.3), "expand_v"),
    (dict(mode="fused_recurrent"), "mode"),
    (dict(conv_size=0), "conv_size"),
    (dict(num_heads=0), "num_heads"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GatedDeltaNet(hidden_size=32, head_dim=kwargs.pop("head_dim", 16), **kwargs)


def test_bad_inputs():
    layer = make("gdn")
    x = torch.randn(2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(2, 8, 1, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[..., :16])
    with pytest.raises(TypeError, match="hidden_states"):
        layer(x.double())
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(hidden_size=32, head_dim=16, num_heads=2, lower_bound=1.0)
    with pytest.raises(ValueError, match="output_gate_activation"):
        GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=2, output_gate_activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gpu_real_size_bf16(kind):
    torch.manual_seed(0)
    layer = (GatedDeltaNet(hidden_size=1024, head_dim=128, num_heads=8, expand_v=1) if kind == "gdn"
             else KimiDeltaAttention(hidden_size=1024, head_dim=128, num_heads=8)).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 256, 1024, device=DEVICE, dtype=torch.bfloat16)
    real = torch.ones(2, 256, dtype=torch.bool, device=DEVICE)
    real[1, :100] = False
    y = layer(x, attention_mask=real)
    P = double_params(layer)
    ref = delta_layer_reference(layer, P, x, real)
    assert_close("out", y, ref, torch.bfloat16, scale=4)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref.backward(grad.double())
    for name in ("q_proj.weight", "v_proj.weight", "b_proj.weight", "A_log", "dt_bias", "o_norm.weight"):
        assert_close(name, dict(layer.named_parameters())[name].grad, P[name].grad, torch.bfloat16, scale=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_fla_checkpoint_moves_both_ways(kind):
    fla = pytest.importorskip("fla")
    torch.manual_seed(0)
    kw = dict(hidden_size=512, head_dim=64, num_heads=4, num_v_heads=8)
    if kind == "gdn":
        ours, theirs = GatedDeltaNet(expand_v=2, **kw), fla.layers.GatedDeltaNet(expand_v=2, **kw)
    else:  # the bounded (safe) gate on both sides
        ours = KimiDeltaAttention(safe_gate=True, lower_bound=-5.0, **kw)
        theirs = fla.layers.KimiDeltaAttention(safe_gate=True, lower_bound=-5.0, **kw)
        with torch.no_grad():
            theirs.A_log.uniform_(-1.0, 1.0)
    ours, theirs = ours.to(DEVICE, torch.bfloat16), theirs.to(DEVICE, torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    assert set(ours.state_dict()) == set(theirs.state_dict())
    x = torch.randn(2, 512, 512, device=DEVICE, dtype=torch.bfloat16)
    assert_close("fla -> flash-dma", ours(x), theirs(x)[0], torch.bfloat16, scale=4)
    theirs.load_state_dict(ours.state_dict())
