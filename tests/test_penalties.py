"""Penalties and logit_bias under speculation, against an independent reference.

The reference (numpy, written from OpenAI's and llama.cpp's definitions, sharing no code with core/penalties.py)
penalises the logits of a prefix-dependent mock LM; plain decoding with it is an argmax (or sampling) chain over
the mock. Greedy output of the engine, speculative (a draft model, k 1-8; prompt lookup) and plain, must equal
that chain; sampled output must follow its exact distribution (chi-square). Negative controls: the same tests
reject an engine whose verify rows see the whole draft's counts (the mistake DESIGN.md section 9 warns about),
and the penalties really change the output.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from specdec.config import ConfigError, SamplingParams, SpecConfig, from_json, to_json
from specdec.core import processors as processors_module
from specdec.core.penalties import PenaltyProcessor, penalty_processor
from specdec.core.sampling import probabilities
from specdec.drafters import create_drafter
from specdec.engine import scheduler as engine_module
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import SpeculativeEngine, plain_engine
from test_engine import PrefixLM, chi_square_p, sample_sequences, spec_engine

PENALISED = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4, repeat_last_n=6,
                 logit_bias=((3, 2.5), (7, -100.0), (11, 0.7)))


def reference_scores(logits: np.ndarray, prompt: list[int], generated: list[int], params: SamplingParams) -> np.ndarray:
    """OpenAI's logit_bias, llama.cpp's repetition penalty (CTRL's rule over the last n of prompt + output), then
    OpenAI's presence/frequency penalties over the output: the definitions, one id at a time."""
    out = np.array(logits, dtype=np.float64)
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.repetition_penalty != 1.0 and params.repeat_last_n != 0:
        history = prompt + generated
        window = history if params.repeat_last_n < 0 else history[-params.repeat_last_n:]
        for token in set(window):
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
    for token in set(generated):
        count = generated.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def reference_greedy(model: PrefixLM, prompt: list[int], params: SamplingParams) -> list[int]:
    generated: list[int] = []
    for _ in range(params.max_tokens):
        scores = reference_scores(model.logits(prompt + generated).numpy(), prompt, generated, params)
        generated.append(int(np.argmax(scores)))
    return generated


def reference_distribution(model: PrefixLM, prompt: list[int], params: SamplingParams, length: int) -> np.ndarray:
    v = model.vocab_size
    out = np.zeros([v] * length)
    for seq in itertools.product(range(v), repeat=length):
        prob = 1.0
        for i, token in enumerate(seq):
            generated = list(seq[:i])
            scores = reference_scores(model.logits(prompt + generated).numpy(), prompt, generated, params)
            prob *= float(probabilities(torch.tensor(scores, dtype=torch.float32), params)[token])
        out[seq] = prob
    return out.reshape(-1)


def whole_draft_rows(processor, logits, proposed):
    """The negative control: every row penalised with the counts of the whole draft, not of its own prefix."""
    rows = logits.shape[0]
    for token in proposed[: rows - 1]:
        processor.advance(int(token))
    out = torch.stack([processor.apply(logits[i]) for i in range(rows)])
    return out, rows - 1


# -- the processor itself -----------------------------------------------------------------------------------


def test_processor_matches_the_reference_through_advances_and_rollbacks():
    params = SamplingParams(**PENALISED)
    prompt = [1, 2, 3, 4, 5, 6, 7, 2]
    processor = PenaltyProcessor(params, prompt, 20)
    generator = torch.Generator().manual_seed(0)
    generated: list[int] = []
    for step in range(60):
        logits = torch.randn(20, generator=generator) * 3
        expected = reference_scores(logits.numpy(), prompt, generated, params)
        np.testing.assert_allclose(processor.apply(logits).numpy(), expected, rtol=1e-5, atol=1e-4)
        if step % 7 == 6 and len(generated) >= 3:
            processor.rollback(3)
            del generated[-3:]
        else:
            token = int(torch.randint(0, 20, (1,), generator=generator))
            processor.advance(token)
            generated.append(token)
    assert not torch.equal(processor.apply(torch.ones(20)), torch.ones(20))  # the state really penalises


def test_neutral_options_make_no_processor_and_bad_ones_are_refused():
    assert penalty_processor(SamplingParams(), [1], 10) is None
    assert penalty_processor(SamplingParams(logit_bias={2: 1.0}), [1], 10) is not None
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                dict(repeat_last_n=-2), dict(logit_bias={-1: 1.0}), dict(logit_bias={1: float("inf")}),
                dict(logit_bias=((1, 1.0), (1, 2.0)))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    params = SamplingParams(**PENALISED)
    assert from_json(to_json(params)) == params
    assert SamplingParams(logit_bias={5: 1, 2: -1}).logit_bias == ((2, -1), (5, 1))


def test_logit_bias_outside_the_vocabulary_is_refused_before_admission():
    engine = BatchEngine(PrefixLM(vocab=8, seed=1))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add([1, 2], SamplingParams(max_tokens=8, logit_bias={8: 1.0}))
    assert not engine.running


# -- greedy: identical to the reference chain ---------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_pair():
    target = PrefixLM(vocab=24, seed=41, max_context=96)
    draft = PrefixLM(vocab=24, seed=42, scale=0.6, base=target, max_context=96)
    return target, draft


def test_greedy_with_penalties_equals_the_reference_chain(wide_pair):
    target, draft = wide_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=40, ignore_eos=True, **PENALISED)
    expected = reference_greedy(target, prompt, params)
    unpenalised = reference_greedy(target, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert expected != unpenalised  # the options change the output: the test can tell
    assert plain_engine(target).generate(prompt, params).tokens == expected
    for k in (1, 3, 5, 8):
        engine = spec_engine(target, draft, k)
        assert engine.generate(prompt, params).tokens == expected, k
        stats = engine.last_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, k  # partial acceptance: rollbacks ran


def test_greedy_with_penalties_under_a_copying_drafter(wide_pair):
    target, _ = wide_pair
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
    params = SamplingParams(max_tokens=30, ignore_eos=True, presence_penalty=0.3, repetition_penalty=1.1,
                            repeat_last_n=-1)
    spec = SpecConfig(num_speculative_tokens=6)
    engine = SpeculativeEngine(target, create_drafter("prompt_lookup", spec=spec), spec)
    assert engine.generate(prompt, params).tokens == reference_greedy(target, prompt, params)
    assert engine.last_stats.num_draft_tokens > 0


def test_negative_control_whole_draft_counts_break_greedy_identity(wide_pair, monkeypatch):
    target, draft = wide_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=40, ignore_eos=True, **PENALISED)
    expected = reference_greedy(target, prompt, params)
    monkeypatch.setattr(engine_module, "process_rows", whole_draft_rows)
    outputs = [spec_engine(target, draft, k).generate(prompt, params).tokens for k in (3, 5, 8)]
    assert any(tokens != expected for tokens in outputs)


def test_batched_sequences_keep_their_own_penalties(wide_pair):
    """Several requests in one engine, each with its own options: each equals its own reference chain."""
    target, draft = wide_pair
    spec = SpecConfig(num_speculative_tokens=4)
    engine = BatchEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec, max_running=3)
    requests = [([3, 1, 4, 1], SamplingParams(max_tokens=20, ignore_eos=True, **PENALISED)),
                ([2, 7, 1, 8], SamplingParams(max_tokens=20, ignore_eos=True)),
                ([9, 9, 8], SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=1.5))]
    sequences = [engine.add(prompt, params) for prompt, params in requests]
    tokens = {s.request_id: [] for s in sequences}
    while engine.running:
        for output in engine.step():
            assert output.error is None
            tokens[output.request_id] += output.tokens
    for sequence, (prompt, params) in zip(sequences, requests):
        assert tokens[sequence.request_id] == reference_greedy(target, prompt, params)


# -- sampled: the penalised target distribution -------------------------------------------------------------

SAMPLED = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True, presence_penalty=1.5,
                         frequency_penalty=0.5, repetition_penalty=1.5, repeat_last_n=3, logit_bias=((0, 0.8),))


@pytest.fixture(scope="module")
def small_pair():
    target = PrefixLM(vocab=4, seed=11)
    draft = PrefixLM(vocab=4, seed=12, scale=1.2, base=target)
    exact = reference_distribution(target, [1, 2], SAMPLED, 3)
    return target, draft, exact


def test_speculative_sampling_with_penalties_follows_the_penalised_target(small_pair):
    target, draft, exact = small_pair
    plain_exact = reference_distribution(target, [1, 2], dataclasses.replace(
        SAMPLED, presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, logit_bias=()), 3)
    assert 0.5 * np.abs(exact - plain_exact).sum() > 0.1  # the penalties move the distribution a long way
    engine = spec_engine(target, draft, 3)
    counts = sample_sequences(engine, [1, 2], SAMPLED, 4000, 3, 4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert 0.2 < engine.total_stats.acceptance_rate < 0.95


def test_negative_control_whole_draft_counts_change_the_distribution(small_pair, monkeypatch):
    target, draft, exact = small_pair
    monkeypatch.setattr(engine_module, "process_rows", whole_draft_rows)
    counts = sample_sequences(spec_engine(target, draft, 3), [1, 2], SAMPLED, 4000, 3, 4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, (p_value, tv)


# -- the seam's draft cut (a processor that refuses tokens: the shape of a grammar) --------------------------


class Forbids:
    """A processor that refuses one token id everywhere (a one-rule grammar): its score is masked."""

    def __init__(self, token: int):
        self.token = token
        self.depth = 0

    def apply(self, logits):
        out = logits.float().clone()
        out[self.token] = float("-inf")
        return out

    def accepts(self, token):
        return token != self.token

    def advance(self, token):
        assert token != self.token, "advanced through a refused token"
        self.depth += 1

    def rollback(self, count):
        self.depth -= count

    def forced(self):
        return []


def test_refused_draft_tokens_end_the_draft_and_never_appear(wide_pair):
    target, draft = wide_pair
    prompt = [3, 1, 4, 1, 5]
    free = plain_engine(target).generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True)).tokens
    banned = max(set(free), key=free.count)  # the plain chain's most frequent token
    reference = []
    for _ in range(30):
        scores = target.logits(prompt + reference).clone()
        scores[banned] = float("-inf")
        reference.append(int(torch.argmax(scores)))
    for k in (2, 5):
        engine = BatchEngine(target, create_drafter("draft_model", draft_backend=draft,
                                                    spec=SpecConfig(num_speculative_tokens=k)),
                             SpecConfig(num_speculative_tokens=k))
        sequence = engine.add(prompt, SamplingParams(max_tokens=30, ignore_eos=True), processor=Forbids(banned))
        out = []
        while engine.running:
            for output in engine.step():
                out += output.tokens
        assert out == reference and banned not in out
        assert sequence.processor.depth == 30


def test_allowed_draft_length_keeps_a_sampled_drafts_first_refused_token():
    refuses = Forbids(4)
    assert processors_module.allowed_draft_length(refuses, [1, 2, 4, 5], keep_first_forbidden=False) == 2
    assert processors_module.allowed_draft_length(refuses, [1, 2, 4, 5], keep_first_forbidden=True) == 3
    assert refuses.depth == 0  # the state is left as found


def masked_distribution(model: PrefixLM, prompt: list[int], params: SamplingParams, banned: int, length: int):
    v = model.vocab_size
    out = np.zeros([v] * length)
    for seq in itertools.product(range(v), repeat=length):
        prob = 1.0
        for i, token in enumerate(seq):
            scores = model.logits(prompt + list(seq[:i])).clone()
            scores[banned] = float("-inf")
            prob *= float(probabilities(scores, params)[token])
        out[seq] = prob
    return out.reshape(-1)


def sample_with_processor(target, draft, prompt, params, banned, draws):
    spec = SpecConfig(num_speculative_tokens=3, k_policy="fixed")
    engine = BatchEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
    counts = np.zeros(target.vocab_size ** params.max_tokens, dtype=np.int64)
    for seed in range(draws):
        engine.add(prompt, dataclasses.replace(params, seed=seed), processor=Forbids(banned))
        tokens = []
        while engine.running:
            for output in engine.step():
                assert output.error is None
                tokens += output.tokens
        counts[np.ravel_multi_index(tokens, [target.vocab_size] * params.max_tokens)] += 1
    return counts, engine


def test_a_sampled_draft_refused_by_the_processor_keeps_the_masked_distribution(small_pair):
    """A draft model's q puts mass on a token the processor refuses: the draft keeps that token as its last (the
    rejection rule rejects it and draws from the residual), so the output follows the masked target exactly."""
    target, draft, _ = small_pair
    params = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
    exact = masked_distribution(target, [1, 2], params, banned=1, length=3)
    counts, engine = sample_with_processor(target, draft, [1, 2], params, 1, 4000)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert engine.total_stats.num_accepted_tokens > 0


def test_negative_control_cutting_a_sampled_draft_before_the_refused_token_is_not_exact(small_pair, monkeypatch):
    target, draft, _ = small_pair
    params = SamplingParams(temperature=0.9, max_tokens=3, ignore_eos=True)
    exact = masked_distribution(target, [1, 2], params, banned=1, length=3)
    original = processors_module.allowed_draft_length
    monkeypatch.setattr(engine_module, "allowed_draft_length",
                        lambda processor, tokens, keep: original(processor, tokens, False))
    counts, _ = sample_with_processor(target, draft, [1, 2], params, 1, 4000)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value < 1e-6, (p_value, tv)
