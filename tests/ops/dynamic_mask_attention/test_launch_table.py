"""Attention's launch table: defaults that fit the device, variants, and where a choice came from."""
import pytest
import torch

from flash_dma.ops.dynamic_mask_attention import launch_table
from flash_dma.runtime import config, tuning_cache
from flash_dma.runtime.hardware import DeviceInfo


def test_defaults_fit_shared_memory():
    small = DeviceInfo("small-gpu", 80, 108, 100 * 1024, 0)
    hopper = DeviceInfo("hopper", 90, 132, 227 * 1024, 0)
    for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
        for d in (32, 64, 128, 256):
            for info in (small, hopper):
                for variant in ("", "bias", "bias-fp32", "plain", "plain-dense", "plain-dq", "bias-dq",
                                "plain-dq-list", "bias-dq-list", "plain-dq-list-full", "bias-list-full"):
                    cfg = launch_table.default_config(kernel, info, d, 2, variant)
                    bias_bytes = launch_table.variant_bias_bytes(kernel, variant, 2)
                    assert launch_table.estimate_shared_memory(kernel, cfg, d, 2, bias_bytes) \
                        <= info.shared_memory_per_block, (kernel, d, info.name, variant, cfg)


def test_forward_stages_fit_the_bias_it_stages():
    """The shared-memory estimate counts the bias tile the forward stages, at its element size:
    the no-mask, no-bias forward at D128 keeps 3 stages of 128-key tiles on Hopper (a bias tile
    would not fit them), and a 16-bit bias at D256 two stages (an fp32 one only one)."""
    hopper = DeviceInfo("hopper", 90, 132, 227 * 1024, 0)
    cfg = launch_table.default_config("attn_fwd", hopper, 128, 2, "plain-dense")
    assert (cfg.block_n, cfg.num_stages) == (128, 3)
    assert launch_table.estimate_shared_memory("attn_fwd", cfg, 128, 2, bias_bytes=2) > hopper.shared_memory_per_block
    # a 16-bit bias tile leaves room for the second stage at D256 that an fp32 one does not
    assert launch_table.default_config("attn_fwd", hopper, 256, 2, "bias").num_stages == 2
    assert launch_table.default_config("attn_fwd", hopper, 256, 2, "bias-fp32").num_stages == 1


def test_variant_defaults_fall_back_to_their_longest_listed_prefix():
    hopper = DeviceInfo("hopper", 90, 132, 227 * 1024, 0)
    listed = launch_table.HOPPER_TABLE
    for variant, expected in (("plain-dq-list", ("attn_bwd_dkdv", 128, "plain-dq-list")),
                              ("bias-dq-list", ("attn_bwd_dkdv", 128, "bias-dq")),
                              ("bias-list", ("attn_bwd_dkdv", 128)),
                              ("plain-dq-list-full", ("attn_bwd_dkdv", 128, "plain-dq-list-full")),
                              ("bias-list-full", ("attn_bwd_dkdv", 128)),
                              ("", ("attn_bwd_dkdv", 128))):
        assert launch_table.default_config("attn_bwd_dkdv", hopper, 128, 2, variant) == listed[expected]
    assert listed[("attn_bwd_dkdv", 128, "plain-dq-list")] != listed[("attn_bwd_dkdv", 128, "plain-dq")]




def test_select_config_names_its_source(tmp_path, monkeypatch):
    """override > interpreter (CPU) ; on a GPU: tuning cache > table > rule (fitted)."""
    cpu = torch.device("cpu")
    assert launch_table.select_config("attn_fwd", cpu, 64, torch.float16).source == "interpreter"
    forced = config.LaunchConfig(32, 32, 2, 1)
    with config.overrides(attn_fwd=forced):
        assert launch_table.select_config("attn_fwd", cpu, 64, torch.float16) == config.Chosen(forced, "override")
        assert launch_table.select_config("attn_bwd_dq", cpu, 64, torch.float16).source == "interpreter"
    monkeypatch.setenv("FLASH_DMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tuning_cache.forget_memory()
    launch_table._select_cuda_config.cache_clear()
    infos = {"hopper": DeviceInfo("hopper", 90, 132, 227 * 1024, 0),
             "small": DeviceInfo("small-gpu", 80, 108, 100 * 1024, 0)}
    which = ["hopper"]
    monkeypatch.setattr(launch_table, "device_info", lambda device: infos[which[0]])
    cuda = torch.device("cuda")
    try:
        got = launch_table.select_config("attn_fwd", cuda, 128, torch.bfloat16, "bias")
        assert got == config.Chosen(launch_table.HOPPER_TABLE[("attn_fwd", 128)], "table")
        which[0] = "small"
        launch_table._select_cuda_config.cache_clear()
        assert launch_table.select_config("attn_fwd", cuda, 256, torch.bfloat16, "bias").source == "rule"
        which[0] = "hopper"
        key = config.cache_key("attn_fwd", infos["hopper"], 128, torch.bfloat16, "bias")
        tuning_cache.store(key, {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2})
        got = launch_table.select_config("attn_fwd", cuda, 128, torch.bfloat16, "bias")
        assert got == config.Chosen(config.LaunchConfig(64, 32, 4, 2), "tuning cache")
    finally:
        tuning_cache.forget_memory()
        launch_table._select_cuda_config.cache_clear()


def test_describe_names_every_pass_without_allocating():
    from flash_dma.ops.dynamic_mask_attention.plan import describe
    lines = describe("B=2 S=4096 H=16 Hk=4 D=64 mask=B,Hk,1,S bias=1,H,1,S causal",
                     torch.device("cpu"))
    assert lines[0].startswith("backend triton")
    assert any(line.startswith("attn_fwd:") and "walk gathered" in line for line in lines)
    assert any(line.startswith("attn_bwd_dkdv:") and "variant 'bias-dq'" in line for line in lines)
    assert "dq: fused (table)" in lines and "dbias: atomic" in lines
    with config.overrides(attention_dq_strategy="kernel"):
        assert any(line.startswith("attn_bwd_dq:") for line in describe("B=1 S=64 D=32", torch.device("cpu")))
    with pytest.raises(ValueError, match="bias"):
        describe("B=1 S=64 bias=B,H,S", torch.device("cpu"))
