"""Hybrid drafter: lookup when it matches, draft model otherwise; lossless either way and the draft model's cache stays consistent."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import greedy_reference
from markov_backend import (  # noqa: F401
    MarkovBackend,
    chi_square_pvalue,
    one_torch_thread,
    random_table,
    sequence_distribution,
)
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.engine.single import SpeculativeEngine, plain_engine

REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _engine(target, draft, k=5, **spec_kw):
    spec = SpecConfig(num_speculative_tokens=k, drafter="hybrid", **spec_kw)
    return SpeculativeEngine(target, create_drafter("hybrid", draft_backend=draft, spec=spec), spec)


def test_registered_and_needs_a_draft_model(draft_backend):
    with pytest.raises(ValueError, match="draft model"):
        create_drafter("hybrid", draft_backend=None)
    drafter = create_drafter("hybrid", draft_backend=draft_backend, spec=SpecConfig(drafter="hybrid"))
    assert isinstance(drafter, HybridDrafter)
    assert drafter.min_match == 2
    assert create_drafter("hybrid", draft_backend=draft_backend, min_match=3).min_match == 3
    # min_match is kept inside the configured n-gram sizes.
    assert create_drafter("hybrid", draft_backend=draft_backend, spec=SpecConfig(drafter="hybrid", lookup_max_ngram=5),
                          min_match=9).min_match == 5


def test_min_match_decides_between_lookup_and_model():
    draft = MarkovBackend(random_table(12, seed=3))
    context = [1, 2, 9, 10, 11, 5, 1, 2]  # "1 2" matches (n = 2), "5 1 2" does not (n = 3)
    params = SamplingParams()
    for min_match, source in ((2, "lookup"), (3, "model")):
        drafter = create_drafter("hybrid", draft_backend=draft, min_match=min_match)
        drafter.begin(context, params, torch.Generator())
        result = drafter.propose(context, 3)
        if source == "lookup":
            assert result.tokens == [9, 10, 11]
            assert (drafter.num_lookup_drafts, drafter.num_model_drafts) == (1, 0)
        else:
            expected, prev = [], context[-1]
            for _ in range(3):
                prev = int(draft.table[prev].argmax())
                expected.append(prev)
            assert result.tokens == expected
            assert (drafter.num_lookup_drafts, drafter.num_model_drafts) == (0, 1)
        assert result.probs is None  # greedy: the model's q is not needed either
        drafter.accepted(1, 3)
        drafter.end()


@pytest.fixture(scope="module")
def hf_greedy(target_model):
    return greedy_reference(target_model)


@pytest.mark.parametrize("k_policy", ["fixed", "adaptive"])
def test_greedy_output_equals_transformers_generate_and_uses_both_sources(target_backend, draft_backend, hf_greedy, k_policy):
    engine = _engine(target_backend, draft_backend, k_policy=k_policy)
    result = engine.generate(REPETITIVE, SamplingParams(max_tokens=30, ignore_eos=True))
    assert result.tokens == hf_greedy(REPETITIVE, 30)
    drafter = engine.drafter
    assert drafter.num_lookup_drafts > 0 and drafter.num_model_drafts > 0
    if k_policy == "fixed":  # adaptive k follows measured timings: it may rightly stop drafting here
        assert result.stats.num_accepted_tokens > 0


def test_draft_model_cache_stays_consistent_across_lookup_steps(target_backend, draft_backend, draft_model):
    """Every model draft equals the draft model's greedy continuation of the full context, recomputed without a cache."""
    engine = _engine(target_backend, draft_backend, k=4)
    model_drafter = engine.drafter.model
    records = []
    original = model_drafter.propose

    def recording_propose(context, k):
        cache_length = model_drafter.cache.length
        assert cache_length <= len(context)  # the draft cache holds a prefix of the context
        draft = original(context, k)
        records.append((list(context), cache_length, draft.tokens))
        return draft

    model_drafter.propose = recording_propose
    prompt = [20, 21, 22, 23, 20, 21, 22, 23, 20, 21]
    result = engine.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert result.tokens == plain_engine(target_backend).generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True)).tokens
    assert engine.drafter.num_lookup_drafts > 0 and len(records) >= 2
    # Some model draft followed lookup steps, so it had to catch up on more than one token.
    assert any(len(context) - cache_length > 2 for context, cache_length, _ in records[1:])
    with torch.no_grad():
        for context, _, tokens in records:
            sequence = list(context)
            for token in tokens:
                logits = draft_model(torch.tensor([sequence])).logits[0, -1]
                assert token == int(logits.argmax()), "draft cache out of step with the context"
                sequence.append(token)


def test_abandoned_stream_leaves_the_drafter_reusable(target_backend, draft_backend):
    engine = _engine(target_backend, draft_backend, k=4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    stream = engine.stream(REPETITIVE, params)
    next(stream)
    next(stream)
    stream.close()
    model = engine.drafter.model  # the draft model keeps what its cache holds, and knows what that is
    assert model.cache.length == len(model.retained.tokens) > 0
    assert engine.generate(REPETITIVE, params).tokens == plain_engine(target_backend).generate(REPETITIVE, params).tokens


def test_sampled_is_reproducible_with_a_seed(target_backend, draft_backend):
    engine = _engine(target_backend, draft_backend)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=7, ignore_eos=True)
    assert engine.generate(REPETITIVE, params).tokens == engine.generate(REPETITIVE, params).tokens


def test_sampled_output_is_distributed_as_the_target():
    # The first draft comes from the model ("4 3" never occurred before), which proposes 3 -> 4 while the
    # target prefers 3 -> 0; after a rejection recovers 0, "3 0" matches the prompt and lookup drafts.
    target = MarkovBackend(random_table(5, seed=11, boost={0: 1, 1: 2, 2: 0, 3: 0}))
    draft = MarkovBackend(random_table(5, seed=12, boost={0: 1, 1: 2, 2: 0, 3: 4}))
    prompt = [3, 0, 1, 2, 0, 1, 2, 4, 3]
    engine = _engine(target, draft, k=3)
    counts: Counter = Counter()
    draws = 2000
    for seed in range(draws):
        result = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True))
        counts[tuple(result.tokens)] += 1
    expected = sequence_distribution(target.probs(), start=prompt[-1], length=3)
    assert chi_square_pvalue(counts, expected, draws) > 1e-3
    assert engine.drafter.num_lookup_drafts > 100 and engine.drafter.num_model_drafts > 100, (
        engine.drafter.num_lookup_drafts, engine.drafter.num_model_drafts)
