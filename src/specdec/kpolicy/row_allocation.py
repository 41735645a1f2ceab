"""Draft lengths for one shared target pass, chosen together: the k per sequence that maximises the pass's expected tokens per second on a measured cost curve.

One sequence at a time cannot find this on a CPU. A pass's cost is not convex in its rows: on the 2-vCPU EPYC
(llama-bench, 1.5B Q4_K_M, repacked, 2 threads) 8 rows take 167 ms, 12 take 209, 15 take 242 and 16 take 188
(a faster kernel from 16 rows on), and in the engine's own decode passes of eight sequences 8 rows took 222 ms,
12-15 rows 278-344 and 16 rows 271. Beside seven others, one sequence's draft row moves the pass from 8 to 9 rows
for 16 ms and is not worth it; eight sequences drafting one row each move it to 16 for 49 ms, eight draft rows
at 6 ms each. So the rows are bought together:

    maximise (base_tokens + sum of the bought rows' gains) / (c(base_rows + rows bought) + their drafting time)

where a sequence's j-th draft row gains P(its first j draft tokens are all accepted) tokens. Within a sequence the
gains do not increase (each is the one before times an acceptance rate), so for any number of rows the best ones
are the largest gains taken in order (merged across sequences), and the best number is found by trying each:
O(R log S) for R candidate rows of S sequences (a few rounds of it where drafting costs differ between
sequences; see allocate_rows). Ties go to fewer rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specdec.kpolicy.calibration import cost_table


@dataclass(frozen=True)
class Candidate:
    """One sequence's possible draft rows: gains[j] = expected tokens its (j+1)-th draft row adds (that and every
    earlier draft token accepted); draft_seconds = what drafting one more token costs."""

    gains: Sequence[float]
    draft_seconds: float = 0.0


def allocate_rows(candidates: Sequence[Candidate], base_rows: int, base_tokens: float,
                  pass_cost: Callable[[int], float] | Mapping[int, float], margin: float = 0.0) -> list[int]:
    """Draft length per candidate for a pass that already holds `base_rows` rows yielding `base_tokens` tokens.

    pass_cost(rows) -> seconds of a target pass of that many rows, or the measured curve itself ({rows: seconds},
    interpolated as calibration.interpolate_cost does, sorted once for every row count). Returns k per candidate
    (each k <= len(gains)); all zero when no number of bought rows beats the pass without drafts by the fraction
    `margin` (the gains are estimates, and the drafts chosen are those whose estimates came out high).

    Dinkelbach's method for the ratio: at a rate r, a row is worth gain - r * draft_seconds, which still falls
    along each candidate's rows, so the best rows for every count are the merged largest values; the count that
    maximises tokens - r * seconds gives an allocation whose rate is the next r. The rate rises every round
    until no allocation beats it (the optimum); with one drafting cost for all, the first round already ends.
    """
    if any(g < 0 for c in candidates for g in c.gains):
        raise ValueError("a draft row's gain is an expected token count: never negative")
    # Every round reads the same pass costs: each row count's once.
    sizes = [base_rows + n for n in range(sum(len(c.gains) for c in candidates) + 1)]
    costs = cost_table(pass_cost, sizes) if isinstance(pass_cost, Mapping) else [pass_cost(n) for n in sizes]
    best = [0] * len(candidates)
    best_rate = _rate(float(base_tokens), costs[0]) * (1 + margin)
    for _ in range(64):  # converges in a few rounds; the bound only guards against float cycling
        ks, rate = _best_at_rate(candidates, base_tokens, costs, best_rate)
        if not rate > best_rate * (1 + 1e-12):
            break
        best, best_rate = ks, rate
    return best


def _best_at_rate(candidates: Sequence[Candidate], base_tokens: float, costs: Sequence[float],
                  rate: float) -> tuple[list[int], float]:
    """The allocation maximising tokens - rate * seconds (ties: fewer rows), and its tokens per second.
    costs[n] = seconds of the pass with n rows bought."""
    value = [[g - rate * c.draft_seconds for g in c.gains] for c in candidates]
    heap = [(-v[0], index, 0) for index, v in enumerate(value) if v]
    heapq.heapify(heap)
    order: list[int] = []  # candidate index of each bought row, in buying order
    gained, drafting = 0.0, 0.0
    best_rows, best_tokens, best_seconds = 0, float(base_tokens), costs[0]
    best_score = best_tokens - rate * best_seconds
    while heap:
        _, index, position = heapq.heappop(heap)
        order.append(index)
        gained += candidates[index].gains[position]
        drafting += candidates[index].draft_seconds
        tokens, seconds = base_tokens + gained, costs[len(order)] + drafting
        score = tokens - rate * seconds
        if score > best_score + 1e-12 * abs(best_score):
            best_rows, best_tokens, best_seconds, best_score = len(order), tokens, seconds, score
        if position + 1 < len(value[index]):
            heapq.heappush(heap, (-value[index][position + 1], index, position + 1))
    ks = [0] * len(candidates)
    for index in order[:best_rows]:
        ks[index] += 1
    return ks, _rate(best_tokens, best_seconds)


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("inf")
