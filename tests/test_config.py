"""Launch configuration: defaults that fit the device, and the persistent tuning cache."""
import json

import torch

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
                    cfg = config.default_config(kernel, info, d, 2, variant)
                    bias_bytes = config.variant_bias_bytes(kernel, variant, 2)
                    assert config.estimate_shared_memory(kernel, cfg, d, 2, bias_bytes) \
                        <= info.shared_memory_per_block, (kernel, d, info.name, variant, cfg)


def test_forward_stages_fit_the_bias_it_stages():
    """The shared-memory estimate counts the bias tile the forward stages, at its element size:
    the no-mask, no-bias forward at D128 keeps 3 stages of 128-key tiles on Hopper (a bias tile
    would not fit them), and a 16-bit bias at D256 two stages (an fp32 one only one)."""
    hopper = DeviceInfo("hopper", 90, 132, 227 * 1024, 0)
    cfg = config.default_config("attn_fwd", hopper, 128, 2, "plain-dense")
    assert (cfg.block_n, cfg.num_stages) == (128, 3)
    assert config.estimate_shared_memory("attn_fwd", cfg, 128, 2, bias_bytes=2) > hopper.shared_memory_per_block
    # a 16-bit bias tile leaves room for the second stage at D256 that an fp32 one does not
    assert config.default_config("attn_fwd", hopper, 256, 2, "bias").num_stages == 2
    assert config.default_config("attn_fwd", hopper, 256, 2, "bias-fp32").num_stages == 1


def test_variant_defaults_fall_back_to_their_longest_listed_prefix():
    hopper = DeviceInfo("hopper", 90, 132, 227 * 1024, 0)
    listed = config._HOPPER_DEFAULTS
    for variant, expected in (("plain-dq-list", ("attn_bwd_dkdv", 128, "plain-dq-list")),
                              ("bias-dq-list", ("attn_bwd_dkdv", 128, "bias-dq")),
                              ("bias-list", ("attn_bwd_dkdv", 128)),
                              ("plain-dq-list-full", ("attn_bwd_dkdv", 128, "plain-dq-list-full")),
                              ("bias-list-full", ("attn_bwd_dkdv", 128)),
                              ("", ("attn_bwd_dkdv", 128))):
        assert config.default_config("attn_bwd_dkdv", hopper, 128, 2, variant) == listed[expected]
    assert listed[("attn_bwd_dkdv", 128, "plain-dq-list")] != listed[("attn_bwd_dkdv", 128, "plain-dq")]


def test_tuning_cache_roundtrip_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_DMA_CACHE_DIR", str(tmp_path))
    tuning_cache.forget_memory()
    info = DeviceInfo("fake", 90, 132, 227 * 1024, 0)
    monkeypatch.setattr(config, "device_info", lambda device: info)
    timings = {64: 2.0, 128: 1.0}
    candidates = [config.LaunchConfig(64, 64, 4, 2), config.LaunchConfig(128, 64, 8, 2),
                  config.LaunchConfig(256, 256, 8, 3)]

    def time_config(cfg):
        if cfg.block_m == 256:
            raise RuntimeError("out of resources")
        return timings[cfg.block_m]

    best = config.tune("attn_fwd", torch.device("cuda"), 128, torch.bfloat16, "plain", time_config,
                       candidates)
    assert best == candidates[1]
    tuning_cache.forget_memory()  # a later process reads the file
    key = config.cache_key("attn_fwd", info, 128, torch.bfloat16, "plain")
    assert config.LaunchConfig(**tuning_cache.lookup(key)) == candidates[1]
    log = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert len(log) == 3 and log[2]["error"] == "RuntimeError"
    tuning_cache.forget_memory()
