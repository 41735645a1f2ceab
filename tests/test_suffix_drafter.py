"""Suffix drafter: trie counts against brute force, the speculation rules, lossless greedy and sampled decoding, the bounded cross-request cache."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from markov_backend import (
    MarkovBackend,
    chi_square_pvalue,
    random_table,
    sampled_counts,
    sequence_distribution,
)
from specdec.config import ConfigError, SamplingParams, SpecConfig
from specdec.drafters import available_drafters, create_drafter
from specdec.drafters.suffix import SuffixCache, SuffixDrafter, SuffixTrie
from specdec.engine.single import SpeculativeEngine, plain_engine


def trie_counts(trie: SuffixTrie) -> Counter:
    """Every path of the trie with its count (the trie's view)."""
    counts: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        children = node.children
        items = [] if children is None else ([children] if isinstance(children, tuple) else list(children.items()))
        for token, child in items:
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def brute_counts(sequences, depth: int) -> Counter:
    """Reference: occurrences of every substring of length <= depth, by enumeration."""
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def test_registered_with_its_config_defaults():
    assert "suffix" in available_drafters()
    drafter = create_drafter("suffix", spec=SpecConfig(drafter="suffix"))
    assert isinstance(drafter, SuffixDrafter) and drafter.cache is not None and drafter.depth == 24
    assert create_drafter("suffix", spec=SpecConfig(drafter="suffix", suffix_cache=False)).cache is None
    with pytest.raises(ConfigError):
        SpecConfig(drafter="suffix", suffix_depth=1)


def test_incremental_counts_and_removal_equal_brute_force():
    rng = random.Random(3)
    first = [rng.randrange(4) for _ in range(120)]
    second = [rng.randrange(4) for _ in range(90)]
    trie = SuffixTrie(depth=6)
    for lo in range(0, len(first), 17):  # appended in pieces, as a request's output arrives
        trie.add("a", first[lo : lo + 17])
    trie.add("b", second)
    assert trie_counts(trie) == brute_counts([first, second], 6)
    assert trie.root.count == len(first) + len(second)
    trie.remove("a")
    assert trie_counts(trie) == brute_counts([second], 6)  # no path of "a" alone is left behind
    trie.remove("b")
    assert trie.root.count == 0 and trie.root.children is None


def test_a_long_match_drafts_the_copy_and_length_follows_the_match():
    passage = list(range(100, 140))
    trie = SuffixTrie(depth=24)
    trie.add(0, [1, 2, 3] + passage + [4, 5])
    # The context ends with 6 tokens of the passage: the copy continues, at most factor * 6 tokens.
    draft = trie.speculate([9, 9] + passage[:6], max_tokens=16)
    assert draft.tokens == passage[6:12] and draft.match_length == 6 and draft.probs == [1.0] * 6
    assert trie.speculate([9, 9] + passage[:6], max_tokens=16, max_spec_factor=2.0).tokens == passage[6:18]
    assert trie.speculate([9, 9] + passage[:6], max_tokens=3).tokens == passage[6:9]  # k caps it
    assert trie.speculate([7, 8, 9], max_tokens=8).tokens == []  # nothing occurs: no draft


def test_a_copy_drafts_past_the_trie_depth():
    passage = list(range(100, 160))
    spec = SpecConfig(drafter="suffix", suffix_depth=24, suffix_cache=False)
    drafter = SuffixDrafter(spec)
    prompt = [1, 2, 3] + passage + [4, 5]
    context = prompt + [9] + passage[:20]  # the output started copying the passage
    drafter.begin(prompt)
    # One trie walk would stop at depth - m tokens; the drafter continues from its own draft.
    one_walk = drafter.local.speculate(context, 64, context_is_indexed=True)
    assert len(one_walk.tokens) < 24
    draft = drafter.propose(context, 64)
    assert draft.tokens[:42] == passage[20:] + [4, 5]  # the whole rest of the copy
    assert draft.tokens[42:44] == [9, 100]  # then what followed "4, 5" in the context: the copy began again
    assert drafter.propose(context, 30).tokens == passage[20:50]  # k still caps it


def test_a_short_match_does_not_continue_past_its_own_length():
    # "5 6" occurs before a long run: a 2-token match drafts at most 2 tokens (factor 1), chained or not.
    prompt = [5, 6] + list(range(100, 160)) + [1, 2, 3]
    drafter = SuffixDrafter(SpecConfig(drafter="suffix", suffix_depth=24, suffix_cache=False))
    drafter.begin(prompt)
    assert drafter.propose(prompt + [9, 5, 6], 32).tokens == [100, 101]


def test_an_extended_draft_keeps_the_min_token_prob_rule():
    # The copy forks halfway: after passage[:30] comes 7 in one occurrence and 8 in the other.
    passage = list(range(100, 130))
    prompt = passage + [7, 50, 51] + [0] + passage + [8, 60, 61]
    spec = SpecConfig(drafter="suffix", suffix_depth=16, suffix_cache=False)
    drafter = SuffixDrafter(spec)
    drafter.begin(prompt)
    context = prompt + [0] + passage[:10]
    draft = drafter.propose(context, 40)
    assert draft.tokens[:20] == passage[10:]
    # At the fork, probability 0.5 still passes the default 0.1: the draft takes one branch and copies on.
    branch = [7, 50, 51] if draft.tokens[20] == 7 else [8, 60, 61]
    assert draft.tokens[20:23] == branch
    strict = SuffixDrafter(SpecConfig(drafter="suffix", suffix_depth=16, suffix_cache=False, suffix_min_prob=0.6))
    strict.begin(prompt)
    assert strict.propose(context, 40).tokens == passage[10:]  # the fork at 0.5 stops a 0.6 rule


def test_ambiguous_continuations_stop_at_min_token_prob():
    trie = SuffixTrie(depth=8)
    # After (1, 2): 3 four times, then 4 after 3 twice and 5 after 3 twice.
    trie.add(0, [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 3, 5, 0])
    draft = trie.speculate([7, 1, 2], max_tokens=4, max_spec_offset=4)
    assert draft.tokens[0] == 3 and draft.probs[0] == 1.0
    assert draft.probs[1] == pytest.approx(0.5)  # 4 or 5: half each
    assert trie.speculate([7, 1, 2], max_tokens=4, max_spec_offset=4, min_token_prob=0.6).tokens == [3]


def test_the_requests_own_final_occurrence_is_discounted():
    trie = SuffixTrie(depth=8)
    text = [5, 6, 7, 8, 5, 6, 7]
    trie.add(0, text)
    draft = trie.speculate(text, max_tokens=4, context_is_indexed=True)
    assert draft.tokens == [8, 5, 6] and draft.probs == [1.0, 1.0, 1.0]  # not halved by the unfinished copy
    assert trie.speculate([1, 2, 3], max_tokens=4, context_is_indexed=True).tokens == []
    lone = SuffixTrie(depth=8)
    lone.add(0, [1, 2, 3])
    assert lone.speculate([1, 2, 3], max_tokens=4, context_is_indexed=True).tokens == []  # only itself


def test_cross_request_cache_is_bounded_and_evicts_the_oldest():
    cache = SuffixCache(max_tokens=50, depth=6)
    rng = random.Random(0)
    responses = [[rng.randrange(1000) for _ in range(20)] for _ in range(6)]
    for response in responses:
        cache.add_response(response)
        assert cache.num_tokens <= 50
    assert trie_counts(cache.trie) == brute_counts(responses[-2:], 6)  # 40 tokens kept, the rest evicted
    cache.add_response(list(range(80)))  # longer than the bound: its last 50 tokens
    assert cache.num_tokens == 50 and trie_counts(cache.trie) == brute_counts([list(range(30, 80))], 6)


def _engine(target, k=5, **spec_kw):
    spec = SpecConfig(num_speculative_tokens=k, drafter="suffix", **spec_kw)
    return SpeculativeEngine(target, create_drafter("suffix", spec=spec), spec)


REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.mark.parametrize("k_policy", ["fixed", "adaptive"])
def test_greedy_output_equals_plain_decoding(target_backend, k_policy):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = plain_engine(target_backend).generate(REPETITIVE, params)
    result = _engine(target_backend, k_policy=k_policy).generate(REPETITIVE, params)
    assert result.tokens == expected.tokens
    assert result.stats.num_drafts > 0 and result.stats.num_accepted_tokens > 0  # the tiny target loops
    for prompt in ([40, 41, 42], list(range(10, 40)) + list(range(10, 20))):
        assert _engine(target_backend, k=4).generate(prompt, SamplingParams(max_tokens=20)).tokens == \
            plain_engine(target_backend).generate(prompt, SamplingParams(max_tokens=20)).tokens


def test_a_second_request_drafts_from_the_first_ones_output(target_backend):
    """Request 2 continues request 1's text from part-way through its output (greedy: the same tokens
    follow). With the cross-request cache the drafter copies request 1's output; with it off it cannot."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    first_prompt = [60, 61, 62, 63]
    output = plain_engine(target_backend).generate(first_prompt, params).tokens
    second_prompt = first_prompt + output[:4]
    for cache_on in (True, False):
        engine = _engine(target_backend, k=6, suffix_cache=cache_on)
        engine.generate(first_prompt, params)
        drafter = engine.drafter
        sources = []
        original = drafter.next_source
        drafter.next_source = lambda context: sources.append(original(context)) or sources[-1]
        result = engine.generate(second_prompt, params)
        assert result.tokens == plain_engine(target_backend).generate(second_prompt, params).tokens
        used_cache = any(s and s.startswith("suffix-cache") for s in sources)
        assert used_cache == cache_on, sources
        assert (drafter.cache is not None) == cache_on
        if cache_on:
            drafter.forget()  # what generate's repeated runs call: the next request starts from nothing
            assert drafter.cache.num_tokens == 0 and drafter.cache.trie.root.count == 0


def test_sampled_output_is_distributed_as_the_target():
    table = random_table(5, seed=7, boost={0: 1, 1: 2, 2: 0})
    target = MarkovBackend(table)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    params = {"temperature": 1.0, "max_tokens": 3, "ignore_eos": True}
    engine = _engine(target, k=3, suffix_max_offset=2)
    draws = 3000
    counts, accepted, drafts = sampled_counts(engine, prompt, params, draws)
    expected = sequence_distribution(target.probs(), start=prompt[-1], length=3)
    assert chi_square_pvalue(counts, expected, draws) > 1e-3
    assert 0 < accepted < drafts  # both acceptances and rejections were exercised
