"""Pointer caches: trim moves a position pointer (no reallocation), later writes overwrite, overflow is refused cleanly."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.kvcache import ContextOverflowError, KVCache, PreallocatedKV
from specdec.backends.pytorch.backend import PointerCache, TransformersBackend


def kv(n: int, fill: float, heads: int = 2, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, heads, n, dim)
    return torch.full(shape, fill), torch.full(shape, -fill)


# ---------------------------------------------------------------------------------------------
# PreallocatedKV


def test_append_returns_views_of_the_written_prefix():
    store = PreallocatedKV(capacity=8)
    keys, values = store.append(*kv(3, 1.0))
    assert store.length == 3 and keys.shape == (1, 2, 3, 4)
    keys, values = store.append(*kv(2, 2.0))
    assert store.length == 5 and keys.shape == (1, 2, 5, 4)
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2]
    assert values[0, 0, :, 0].tolist() == [-1, -1, -1, -2, -2]


def test_trim_moves_the_pointer_without_reallocating_and_writes_overwrite():
    store = PreallocatedKV(capacity=8)
    store.append(*kv(5, 1.0))
    keys_ptr, values_ptr = store.keys.data_ptr(), store.values.data_ptr()
    assert store.trim(2) == 2 and store.length == 3
    keys, _ = store.append(*kv(3, 7.0))
    assert store.keys.data_ptr() == keys_ptr and store.values.data_ptr() == values_ptr
    assert keys.data_ptr() == keys_ptr  # the returned view is the buffer itself
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 7, 7, 7]


def test_trim_is_clamped():
    store = PreallocatedKV(capacity=4)
    store.append(*kv(2, 1.0))
    assert store.trim(0) == 0 and store.length == 2
    assert store.trim(-3) == 0 and store.length == 2
    assert store.trim(10) == 2 and store.length == 0


def test_overflow_is_refused_and_leaves_the_store_unchanged():
    store = PreallocatedKV(capacity=4)
    store.append(*kv(3, 1.0))
    with pytest.raises(ContextOverflowError, match="4 tokens"):
        store.append(*kv(2, 9.0))
    assert store.length == 3
    assert store.keys[0, 0, :3, 0].tolist() == [1, 1, 1]
    store.append(*kv(1, 2.0))  # exactly full is fine
    assert store.length == 4


# ---------------------------------------------------------------------------------------------
# PointerCache through the transformers backend


@pytest.fixture()
def backend(target_model):
    return TransformersBackend(target_model, name="tiny", max_context=32)


def test_pointer_cache_satisfies_the_protocol(backend):
    cache = backend.new_cache(16)
    assert isinstance(cache, KVCache)
    assert cache.length == 0 and cache.capacity == 16


def test_forward_appends_and_returns_the_asked_for_logits(backend):
    cache = backend.new_cache()
    logits = backend.forward([5, 6, 7, 8], cache, num_logits=3)
    assert logits.shape == (3, backend.vocab_size) and logits.dtype == torch.float32
    assert cache.length == 4
    assert backend.forward([9], cache).shape == (1, backend.vocab_size)
    assert cache.length == 5


def test_trim_keeps_buffers_and_forward_after_trim_overwrites(backend, target_model):
    prompt = [5, 6, 7, 8, 9, 10]
    cache = backend.new_cache()
    backend.forward(prompt, cache, num_logits=1)
    pointers = [(layer.store.keys.data_ptr(), layer.store.values.data_ptr()) for layer in cache.layers]
    assert cache.trim(3) == 3 and cache.length == 3
    assert all(layer.store.length == 3 for layer in cache.layers)
    logits = backend.forward([40, 41, 42], cache, num_logits=3)
    assert [(layer.store.keys.data_ptr(), layer.store.values.data_ptr()) for layer in cache.layers] == pointers

    fresh = backend.new_cache()
    expected = backend.forward(prompt[:3] + [40, 41, 42], fresh, num_logits=3)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for trimmed_layer, fresh_layer in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(trimmed_layer.store.keys[:, :, :6], fresh_layer.store.keys[:, :, :6], atol=1e-5, rtol=1e-5)
    # and both agree with transformers' own uncached forward
    with torch.no_grad():
        reference = target_model(torch.tensor([prompt[:3] + [40, 41, 42]])).logits[0, -3:]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_incremental_forwards_equal_one_batched_forward(backend):
    tokens = [3, 14, 15, 92, 65, 35]
    one = backend.new_cache()
    batched = backend.forward(tokens, one, num_logits=len(tokens))
    step = backend.new_cache()
    rows = [backend.forward([t], step)[0] for t in tokens]
    torch.testing.assert_close(torch.stack(rows), batched, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.stack(rows).argmax(-1), batched.argmax(-1))


def test_context_overflow_is_refused_and_the_cache_is_unchanged(backend):
    cache = backend.new_cache(8)
    backend.forward([1, 2, 3, 4, 5], cache)
    with pytest.raises(ContextOverflowError, match="8 tokens"):
        backend.forward([6, 7, 8, 9], cache)
    assert cache.length == 5
    backend.forward([6, 7, 8], cache)  # exactly full still works
    assert cache.length == 8
    with pytest.raises(ContextOverflowError):
        backend.forward([1], cache)
    with pytest.raises(ValueError):
        backend.forward([], cache)


def test_failed_forward_leaves_every_layer_where_it_was(backend, target_model, monkeypatch):
    cache = backend.new_cache()
    backend.forward([5, 6, 7], cache)
    last_layer = target_model.model.layers[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure after the first layers wrote their keys")

    monkeypatch.setattr(last_layer, "forward", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        backend.forward([8, 9], cache, num_logits=2)
    # earlier layers had appended; the backend must roll all of them back
    assert cache.length == 3
    assert [layer.store.length for layer in cache.layers] == [3] * len(cache.layers)
    monkeypatch.undo()
    logits = backend.forward([8, 9], cache, num_logits=2)
    fresh = backend.new_cache()
    torch.testing.assert_close(logits, backend.forward([5, 6, 7, 8, 9], fresh, num_logits=2), atol=1e-5, rtol=1e-5)


def test_transformers_crop_api_moves_the_pointer(backend):
    cache = backend.new_cache()
    backend.forward([1, 2, 3, 4, 5], cache)
    cache.crop(-2)  # negative: tokens to remove
    assert cache.length == 3 and cache.get_seq_length() == 3
    cache.crop(1)  # non-negative: length to keep
    assert cache.length == 1


def test_pointer_cache_direct_trim_counts():
    cache = PointerCache(num_layers=3, capacity=10)
    for layer in cache.layers:
        layer.update(*kv(4, 1.0))
    assert cache.length == 4
    assert cache.trim(1) == 1 and cache.length == 3
    assert cache.trim(99) == 3 and cache.length == 0
