"""Confidence intervals for a speedup measured in interleaved paired runs (Student-t on the log ratios); pure.

The bench runner decodes each prompt (and each repeat) with plain decoding and with every configuration in
one interleaved turn, so each turn gives a paired ratio: the configuration's tokens/s over plain decoding's
in that turn. Drift and other load on the machine hit both halves of a pair alike. Ratios multiply, so the
interval is a Student-t interval on the mean log ratio, taken back with exp: an interval on the geometric
mean of the paired speedups (the figure `specdec bench` reports as speedup_geomean). Prompt-to-prompt
differences in the true speedup count as noise too, which only widens the interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedupInterval:
    """The geometric-mean paired speedup, its confidence interval, and how many paired runs it rests on."""

    estimate: float
    low: float
    high: float
    pairs: int
    confidence: float

    def includes(self, value: float) -> bool:
        return self.low <= value <= self.high

    def to_dict(self) -> dict:
        return {"estimate": round(self.estimate, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "pairs": self.pairs, "confidence": self.confidence}


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # where the fraction converges fast; else use the symmetry
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, for 0.5 <= p < 1 (bisection on t_cdf; exact to about 1e-10)."""
    if not 0.5 <= p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


def speedup_interval(ratios: Sequence[float], confidence: float = 0.95) -> SpeedupInterval | None:
    """A two-sided `confidence` interval on the geometric-mean speedup of paired ratios; None for fewer than two
    (one pair says nothing about the noise). Ratios must be positive."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if any(not r > 0 for r in ratios):
        raise ValueError("paired speedups must be positive")
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return SpeedupInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n, confidence)


def paired_ratios(runs: Iterable[dict], method: str, baseline: str = "plain") -> list[float]:
    """Per interleaved turn (task, prompt, repeat): tokens/s of `method` over `baseline`'s in the same turn.

    runs: the bench runner's run records. Turns where either side produced nothing are left out.
    """
    records = list(runs)
    base = {(r["task"], r["prompt_id"], r["repeat"]): r for r in records if r["method"] == baseline}
    ratios = []
    for run in records:
        if run["method"] != method:
            continue
        other = base.get((run["task"], run["prompt_id"], run["repeat"]))
        if other and other["tokens_per_second"] > 0 and run["tokens_per_second"] > 0:
            ratios.append(run["tokens_per_second"] / other["tokens_per_second"])
    return ratios


def binomial_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson (exact) two-sided interval on a success probability from `successes` of `trials`:
    the bounds are beta quantiles, found by bisection on regularized_beta. Conservative: it covers the true
    probability at least `confidence` of the time."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    tail = (1.0 - confidence) / 2.0

    def beta_quantile(p: float, a: float, b: float) -> float:
        low, high = 0.0, 1.0
        for _ in range(100):
            middle = (low + high) / 2.0
            if regularized_beta(a, b, middle) < p:
                low = middle
            else:
                high = middle
        return (low + high) / 2.0

    lower = 0.0 if successes == 0 else beta_quantile(tail, successes, trials - successes + 1)
    upper = 1.0 if successes == trials else beta_quantile(1.0 - tail, successes + 1, trials - successes)
    return lower, upper


__all__ = ["SpeedupInterval", "binomial_interval", "paired_ratios", "regularized_beta", "speedup_interval", "t_cdf",
           "t_quantile"]
