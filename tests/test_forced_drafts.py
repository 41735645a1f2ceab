"""Forced tokens as free drafts with the drafter continuing after them, in the same verify pass.

A processor that forces one token at fixed output positions (the shape of a grammar's fixed text) over a
prefix-dependent mock LM: the reference masks every row to the forced token there and takes the argmax (or the
exact masked distribution). Greedy speculative output must equal the reference with steps that verify forced and
drafted tokens together; sampled output with a draft model must follow the masked distribution exactly
(chi-square), and the negative control (the draft's q rows not shifted past the forced tokens) must fail it.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from specdec.config import SamplingParams, SpecConfig
from specdec.core.sampling import probabilities
from specdec.drafters import create_drafter
from specdec.drafters.base import Draft
from specdec.engine import scheduler as engine_module
from specdec.engine.scheduler import BatchEngine
from test_engine import PrefixLM, chi_square_p


class ForcesAt:
    """Forces `token` at the output positions in `positions` (0-based, counted from the first generated token)."""

    def __init__(self, token: int, positions: set[int]):
        self.token, self.positions, self.depth = token, positions, 0

    def _forcing(self) -> bool:
        return self.depth in self.positions

    def apply(self, logits):
        if not self._forcing():
            return logits.float()
        out = torch.full_like(logits.float(), float("-inf"))
        out[self.token] = logits[self.token].float()
        return out

    def accepts(self, token):
        return not self._forcing() or token == self.token

    def advance(self, token):
        assert self.accepts(token), (self.depth, token)
        self.depth += 1

    def rollback(self, count):
        self.depth -= count

    def forced(self):
        run = []
        depth = self.depth
        while depth in self.positions:
            run.append(self.token)
            depth += 1
        return run


def reference_greedy(model, prompt, token, positions, length):
    out: list[int] = []
    for i in range(length):
        out.append(token if i in positions else int(torch.argmax(model.logits(prompt + out))))
    return out


def masked_distribution(model, prompt, params, token, positions, length):
    v = model.vocab_size
    exact = np.zeros([v] * length)
    for seq in itertools.product(range(v), repeat=length):
        prob = 1.0
        for i, t in enumerate(seq):
            if i in positions:
                prob *= float(t == token)
            else:
                prob *= float(probabilities(model.logits(prompt + list(seq[:i])), params)[t])
        exact[seq] = prob
    return exact.reshape(-1)


def run(engine, prompt, params, processor):
    engine.add(prompt, params, processor=processor)
    tokens = []
    while engine.running:
        for output in engine.step():
            assert output.error is None
            tokens += output.tokens
    return tokens


def test_greedy_drafts_continue_after_forced_tokens_and_equal_the_reference(monkeypatch):
    target = PrefixLM(vocab=24, seed=41, max_context=96)
    draft = PrefixLM(vocab=24, seed=42, scale=0.6, base=target, max_context=96)
    prompt, positions = [3, 1, 4, 1, 5], {2, 3, 9, 15}
    expected = reference_greedy(target, prompt, 7, positions, 24)
    assert expected != reference_greedy(target, prompt, 7, set(), 24)  # the forcing changes the output
    finished = []
    original = BatchEngine._finish_decode

    def spy(self, plan, logits, seconds, shared):
        out = original(self, plan, logits, seconds, shared)
        finished.append((plan.forced, len(plan.proposed) - plan.forced, len(out.tokens)))
        return out

    monkeypatch.setattr(BatchEngine, "_finish_decode", spy)
    for k in (2, 4):
        spec = SpecConfig(num_speculative_tokens=k, k_policy="fixed")
        engine = BatchEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
        tokens = run(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True), ForcesAt(7, positions))
        assert tokens == expected, k
        stats = engine.total_stats
        assert stats.num_forced_tokens == stats.num_forced_accepted_tokens > 0
        # Some step verified forced tokens and the drafter's after them, and emitted past the forced ones.
        assert any(f > 0 and d > 0 and emitted > f + 1 for f, d, emitted in finished), finished
        finished.clear()


def test_a_prompt_lookup_draft_continues_after_forced_tokens():
    target = PrefixLM(vocab=24, seed=41, max_context=96)
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6]
    free = reference_greedy(target, prompt, 7, set(), 20)
    positions = {free.index(7)} if 7 in free else {0}
    spec = SpecConfig(num_speculative_tokens=6)
    engine = BatchEngine(target, create_drafter("prompt_lookup", spec=spec), spec)
    tokens = run(engine, prompt, SamplingParams(max_tokens=20, ignore_eos=True), ForcesAt(7, positions))
    assert tokens == reference_greedy(target, prompt, 7, positions, 20)


SAMPLED = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True)  # position 1 forced, then one drafted


@pytest.fixture(scope="module")
def small_pair():
    target = PrefixLM(vocab=4, seed=11)
    draft = PrefixLM(vocab=4, seed=12, scale=1.2, base=target)
    return target, draft, masked_distribution(target, [1, 2], SAMPLED, 2, {1}, 4)


def sample(target, draft, draws):
    spec = SpecConfig(num_speculative_tokens=3, k_policy="fixed")
    engine = BatchEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
    counts = np.zeros(target.vocab_size ** 4, dtype=np.int64)
    for seed in range(draws):
        tokens = run(engine, [1, 2], dataclasses.replace(SAMPLED, seed=seed), ForcesAt(2, {1}))
        counts[np.ravel_multi_index(tokens, [target.vocab_size] * 4)] += 1
    return counts, engine


def test_sampled_drafts_after_forced_tokens_keep_the_masked_distribution(small_pair):
    target, draft, exact = small_pair
    counts, engine = sample(target, draft, 6000)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert engine.total_stats.num_accepted_tokens > 0 and engine.total_stats.num_forced_tokens > 0


def test_negative_control_q_rows_out_of_step_with_the_tokens(small_pair, monkeypatch):
    """Were the forced tokens' one-hot rows put after the drafter's q instead of before it, each drafted token
    would be judged against the wrong q (accepted where q says 0): the distribution test must catch it."""
    target, draft, exact = small_pair
    original = engine_module._after_forced

    def out_of_step(forced, draft_, vocab_size):
        whole = original(forced, draft_, vocab_size)
        if not forced or whole.probs is None:
            return whole
        return Draft(whole.tokens, torch.cat([whole.probs[len(forced):], whole.probs[: len(forced)]]), whole.seconds)

    monkeypatch.setattr(engine_module, "_after_forced", out_of_step)
    counts, _ = sample(target, draft, 6000)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, (p_value, tv)


class HintsAt(ForcesAt):
    """Offers `token` as forced at `positions` but masks nothing (llguidance's fast-forward tokens, where the model
    may write the same text in other tokens): the target may reject the hint."""

    def apply(self, logits):
        return logits.float()

    def accepts(self, token):
        return True


def test_a_rejected_forced_token_leaves_the_draft_models_cache_in_step_with_the_context():
    target = PrefixLM(vocab=24, seed=41, max_context=96)
    draft = PrefixLM(vocab=24, seed=42, scale=0.6, base=target, max_context=96)
    prompt, positions = [3, 1, 4, 1, 5], set(range(0, 30, 3))
    expected = reference_greedy(target, prompt, None, set(), 24)
    spec = SpecConfig(num_speculative_tokens=3, k_policy="fixed")
    drafter = create_drafter("draft_model", draft_backend=draft, spec=spec)
    propose, checked = drafter.propose, []

    def checked_propose(context, k):  # after each draft the cache holds the context it was given, then the draft
        out = propose(context, k)
        held = drafter.retained.tokens
        assert held[: len(context)] == list(context)[: len(held)]
        checked.append(len(context))
        return out

    drafter.propose = checked_propose
    engine = BatchEngine(target, drafter, spec)
    tokens = run(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True), HintsAt(0, positions))
    assert checked
    stats = engine.total_stats
    rejected = stats.num_forced_tokens - stats.num_forced_accepted_tokens
    assert tokens == expected and rejected > 0
    assert stats.num_accepted_tokens > 0
