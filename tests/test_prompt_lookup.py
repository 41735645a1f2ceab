"""Prompt-lookup drafter: correct incremental n-gram matching, lossless greedy and sampled decoding, no draft model needed."""

from __future__ import annotations

import random
import time

import pytest

from conftest import greedy_reference
from markov_backend import (  # noqa: F401
    MarkovBackend,
    chi_square_pvalue,
    one_torch_thread,
    random_table,
    sampled_counts,
    sequence_distribution,
)
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import available_drafters, create_drafter
from specdec.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter
from specdec.engine.single import SpeculativeEngine, plain_engine

REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def brute_force_match(tokens, k, min_n, max_n):
    """Reference: scan backwards for the most recent earlier occurrence of the longest suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                out = []
                for j in range(k):
                    pos = end + j
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return out, n
    return [], 0


def test_registered_and_needs_no_model():
    assert {"prompt_lookup", "hybrid", "draft_model"} <= set(available_drafters())
    drafter = create_drafter("prompt_lookup", draft_backend=None, spec=SpecConfig(drafter="prompt_lookup"))
    assert isinstance(drafter, PromptLookupDrafter)
    assert drafter.name == "prompt_lookup"
    assert (drafter.index.min_n, drafter.index.max_n) == (1, 3)
    custom = create_drafter("prompt_lookup", spec=SpecConfig(drafter="prompt_lookup", lookup_min_ngram=2, lookup_max_ngram=5))
    assert (custom.index.min_n, custom.index.max_n) == (2, 5)


def test_proposes_what_followed_the_most_recent_occurrence():
    drafter = PromptLookupDrafter()
    drafter.begin([1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 62, 9, 2, 3])
    draft = drafter.propose([1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 62, 9, 2, 3], 3)
    assert draft.tokens == [60, 61, 62]  # "9 2 3" last seen before 60 61 62 (the longest match wins)
    assert draft.probs is None  # deterministic: q is one-hot
    assert drafter.last_match_length == 3
    assert draft.seconds >= 0


def test_prefers_the_longest_ngram_over_a_more_recent_shorter_one():
    tokens = [7, 8, 9, 40, 41, 0, 9, 70, 71, 7, 8, 9]
    index = NgramIndex(1, 3)
    index.reset(tokens)
    assert index.match(2) == ([40, 41], 3)  # "7 8 9" beats the later "9" -> 70
    index.reset([9, 70, 71, 8, 9])
    assert index.match(2) == ([70, 71], 1)
    assert index.match(2, min_n=2) == ([], 0)  # the caller can demand a longer match


def test_no_match_gives_an_empty_draft_and_short_continuations_are_extended():
    drafter = PromptLookupDrafter()
    drafter.begin([1, 2, 3, 4])
    assert drafter.propose([1, 2, 3, 4], 4).tokens == []
    # A run of one token: the match ends right before the last token; the copy runs through itself.
    assert drafter.propose([1, 2, 3, 4, 4], 5).tokens == [4, 4, 4, 4, 4]
    assert drafter.propose([1, 2, 3, 4, 4, 1, 2], 5).tokens == [3, 4, 4, 1, 2]


def test_incremental_index_matches_a_brute_force_scan():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([3, 5, 12])
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4)])
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        index.reset(tokens)
        for _ in range(60):
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
            index.sync(tokens)
            k = rng.randrange(1, 7)
            assert index.match(k) == brute_force_match(tokens, k, min_n, max_n), (trial, tokens)


def test_sync_rebuilds_when_the_context_is_not_an_extension():
    index = NgramIndex(1, 2)
    index.sync([1, 2, 3, 1, 2])
    assert index.match(2) == ([3, 1], 2)
    index.sync([9, 9, 8, 9])  # a different request
    assert index.tokens == [9, 9, 8, 9]
    assert index.match(2) == ([8, 9], 1)


def test_lookup_cost_does_not_grow_with_the_context():
    drafter = PromptLookupDrafter(SpecConfig(drafter="prompt_lookup", lookup_max_ngram=4))
    rng = random.Random(1)
    context = [rng.randrange(1000) for _ in range(50_000)]
    drafter.begin(context)
    began = time.perf_counter()
    for _ in range(2_000):
        context.append(rng.randrange(1000))
        drafter.propose(context, 5)
    elapsed = time.perf_counter() - began
    # A rescan would touch ~50k positions x 4 sizes per step (minutes in Python); the index does O(1) work.
    assert elapsed < 5.0
    assert len(drafter.index.tokens) == len(context)


def _engine(target, name="prompt_lookup", k=5, **spec_kw):
    spec = SpecConfig(num_speculative_tokens=k, drafter=name, **spec_kw)
    return SpeculativeEngine(target, create_drafter(name, draft_backend=None, spec=spec), spec)


@pytest.fixture(scope="module")
def hf_greedy(target_model):
    return greedy_reference(target_model)


@pytest.mark.parametrize("k_policy", ["fixed", "adaptive"])
def test_greedy_output_equals_transformers_generate(target_backend, hf_greedy, k_policy):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    result = _engine(target_backend, k_policy=k_policy).generate(REPETITIVE, params)
    assert result.tokens == hf_greedy(REPETITIVE, 30)
    stats = result.stats
    # The tiny target falls into a loop, which lookup copies: drafts are made and accepted.
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens > 0
    assert stats.num_target_forwards < 30
    assert result.from_draft.count(True) == stats.num_accepted_tokens


def test_greedy_equals_plain_for_other_prompts_and_ngram_sizes(target_backend):
    params = SamplingParams(max_tokens=20)
    for prompt, (min_n, max_n) in (([40, 41, 42], (1, 1)), (list(range(10, 40)) + list(range(10, 20)), (2, 4))):
        expected = plain_engine(target_backend).generate(prompt, params)
        engine = _engine(target_backend, k=4, lookup_min_ngram=min_n, lookup_max_ngram=max_n)
        result = engine.generate(prompt, params)
        assert result.tokens == expected.tokens, prompt
        assert result.finish_reason == expected.finish_reason


def test_sampled_is_reproducible_with_a_seed(target_backend):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=123, ignore_eos=True)
    engine = _engine(target_backend)
    first = engine.generate(REPETITIVE, params)
    second = engine.generate(REPETITIVE, params)
    assert first.tokens == second.tokens
    assert len(first.tokens) == 20


def test_sampled_output_is_distributed_as_the_target():
    # Markov target that tends to continue the 0 1 2 pattern, so lookup drafts are often (not always) right.
    table = random_table(5, seed=7, boost={0: 1, 1: 2, 2: 0})
    target = MarkovBackend(table)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = {"temperature": 1.0, "max_tokens": 3, "ignore_eos": True}
    engine = _engine(target, k=3)
    draws = 3000
    counts, accepted, drafts = sampled_counts(engine, prompt, params, draws)
    expected = sequence_distribution(target.probs(), start=prompt[-1], length=3)
    assert chi_square_pvalue(counts, expected, draws) > 1e-3
    assert 0 < accepted < drafts  # both acceptances and rejections were exercised


def test_pipeline_and_cli_run_prompt_lookup_without_a_draft_model(target_backend):
    from specdec.cli.flags import model_ref_from_args, spec_from_args
    from specdec.cli.main import build_parser
    from specdec.decoder import SpecDecoder

    args = build_parser().parse_args(["generate", "--drafter", "prompt_lookup", "--k-policy", "adaptive", "-k", "6"])
    ref = model_ref_from_args(args)
    assert ref.draft is None  # the default draft model is not even loaded
    spec = spec_from_args(args, has_draft_model=False)
    assert (spec.drafter, spec.k_policy, spec.num_speculative_tokens) == ("prompt_lookup", "adaptive", 6)

    decoder = SpecDecoder(target_backend, None, spec)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    result = decoder.generate(REPETITIVE, params)
    assert result.tokens == decoder.plain_engine().generate(REPETITIVE, params).tokens
    assert isinstance(decoder.engine().drafter, PromptLookupDrafter)
