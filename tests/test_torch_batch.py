"""TransformersBackend.forward_batch: many sequences' rows in one transformers forward (left-padded rows, one
BatchedView over their caches) give each sequence the logits and cache contents it gets alone, roll every cache
back on an error, and drive BatchEngine to plain greedy decoding's tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from specdec.backends.base import BatchRows, forward_batch
from specdec.backends.kvcache import ContextOverflowError
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.backends.pytorch.batched_cache import BatchedView
from specdec.config import SamplingParams
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import plain_engine
from test_engine import perturbed_copy
from test_scheduler import PROMPTS, letters_decoder, run_all, spec_pieces

ATOL = 1e-5

# (history, new rows, num_logits) per sequence: cache lengths 0..9, row counts 1, 3 and 7, num_logits 0 to all.
CASES = {
    "three": [([], [20, 21, 22], 0), ([5, 6, 7, 8, 9], [30], 1), ([11, 12], [40, 41, 42, 43, 44, 45, 46], 3)],
    "four": [([9, 8, 7, 6, 5, 4, 3, 2, 1], [50], 1), ([], [60, 61, 62, 63, 64, 65, 66], 7),
             ([13, 14, 15, 16], [70, 71, 72], 0), ([17], [80], 1)],
    "two_first_prefills": [([], [7, 8, 9, 10, 11, 12, 13], 2), ([], [14, 15, 16], 3)],
}


@pytest.fixture(scope="module", params=["qwen2-sdpa", "qwen2-eager", "llama-sdpa", "llama-eager"])
def backend(request):
    family, attention = request.param.split("-")
    model = tiny_qwen2(seed=0, layers=3) if family == "qwen2" else tiny_llama(seed=2)
    model.set_attn_implementation(attention)
    return TransformersBackend(model, name=request.param, max_context=64)


def cache_with(backend, history, capacity=64):
    cache = backend.new_cache(capacity)
    if history:
        backend.forward(history, cache, 1)
    return cache


def solo(backend, history, tokens, num_logits):
    """The reference: tokens run alone on a fresh cache holding history; its logits for the last num_logits rows."""
    cache = cache_with(backend, history)
    logits = backend.forward(tokens, cache, max(1, num_logits))
    return logits[len(logits) - num_logits:] if num_logits else logits[:0], cache


def run_case(backend, case):
    caches = [cache_with(backend, history) for history, _, _ in case]
    calls = backend.forward_calls
    results = forward_batch(backend, [BatchRows(t, c, k) for (_, t, k), c in zip(case, caches)])
    run_case.forwards = backend.forward_calls - calls
    return results, caches


def matches(batched, reference) -> bool:
    return batched.shape == reference.shape and torch.allclose(batched, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_each_entry_gets_its_solo_logits_and_cache(backend, name):
    case = CASES[name]
    results, caches = run_case(backend, case)
    assert run_case.forwards == 1  # one transformers forward for every entry
    for (history, tokens, num_logits), logits, cache in zip(case, results, caches):
        reference, ref_cache = solo(backend, history, tokens, num_logits)
        assert logits.dtype == torch.float32 and logits.shape == (num_logits, backend.vocab_size)
        assert matches(logits, reference), (logits - reference).abs().max()
        assert cache.length == len(history) + len(tokens)
        assert all(layer.store.length == cache.length for layer in cache.layers)
        # The rows written into the cache are the solo run's: the next step reads them to the same logits.
        after = backend.forward([33, 34], cache, 2)
        assert torch.allclose(after, backend.forward([33, 34], ref_cache, 2), atol=ATOL, rtol=0)


def test_negative_controls_a_wrong_mask_or_position_is_detected(backend, monkeypatch):
    """The comparison can fail: a reference whose history is one token longer, a mask that lets rows see every key
    (padding, the future), and positions off by one for the new rows all give different logits."""
    case = CASES["three"]
    results, _ = run_case(backend, case)
    for (history, tokens, num_logits), logits in zip(case, results):
        if num_logits:
            shifted, _ = solo(backend, [1] + history, tokens, num_logits)
            assert not matches(logits, shifted)

    real_mask, real_positions = BatchedView.attention_mask, BatchedView.positions

    def everything_visible(self, dtype, device):
        mask = real_mask(self, dtype, device)
        return torch.ones_like(mask) if dtype is None else torch.zeros_like(mask)

    def one_later(self, device):  # the new rows one position later than their history (entries with logits have one)
        return real_positions(self, device) + 1

    for name, wrong in (("attention_mask", everything_visible), ("positions", one_later)):
        with monkeypatch.context() as patch:
            patch.setattr(BatchedView, name, wrong)
            broken, _ = run_case(backend, case)
        wrong_entries = [not matches(b, r) for b, r in zip(broken, results) if len(r)]
        assert all(wrong_entries), (name, wrong_entries)


def test_overflow_and_a_failing_forward_leave_every_cache_as_it_was(backend):
    case = CASES["four"]
    caches = [cache_with(backend, history) for history, _, _ in case]
    small = cache_with(backend, list(range(10, 20)), capacity=16)
    batch = [BatchRows(t, c, k) for (_, t, k), c in zip(case, caches)]
    every_length = lambda: [[layer.store.length for layer in c.layers] for c in caches + [small]]  # noqa: E731
    before = every_length()
    with pytest.raises(ContextOverflowError):
        forward_batch(backend, batch + [BatchRows(list(range(7)), small, 1)])  # 10 + 7 > 16, checked first
    assert every_length() == before
    with pytest.raises(ValueError, match="more than once"):
        forward_batch(backend, batch + [BatchRows([1], caches[0], 1)])
    assert every_length() == before

    def broken(module, args):
        raise RuntimeError("layer broke")

    # The last layer fails: every earlier layer has already written its rows into every cache.
    hook = backend.model.model.layers[-1].register_forward_pre_hook(broken)
    try:
        with pytest.raises(RuntimeError, match="layer broke"):
            forward_batch(backend, batch)
    finally:
        hook.remove()
    assert every_length() == before
    # ... and the caches are still right: the same batch now gives each entry its solo logits.
    for (history, tokens, num_logits), logits in zip(case, forward_batch(backend, batch)):
        assert matches(logits, solo(backend, history, tokens, num_logits)[0])


def test_batch_engine_greedy_equals_plain_decoding_with_batched_passes(target_backend, monkeypatch):
    """BatchEngine, three sequences at once on the tiny torch target with a draft model (a perturbed copy: it is
    right often, not always): each request's tokens and finish reason are plain greedy decoding's, and the target
    ran passes of several entries in one forward."""
    draft_backend = TransformersBackend(perturbed_copy(target_backend.model, 0.05, seed=1), name="draft",
                                        max_context=target_backend.max_context)
    passes = []
    native = target_backend.forward_batch

    def spy(batch):
        calls = target_backend.forward_calls
        results = native(batch)
        passes.append((len(batch), target_backend.forward_calls - calls))
        return results

    monkeypatch.setattr(target_backend, "forward_batch", spy)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 9, 25, 14)]
    requests = list(zip(PROMPTS, params))
    drafter, spec = spec_pieces(target_backend, draft_backend)
    batch = BatchEngine(target_backend, drafter, spec, letters_decoder(), max_running=3)
    results, most = run_all(batch, requests, join_at=[0, 0, 2, 5])
    assert most == 3
    monkeypatch.undo()
    for (prompt, p), (tokens, _, finish) in zip(requests, results):
        plain = plain_engine(target_backend, letters_decoder()).generate(prompt, p)
        assert (tokens, finish) == (plain.tokens, plain.finish_reason)
    assert any(entries > 1 and forwards == 1 for entries, forwards in passes), passes  # the batched path ran
    assert batch.total_stats.num_draft_tokens > batch.total_stats.num_accepted_tokens > 0
