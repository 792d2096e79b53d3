"""flash-dma as a transformers attention implementation: tiny randomly initialised Llama / Qwen2 /
Mistral models built from configs (no download) give sdpa's logits and gradients, with padding,
GQA, a KV cache, sliding windows; unsupported features raise or fall back with a warning."""
import copy
import warnings

import pytest
import torch

from conftest import DEVICE, ON_GPU
from helpers import assert_as_accurate_as, rel_err

transformers = pytest.importorskip("transformers")
from flash_dma.integrations.transformers import register  # noqa: E402

NAME = register()
CPU_DTYPE = torch.float16  # the attention kernels take fp16/bf16; the interpreter computes bf16 products wrongly


def tiny_config(kind, **overrides):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    common.update(overrides)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)  # q/k/v projections with biases
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=5, **common)
    raise ValueError(kind)


def model_pair(kind, dtype=CPU_DTYPE, **overrides):
    torch.manual_seed(0)
    config = tiny_config(kind, **overrides)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reference = reference.to(DEVICE, dtype)
    ours = copy.deepcopy(reference)
    ours.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == NAME
    return reference, ours


def batch(vocab=96, B=3, S=24, left_pad=(0, 7, 15)):
    ids = torch.randint(0, vocab, (B, S), device=DEVICE)
    mask = torch.ones(B, S, dtype=torch.long, device=DEVICE)
    for b, n in enumerate(left_pad):
        mask[b, :n] = 0
    return ids, mask


def train_step(models, ids, mask):
    """One forward and backward of each model on the same batch (loss over the real tokens)."""
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for model in models:
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append(out)
    return results


def check_against_fp32_truth(reference, ours, ids, mask, floor):
    """Half-precision logits and gradients of ours are judged by the error sdpa makes at the same
    precision, both measured from the fp32 sdpa model with the same weights (FlashAttention's
    test rule), not by a fixed bound between two half-precision results."""
    truth = copy.deepcopy(reference).float()
    truth.zero_grad(set_to_none=True)
    reference_out, ours_out, truth_out = train_step((reference, ours, truth), ids, mask)
    real = mask.bool()
    assert_as_accurate_as("logits", ours_out.logits[real].float(), reference_out.logits[real].float(),
                          truth_out.logits[real], floor=floor)
    for (name, p_ref), p, p_truth in zip(reference.named_parameters(), ours.parameters(), truth.parameters()):
        assert_as_accurate_as(name, p.grad.float(), p_ref.grad.float(), p_truth.grad, floor=floor)


def logits_error(a, b, mask):
    real = mask.bool()
    return rel_err(a[real].float(), b[real].float())


@pytest.mark.parametrize("kind, padded", [("llama", False), ("qwen2", True)])
def test_logits_and_gradients_match_sdpa(kind, padded):
    reference, ours = model_pair(kind, num_hidden_layers=2)  # two layers share one packing
    ids, mask = batch()
    if not padded:
        mask = torch.ones_like(mask)
    check_against_fp32_truth(reference, ours, ids, mask, floor=2e-3)


def test_decoding_with_a_cache_matches_sdpa():
    reference, ours = model_pair("llama")
    ids, mask = batch(S=16, left_pad=(0, 4, 9))
    step_ids = torch.randint(0, 96, (3, 2), device=DEVICE)
    logits = []
    with torch.no_grad():
        for model in (reference, ours):
            cache = transformers.DynamicCache(config=model.config)
            prompt = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype, device=DEVICE)], 1)
            one = model(step_ids[:, :1], attention_mask=step_mask, past_key_values=cache, use_cache=True)
            step_mask = torch.cat([step_mask, torch.ones(3, 1, dtype=mask.dtype, device=DEVICE)], 1)
            two = model(step_ids[:, 1:], attention_mask=step_mask, past_key_values=cache, use_cache=True)
            logits.append((prompt.logits, one.logits, two.logits))
    assert logits_error(logits[1][0], logits[0][0], mask) < 5e-3
    for step in (1, 2):
        assert rel_err(logits[1][step].float(), logits[0][step].float()) < 5e-3


def test_sliding_window_mask_matches_sdpa():
    reference, ours = model_pair("mistral")
    ids, mask = batch()
    with torch.no_grad():
        a = reference(ids, attention_mask=mask).logits
        b = ours(ids, attention_mask=mask).logits
    assert logits_error(b, a, mask) < 5e-3


def test_training_dropout_is_refused():
    _, ours = model_pair("llama", attention_dropout=0.1)
    ours.train()
    ids, mask = batch()
    with pytest.raises(ValueError, match="dropout"):
        ours(ids, attention_mask=mask)


def test_output_attentions_is_refused():
    _, ours = model_pair("llama")
    ids, mask = batch()
    with pytest.raises(ValueError, match="output_attentions"):
        ours(ids, attention_mask=mask, output_attentions=True)


def test_fp32_falls_back_to_sdpa_with_one_warning():
    reference, ours = model_pair("llama", dtype=torch.float32)
    ids, mask = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = ours(ids, attention_mask=mask).logits
        ours(ids, attention_mask=mask)
    ours_warnings = [w for w in caught if "flash-dma attention" in str(w.message)]
    assert len(ours_warnings) == 1 and "float32" in str(ours_warnings[0].message)
    a = reference(ids, attention_mask=mask).logits
    assert logits_error(b, a, mask) < 1e-5


def test_register_refuses_names_transformers_takes_for_flash_attention():
    with pytest.raises(ValueError, match="flash"):
        register("flash_dma")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gpu_real_size_bf16(kind):
    reference, ours = model_pair(kind, dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                 vocab_size=4096, max_position_embeddings=2048)
    ids, mask = batch(vocab=4096, B=4, S=1024, left_pad=(0, 100, 517, 1000))
    check_against_fp32_truth(reference, ours, ids, mask, floor=1e-2)
