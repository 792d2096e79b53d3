"""The per-tensor cache behind the mask plans and the varlen chunk layouts."""
import gc

import torch

from flash_dma.runtime.tensor_cache import TensorKeyedCache


def test_built_once_per_tensor_and_key():
    cache, calls = TensorKeyedCache(), []

    def build(tag):
        calls.append(tag)
        return tag

    t = torch.arange(4)
    assert cache.get(t, ("a",), lambda: build(1)) == 1
    assert cache.get(t, ("a",), lambda: build(2)) == 1  # remembered
    assert cache.get(t, ("b",), lambda: build(3)) == 3  # another key of the same tensor
    assert cache.get(t.clone(), ("a",), lambda: build(4)) == 4  # equal contents, another object
    assert calls == [1, 3, 4]


def test_in_place_change_rebuilds():
    cache = TensorKeyedCache()
    t = torch.arange(4)
    assert cache.get(t, (), lambda: int(t.sum())) == 6
    t[0] = 10
    assert cache.get(t, (), lambda: int(t.sum())) == 16


def test_freed_tensor_drops_its_entry():
    cache = TensorKeyedCache()
    t = torch.arange(4)
    cache.get(t, (), lambda: 0)
    assert len(cache.entries) == 1
    del t
    gc.collect()
    assert not cache.entries


def test_capacity_is_bounded():
    cache = TensorKeyedCache(capacity=3)
    kept = [torch.arange(i + 1) for i in range(5)]
    for i, t in enumerate(kept):
        assert cache.get(t, (), lambda i=i: i) == i
    assert len(cache.entries) <= 3
    assert cache.get(kept[-1], (), lambda: -1) == 4


def test_inference_tensors_are_rebuilt_each_time():
    cache, calls = TensorKeyedCache(), []
    with torch.inference_mode():
        t = torch.arange(4)
    for _ in range(2):
        cache.get(t, (), lambda: calls.append(1))
    assert len(calls) == 2
