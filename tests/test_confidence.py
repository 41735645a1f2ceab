"""Confidence stop (draft_p_min) shortens drafts without changing output; the engine handles k = 0 and empty drafts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from markov_backend import MarkovBackend, chi_square_pvalue, one_torch_thread, sequence_distribution  # noqa: F401
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import Draft, create_drafter
from specdec.drafters.base import Drafter
from specdec.engine.single import SpeculativeEngine, plain_engine
from specdec.kpolicy.base import FixedK


def confident_chain() -> torch.Tensor:
    """0 -> 1 -> 2 with p ~ 0.97 each; from 2 the top choice (3) has p ~ 0.25; then 3 -> 4 -> 5 -> 0 confident."""
    table = torch.zeros(6, 6)
    for a, b in ((0, 1), (1, 2), (3, 4), (4, 5), (5, 0)):
        table[a, b] = 5.0
    table[2, 3] = 0.5
    return table


def _draft_model_drafter(backend, p_min, params=None, seed=0):
    drafter = create_drafter("draft_model", draft_backend=backend, spec=SpecConfig(draft_p_min=p_min))
    drafter.begin([0], params or SamplingParams(), torch.Generator().manual_seed(seed))
    return drafter


def test_confidence_stop_cuts_the_draft_where_the_draft_model_is_unsure():
    backend = MarkovBackend(confident_chain())
    context = [4, 5, 0]
    assert _draft_model_drafter(backend, 0.0).propose(context, 5).tokens == [1, 2, 3, 4, 5]
    drafter = _draft_model_drafter(backend, 0.5)
    draft = drafter.propose(context, 5)
    assert draft.tokens == [1, 2]  # the third token (3, p ~ 0.25) is below 0.5
    # The cache holds the context and both proposed tokens; accepting 1 rolls it back to context + [1].
    assert drafter.cache.length == len(context) + 2
    drafter.accepted(1, 2)
    assert drafter.cache.tokens == context + [1]


def test_confidence_stop_always_proposes_at_least_one_token():
    backend = MarkovBackend(confident_chain())
    # From 2 the very first token is unsure (p ~ 0.25 < 0.5) but is still proposed; the rest are confident.
    assert _draft_model_drafter(backend, 0.5).propose([1, 2], 4).tokens == [3, 4, 5, 0]
    # A threshold above every probability leaves exactly one token.
    assert _draft_model_drafter(backend, 0.99).propose([5, 0], 4).tokens == [1]


def test_confidence_stop_in_sampled_mode_keeps_one_q_row_per_token():
    backend = MarkovBackend(confident_chain())
    params = SamplingParams(temperature=1.0)
    lengths = set()
    for seed in range(20):
        drafter = _draft_model_drafter(backend, 0.5, params, seed)
        draft = drafter.propose([4, 5, 0], 5)
        assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), 6)
        assert torch.allclose(draft.probs.sum(-1), torch.ones(len(draft.tokens)))
        for row, token in zip(draft.probs, draft.tokens):
            assert row[token] > 0
        if 2 in draft.tokens:  # state 2 is unsure: drafting stops right after reaching it
            assert draft.tokens.index(2) == len(draft.tokens) - 1
        lengths.add(len(draft.tokens))
    assert 2 in lengths  # the usual path 0 -> 1 -> 2 stops after two tokens


@pytest.fixture()
def self_draft_backend(target_model):
    # The target as its own draft accepts every token under greedy, so only p_min limits draft length.
    return TransformersBackend(target_model, name="self-draft", max_context=256)


def test_confidence_stop_shortens_drafts_and_keeps_greedy_output(target_backend, self_draft_backend):
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = plain_engine(target_backend).generate(prompt, params).tokens
    draft_tokens = {}
    for p_min in (0.0, 0.05, 0.99):
        spec = SpecConfig(num_speculative_tokens=5, draft_p_min=p_min)
        engine = SpeculativeEngine(target_backend, create_drafter("draft_model", draft_backend=self_draft_backend, spec=spec), spec)
        result = engine.generate(prompt, params)
        assert result.tokens == expected, p_min
        stats = result.stats
        assert stats.acceptance_rate == 1.0
        draft_tokens[p_min] = stats.num_draft_tokens / stats.num_drafts
    assert draft_tokens[0.0] > draft_tokens[0.99]
    assert draft_tokens[0.0] >= draft_tokens[0.05] >= draft_tokens[0.99]
    assert draft_tokens[0.99] == 1.0  # nothing is that confident: one token per draft


def test_confidence_stop_is_lossless_under_sampling():
    target_table = confident_chain() + torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
    target, draft = MarkovBackend(target_table), MarkovBackend(confident_chain())
    spec = SpecConfig(num_speculative_tokens=4, draft_p_min=0.5)
    engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
    prompt = [4, 5, 0, 1]  # the draft proposes 2 confidently, then stops at the unsure state 2
    counts: Counter = Counter()
    draws = 2000
    proposed = drafts = 0
    for seed in range(draws):
        result = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3, seed=seed, ignore_eos=True))
        counts[tuple(result.tokens)] += 1
        proposed += result.stats.num_draft_tokens
        drafts += result.stats.num_drafts
    assert chi_square_pvalue(counts, sequence_distribution(target.probs(), prompt[-1], 3), draws) > 1e-3
    assert proposed < 1.2 * drafts  # k allowed 2 on the first step; the stop at state 2 cut nearly all to 1


class _StubDrafter(Drafter):
    """Proposes nothing on every other call, otherwise a fixed (mostly wrong) guess; records the calls."""

    name = "stub"

    def __init__(self):
        self.calls: list[int] = []
        self.feedback: list[tuple[int, int]] = []

    def begin(self, prompt, params, generator):
        self.calls.clear()

    def propose(self, context, k):
        self.calls.append(k)
        if len(self.calls) % 2:
            return Draft([])
        return Draft([int(context[-1])] * k)

    def accepted(self, num_accepted, num_proposed):
        self.feedback.append((num_accepted, num_proposed))

    def end(self):
        pass


class _ScriptedK(FixedK):
    """A policy that plays back a script of k values (k = 0 is a plain step)."""

    def __init__(self, script):
        super().__init__(0)
        self.script = list(script)
        self.step = 0

    def next_k(self):
        k = self.script[self.step % len(self.script)]
        self.step += 1
        return k


def test_engine_handles_empty_drafts(target_backend):
    drafter = _StubDrafter()
    engine = SpeculativeEngine(target_backend, drafter, SpecConfig(num_speculative_tokens=3))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    result = engine.generate([21, 22, 23], params)
    assert result.tokens == plain_engine(target_backend).generate([21, 22, 23], params).tokens
    nonempty = sum(1 for i in range(len(drafter.calls)) if i % 2)
    assert result.stats.num_drafts == nonempty == len(drafter.feedback)  # accepted() only after real drafts
    # Every step asked the drafter but the last, which had one token of budget left (nothing to draft): the first
    # token came from the prefill's pass.
    assert result.stats.num_target_forwards == len(drafter.calls) + 1


@pytest.mark.parametrize("drafter_name", ["draft_model", "hybrid", "prompt_lookup"])
def test_engine_handles_k_zero_steps(target_backend, draft_backend, monkeypatch, drafter_name):
    import specdec.engine.scheduler as engine_module  # the step code lives there

    monkeypatch.setattr(engine_module, "make_policy", lambda name, k, pass_costs=None: _ScriptedK([0, 3, 0, 0, 2, 1]))
    spec = SpecConfig(num_speculative_tokens=3, drafter=drafter_name)
    drafter = create_drafter(drafter_name, draft_backend=draft_backend, spec=spec)
    calls = []
    original = drafter.propose
    drafter.propose = lambda context, k: calls.append(k) or original(context, k)
    engine = SpeculativeEngine(target_backend, drafter, spec)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    result = engine.generate(prompt, params)
    assert result.tokens == plain_engine(target_backend).generate(prompt, params).tokens
    assert calls and 0 not in calls  # a k = 0 step never asks the drafter
    assert result.stats.num_target_forwards > len(calls)
