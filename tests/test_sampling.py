"""The logits -> probabilities transform: temperature, top-k, top-p, min-p as documented, row by row."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.config import SamplingParams
from specdec.core.sampling import greedy_tokens, make_generator, probabilities, sample_token


def sp(**kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 1.0)
    return SamplingParams(**kwargs)


def logits_of(probs) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def test_greedy_has_no_distribution():
    with pytest.raises(ValueError, match="greedy"):
        probabilities(torch.zeros(5), SamplingParams(temperature=0.0))


def test_temperature_one_is_softmax():
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    probs = probabilities(logits, sp())
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.5, 4.0])
def test_temperature_divides_logits(temperature):
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(1)) * 3
    probs = probabilities(logits, sp(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_higher_temperature_flattens():
    logits = torch.tensor([3.0, 1.0, 0.0, -2.0])
    entropy = []
    for t in (0.3, 1.0, 3.0):
        p = probabilities(logits, sp(temperature=t))
        entropy.append(float(-(p * p.log()).sum()))
    assert entropy[0] < entropy[1] < entropy[2]


def test_low_precision_logits_give_float32_rows_summing_to_one():
    logits = (torch.randn(5, 50, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    for params in (sp(), sp(top_k=7), sp(top_p=0.5), sp(min_p=0.2), sp(temperature=0.6, top_k=10, top_p=0.9, min_p=0.05)):
        probs = probabilities(logits, params)
        assert probs.dtype == torch.float32
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(5), atol=1e-6, rtol=0)


def test_top_k_keeps_exactly_the_k_largest_renormalised():
    logits = torch.tensor([0.5, 2.0, -1.0, 3.0, 1.0, 0.0])
    probs = probabilities(logits, sp(top_k=3))
    assert torch.nonzero(probs).flatten().tolist() == [1, 3, 4]
    kept = torch.softmax(logits[[1, 3, 4]], dim=-1)
    torch.testing.assert_close(probs[[1, 3, 4]], kept)


def test_top_k_one_is_one_hot_on_argmax():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    probs = probabilities(logits, sp(top_k=1))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 20).float())


@pytest.mark.parametrize("top_k", [0, 6, 100])
def test_top_k_zero_or_at_least_vocab_is_a_no_op(top_k):
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(probabilities(logits, sp(top_k=top_k)), torch.softmax(logits, -1))


@pytest.mark.parametrize(
    "top_p,kept",
    [
        (0.3, [0]),  # the top token alone already reaches 0.3
        (0.45, [0]),
        (0.6, [0, 1]),
        (0.85, [0, 1, 2]),
        (0.97, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    # tokens are deliberately not in sorted order in the vocabulary
    base = [0.5, 0.3, 0.15, 0.05]
    order = [2, 0, 3, 1]  # vocab position of base[i]
    probs_in = [0.0] * 4
    for i, pos in enumerate(order):
        probs_in[pos] = base[i]
    probs = probabilities(logits_of(probs_in), sp(top_p=top_p))
    expected_kept = sorted(order[i] for i in kept)
    assert torch.nonzero(probs).flatten().tolist() == expected_kept
    total = sum(base[i] for i in kept)
    for i in kept:
        assert math.isclose(float(probs[order[i]]), base[i] / total, rel_tol=1e-5)


def test_top_p_always_keeps_the_top_token():
    probs = probabilities(logits_of([0.97, 0.01, 0.01, 0.01]), sp(top_p=1e-6))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_fraction_of_the_top():
    base = [0.4, 0.3, 0.15, 0.1, 0.05]
    probs = probabilities(logits_of(base), sp(min_p=0.3))  # threshold 0.12
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(probs[:3], torch.tensor(base[:3]) / 0.85)


def test_min_p_is_applied_after_temperature():
    base = [0.5, 0.3, 0.2]
    # at T=1 min_p=0.5 keeps 0.5 and 0.3 (threshold 0.25); at T=0.5 the scaled probs are 25:9:4,
    # threshold 12.5 keeps only the first.
    assert torch.count_nonzero(probabilities(logits_of(base), sp(min_p=0.5))) == 2
    assert torch.count_nonzero(probabilities(logits_of(base), sp(temperature=0.5, min_p=0.5))) == 1


def test_filters_compose_top_k_then_top_p_then_min_p():
    base = [0.35, 0.25, 0.2, 0.12, 0.08]
    # top_k=4 drops 0.08 -> [0.35, 0.25, 0.2, 0.12]/0.92; top_p=0.7 keeps the first three
    # (mass before the 4th = 0.8/0.92 = 0.87 >= 0.7); min_p=0.6 drops 0.2 (< 0.6 * 0.35).
    probs = probabilities(logits_of(base), sp(top_k=4, top_p=0.7, min_p=0.6))
    assert torch.nonzero(probs).flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[:2], torch.tensor([0.35, 0.25]) / 0.6)


@pytest.mark.parametrize(
    "params",
    [sp(), sp(temperature=0.7), sp(top_k=5), sp(top_p=0.8), sp(min_p=0.1), sp(temperature=1.3, top_k=9, top_p=0.9, min_p=0.02)],
    ids=["plain", "temp", "top_k", "top_p", "min_p", "all"],
)
def test_rows_are_independent_of_their_batch(params):
    """The lossless contract: a row's distribution does not depend on what it is batched with."""
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(5)) * 3
    batched = probabilities(logits, params)
    for i in range(logits.shape[0]):
        assert torch.equal(probabilities(logits[i], params), batched[i]), i
        assert torch.equal(probabilities(logits[i : i + 1], params)[0], batched[i]), i
    # Extra leading dimensions are rows too.
    assert torch.equal(probabilities(logits.reshape(7, 1, 40), params).reshape(7, 40), batched)
    torch.testing.assert_close(batched.sum(-1), torch.ones(7), atol=1e-6, rtol=0)


def test_neg_inf_logits_get_zero_probability():
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    probs = probabilities(logits, sp(temperature=0.8, top_p=0.99))
    assert probs[1] == 0 and probs[3] == 0
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_greedy_tokens_is_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -0.5, -0.5]])
    assert greedy_tokens(logits).tolist() == [1, 0, 2]
    assert int(greedy_tokens(logits[0])) == 1


def test_greedy_tokens_fast_path_equals_torch_argmax():
    """The numpy path for float32 CPU rows against torch.argmax: random rows with planted ties, -inf and NaN, 1-D and
    2-D, a non-contiguous view, and the torch path (float64) unchanged."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 1000, generator=generator)
    rows[::3, 17] = rows[::3].max(dim=-1).values  # a tie with an earlier or later maximum
    rows[1, :] = float("-inf")
    rows[2, 500] = float("nan")
    rows[4, [3, 900]] = float("nan")
    for logits in (rows, rows[5], rows[:, ::2], rows.double()):
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1)), logits.shape


def test_sample_token_never_draws_zero_probability_and_is_seeded():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    g1, g2 = make_generator(123), make_generator(123)
    draws1 = [sample_token(probs, g1) for _ in range(400)]
    draws2 = [sample_token(probs, g2) for _ in range(400)]
    assert draws1 == draws2
    assert set(draws1) == {1, 3, 4}
    # roughly the right frequencies (binomial sd ~ 0.025)
    assert abs(draws1.count(1) / 400 - 0.5) < 0.1


def test_make_generator_seed_none_is_fresh_entropy():
    a = [sample_token(torch.full((1000,), 1e-3), make_generator(None)) for _ in range(5)]
    b = [sample_token(torch.full((1000,), 1e-3), make_generator(7)) for _ in range(5)]
    assert len(set(b)) == 1  # same seed each time
    assert len(set(a)) > 1  # astronomically unlikely to collide five times


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-20])
def test_vanishing_temperature_is_the_greedy_limit_not_nan(temperature):
    # Before the max-shift, logits / 1e-39 overflowed to inf and softmax gave NaN (a 500 in the server).
    logits = torch.tensor([[3.0, 30.0, -2.0, 29.9], [0.5, -1.0, 0.25, 0.0]])
    probs = probabilities(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    assert sample_token(probs[0], torch.Generator().manual_seed(0)) == 1
