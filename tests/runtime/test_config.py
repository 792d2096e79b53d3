"""Launch configuration, generic pieces: the persistent tuning cache, overrides of declared choices."""
import json

import torch

from flash_dma.runtime import config, tuning_cache
from flash_dma.runtime.hardware import DeviceInfo


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


def test_overrides_refuse_unknown_choices_and_values():
    import pytest

    import flash_dma  # noqa: F401 - the ops declare their choices on import
    with pytest.raises(ValueError, match="unknown choice"):
        with config.overrides(attention_dq_stratgy="kernel"):
            pass
    with pytest.raises(ValueError, match="must be one of"):
        with config.overrides(attention_dq_strategy="sideways"):
            pass
    assert config.choice("attention_dq_strategy") == config.Chosen("fused", "table")
    with config.overrides(attention_dq_strategy="kernel"):
        assert config.choice("attention_dq_strategy") == config.Chosen("kernel", "override")
        with config.overrides(attention_all_tiles_list_walk=False):
            assert config.choice("attention_dq_strategy").value == "kernel"  # nested: kept
            assert config.choice("attention_all_tiles_list_walk") == config.Chosen(False, "override")
    assert config.choice("attention_dq_strategy").source == "table"


def test_overrides_reach_other_threads():
    """Autograd runs a CUDA backward on its own worker thread: an override set by the caller
    must be seen there too, or backward plans silently ignore it."""
    import threading
    from flash_dma.runtime import config
    seen = []
    with config.overrides(attention_dq_strategy="kernel"):
        worker = threading.Thread(target=lambda: seen.append(config.overridden("attention_dq_strategy")))
        worker.start()
        worker.join()
    assert seen == ["kernel"]
    assert config.overridden("attention_dq_strategy") is None


def test_parse_overrides_reads_flags_counts_and_names():
    """The bench scripts' --choices text: flags and counts become the values the declared
    choices allow (a count left as text would be refused by `overrides`)."""
    import flash_dma  # noqa: F401 - the ops declare their choices on import
    assert config.parse_overrides("a=True, b=False,c=64,d=ws") == {"a": True, "b": False, "c": 64, "d": "ws"}
    with config.overrides(**config.parse_overrides("gdn_fused_forward=64")):
        assert config.choice("gdn_fused_forward") == config.Chosen(64, "override")


def test_tuning_cache_entries_leave_out_fields_at_their_defaults():
    """What the tuning cache stores: a field at its default (one added later, as GdnConfig's
    register cap) stays out of the entry, which older versions then still read; the entry gives
    the configuration back."""
    from flash_dma.ops.gated_delta_rule.launch_table import GdnConfig
    from flash_dma.runtime.config import LaunchConfig, stored_fields
    uncapped, capped = GdnConfig(32, 16, 4, 1), GdnConfig(32, 16, 4, 1, max_registers=168)
    assert stored_fields(uncapped) == {"block_k": 32, "block_v": 16, "num_stages": 1}  # 4 warps: the default
    assert stored_fields(capped)["max_registers"] == 168
    assert GdnConfig(**stored_fields(capped)) == capped and GdnConfig(**stored_fields(uncapped)) == uncapped
    attention = LaunchConfig(64, 64, 4, 2, warp_specialize=True)
    assert "exp2_poly" not in stored_fields(attention)
    assert LaunchConfig(**stored_fields(attention)) == attention
