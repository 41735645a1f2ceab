"""`seed`: with no draft distribution (plain decoding, the model-free drafters), each output position is drawn with
noise keyed by (seed, position) alone, so a seeded request's text is the same in plain and speculative mode and beside
any other request; the draws have the target's distribution (chi-square) and are independent across positions,
which a negative control that reuses one noise for every position fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.config import SamplingParams, SpecConfig
from specdec.core.sampling import position_seed, positional_choices, sample_rows
from specdec.drafters import create_drafter
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import SpeculativeEngine, plain_engine
from test_engine import PrefixLM, chi_square_p, sample_sequences
from test_penalties import reference_distribution

P = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
DRAWS = 4000


def joint_counts(choose) -> np.ndarray:
    counts = np.zeros(16, dtype=np.int64)
    for seed in range(DRAWS):
        first, second = choose(seed)
        counts[first * 4 + second] += 1
    return counts


def test_positional_draws_are_the_distribution_and_independent_across_positions():
    exact = np.outer(P[0].double().numpy(), P[0].double().numpy()).reshape(-1)
    counts = joint_counts(lambda seed: positional_choices(P.repeat(2, 1), seed, 0))
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert positional_choices(P.repeat(3, 1), 7, 5)[1:] == positional_choices(P.repeat(2, 1), 7, 6)  # by position
    assert len({position_seed(s, i) for s in range(50) for i in range(50)}) == 2500


def test_a_negative_control_one_noise_for_every_position_is_caught():
    exact = np.outer(P[0].double().numpy(), P[0].double().numpy()).reshape(-1)

    def same_noise(seed):
        generator = torch.Generator().manual_seed(seed)
        noise_state = generator.get_state()
        first = int(sample_rows(P[0], generator))
        generator.set_state(noise_state)
        return first, int(sample_rows(P[0], generator))

    p_value, _ = chi_square_p(joint_counts(same_noise), exact)
    assert p_value < 1e-6


@pytest.fixture(scope="module")
def model():
    return PrefixLM(vocab=4, seed=21)


def lookup_engine(target, k: int = 4) -> SpeculativeEngine:
    spec = SpecConfig(drafter="prompt_lookup", num_speculative_tokens=k, k_policy="fixed")
    return SpeculativeEngine(target, create_drafter("prompt_lookup", spec=spec), spec)


PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)


def test_a_seeded_request_is_plain_decodings_text_when_speculating(model):
    plain, fast = plain_engine(model), lookup_engine(model)
    drafted = 0
    for seed in range(40):
        params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed)
        expected = plain.generate(PROMPT, params).tokens
        out = fast.generate(PROMPT, params)
        assert out.tokens == expected, seed
        drafted += out.stats.num_draft_tokens
    assert drafted > 100  # the drafter proposed, and the verdicts kept what matched the positional draws


def test_seeded_speculative_output_has_the_targets_distribution(model):
    exact = reference_distribution(model, [1, 2], SamplingParams(temperature=1.0, max_tokens=3), 3)
    counts = sample_sequences(lookup_engine(model, 3), [1, 2], SamplingParams(temperature=1.0, max_tokens=3,
                                                                             ignore_eos=True), DRAWS, 3, 4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)


def test_a_seeded_request_does_not_depend_on_what_is_batched_beside_it(model):
    spec = SpecConfig(drafter="prompt_lookup", num_speculative_tokens=4, k_policy="fixed")
    engine = BatchEngine(model, create_drafter("prompt_lookup", spec=spec), spec, max_running=3)
    solo = {seed: lookup_engine(model).generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16,
                                                                       ignore_eos=True, seed=seed)).tokens
            for seed in (3, 4)}
    first = engine.add(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3))
    engine.add([2, 2, 1], SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True))  # a stranger, unseeded
    third = engine.add(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=4))
    tokens = {id(first): [], id(third): []}
    while engine.running:
        for output in engine.step():
            for sequence in (first, third):
                if output.request_id == sequence.request_id:
                    tokens[id(sequence)] += output.tokens
    assert tokens[id(first)] == solo[3] and tokens[id(third)] == solo[4]
