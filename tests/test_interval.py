"""specdec.core.intervals: Student-t quantiles against published tables, the interval on the geometric-mean paired
speedup against a hand computation, and the pairing of interleaved runs."""

from __future__ import annotations

import math
import random

import pytest

from specdec.core.intervals import paired_ratios, regularized_beta, speedup_interval, t_cdf, t_quantile


# Two-sided critical values t(p, df) from any statistics table.
@pytest.mark.parametrize("p, df, expected", [
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764), (0.975, 10, 2.2281), (0.975, 30, 2.0423),
    (0.95, 5, 2.0150), (0.995, 10, 3.1693), (0.9, 1000, 1.2824),
])
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-9)


def test_t_cdf_and_beta_identities():
    assert t_cdf(0.0, 3) == pytest.approx(0.5)
    assert t_cdf(-2.0, 7) == pytest.approx(1 - t_cdf(2.0, 7))
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert regularized_beta(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert regularized_beta(2.0, 3.0, 0.4) == pytest.approx(1 - regularized_beta(3.0, 2.0, 0.6))
    with pytest.raises(ValueError):
        t_quantile(0.3, 4)


def test_speedup_interval_by_hand():
    ratios = [1.10, 1.20, 1.05, 1.15]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = 3.182446 * sd / 2  # t(0.975, 3) * sd / sqrt(4)
    interval = speedup_interval(ratios)
    assert interval.pairs == 4 and interval.confidence == 0.95
    assert interval.estimate == pytest.approx(math.exp(mean))
    assert interval.low == pytest.approx(math.exp(mean - half), rel=1e-6)
    assert interval.high == pytest.approx(math.exp(mean + half), rel=1e-6)
    assert interval.low > 1.0 and not interval.includes(1.0)
    wider = speedup_interval(ratios, 0.99)
    assert wider.low < interval.low and wider.high > interval.high


def test_noise_around_one_includes_one_and_one_pair_has_no_interval():
    noise = speedup_interval([1.18, 0.86, 1.10, 0.95, 1.02])
    assert noise.includes(1.0) and noise.estimate > 1.0  # a point above 1 that the interval does not support
    assert speedup_interval([1.3]) is None and speedup_interval([]) is None
    identical = speedup_interval([1.2, 1.2, 1.2])
    assert identical.low == pytest.approx(1.2) and identical.high == pytest.approx(1.2)
    with pytest.raises(ValueError):
        speedup_interval([1.0, 0.0])


def _run(method, prompt, repeat, rate, task="t"):
    return {"method": method, "task": task, "prompt_id": prompt, "repeat": repeat, "tokens_per_second": rate}


def test_paired_ratios_pair_each_run_with_plain_in_the_same_turn():
    runs = [_run("plain", "a", 0, 10.0), _run("x", "a", 0, 12.0), _run("plain", "a", 1, 20.0), _run("x", "a", 1, 30.0),
            _run("plain", "b", 0, 8.0), _run("x", "b", 0, 0.0),  # produced nothing: left out
            _run("x", "c", 0, 9.0),  # no plain run in that turn: left out
            _run("plain", "a", 0, 5.0, task="u"), _run("x", "a", 0, 5.0, task="u")]
    assert paired_ratios(runs, "x") == [pytest.approx(1.2), pytest.approx(1.5), pytest.approx(1.0)]
    assert paired_ratios(runs, "missing") == []


def test_binomial_interval_matches_scipys_beta_quantiles():
    from specdec.core.intervals import binomial_interval

    stats = pytest.importorskip("scipy.stats")
    for successes, trials in ((0, 10), (1, 10), (20, 200), (19, 200), (100, 200), (200, 200), (3, 7)):
        low, high = binomial_interval(successes, trials)
        want_low = 0.0 if successes == 0 else stats.beta.ppf(0.025, successes, trials - successes + 1)
        want_high = 1.0 if successes == trials else stats.beta.ppf(0.975, successes + 1, trials - successes)
        assert low == pytest.approx(want_low, abs=1e-9) and high == pytest.approx(want_high, abs=1e-9)


def test_binomial_interval_covers_as_it_claims():
    from specdec.core.intervals import binomial_interval

    assert binomial_interval(20, 200)[0] < 0.1 < binomial_interval(20, 200)[1]
    # Coverage, by simulation: at p = 0.1 over 200 trials the interval holds p in at least ~95% of runs, and
    # a wrong p (0.2) is excluded from nearly all of them (the check can fail).
    rng = random.Random(7)
    covered = wrong = 0
    for _ in range(400):
        hits = sum(rng.random() < 0.1 for _ in range(200))
        low, high = binomial_interval(hits, 200)
        covered += low <= 0.1 <= high
        wrong += low <= 0.2 <= high
    assert covered >= 0.93 * 400 and wrong <= 0.02 * 400
    with pytest.raises(ValueError):
        binomial_interval(3, 2)
