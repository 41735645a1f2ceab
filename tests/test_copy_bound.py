"""The copy bound: copyable lengths and the cheapest decode schedule, each against an independent brute force."""

import random
from functools import lru_cache

import pytest

from specdec.bench.method.copy_bound import (
    cheapest_decode_cost,
    combined_speedup,
    copy_bound,
    copyable_lengths,
)
from specdec.kpolicy.calibration import interpolate_cost, machine_ceiling

CURVE = {1: 36.0, 2: 58.0, 3: 74.0, 4: 90.0, 8: 215.0, 16: 276.0, 17: 311.0, 32: 493.0, 33: 492.0}


def _occurs(span: list[int], source: list[int]) -> bool:
    return any(source[j:j + len(span)] == span for j in range(len(source) - len(span) + 1))


def _copyable_by_search(prompt, output, max_len, history=()):
    """Independent statement: the longest L with output[i:i+L] a contiguous slice of one whole source."""
    lengths = []
    for i in range(len(output)):
        sources = [list(prompt) + list(output[:i]), *[list(h) for h in history]]
        best = 0
        for length in range(1, min(max_len, len(output) - i) + 1):
            if any(_occurs(list(output[i:i + length]), source) for source in sources):
                best = length
        lengths.append(best)
    return lengths


def test_copyable_lengths_on_a_hand_example():
    prompt = [5, 6, 7, 8]
    output = [9, 6, 7, 8, 6, 7, 1]
    # 9: nowhere; "6 7 8" from the prompt; "8" ("8 6" occurs nowhere before position 3); "6 7" ("6 7 1" does
    # not occur); "7"; "1": nowhere.
    assert copyable_lengths(prompt, output, 8) == [0, 3, 2, 1, 2, 1, 0]
    assert copyable_lengths(prompt, output, 2) == [0, 2, 2, 1, 2, 1, 0]


def test_a_span_may_come_from_the_output_so_far_but_not_from_its_future():
    output = [1, 2, 3, 1, 2, 3, 1, 2]
    # From position 3 on the output so far holds what follows (position 4: "2 3 1" in 1 2 3 1); a span never
    # reads past the context's end, nor past the output's.
    assert copyable_lengths([], output, 8) == [0, 0, 0, 3, 3, 3, 2, 1]


def test_a_span_does_not_cross_from_one_source_into_another():
    history = [[1, 2], [3, 4]]
    assert copyable_lengths([], [2, 3], 4, history) == [1, 1]  # "2 3" only across the boundary
    assert copyable_lengths([], [1, 2, 3, 4], 4, history) == [2, 1, 2, 1]


def _chained_by_search(prompt, output, max_len, overlap, history=()):
    """Independent statement of chaining: spans out[s:e], each occurring in a source at its start s, the next
    starting inside the last with at least `overlap` of its tokens before the last one's end."""
    n = len(output)
    plain = _copyable_by_search(prompt, output, n, history)

    @lru_cache(maxsize=None)
    def reach(i):
        best = plain[i]
        for end in range(i + overlap + 1, i + plain[i] + 1):
            for start in range(i + 1, end - overlap + 1):
                best = max(best, start - i + reach(start))
        return best

    return [min(max_len, n - i, reach(i)) for i in range(n)]


@pytest.mark.parametrize("seed", range(10))
def test_chained_copyable_lengths_equal_a_brute_force_search(seed):
    rng = random.Random(50 + seed)
    # Two copies of a text in the prompt that share a stretch, so chaining through it reaches further.
    a, b, shared = ([rng.randrange(9) for _ in range(5)] for _ in range(3))
    tail_a, tail_b = [rng.randrange(9) for _ in range(3)], [rng.randrange(9) for _ in range(4)]
    prompt = a + shared + tail_a + [99] + [rng.randrange(9) for _ in range(2)] + shared + tail_b
    output = a + shared + tail_b + [rng.randrange(9) for _ in range(rng.randrange(0, 4))]
    overlap, max_len = rng.choice([2, 3, 4]), rng.choice([6, 12, 30])
    lengths = copyable_lengths(prompt, output, max_len, chain_overlap=overlap)
    assert lengths == _chained_by_search(prompt, output, max_len, overlap)
    assert all(c >= p for c, p in zip(lengths, copyable_lengths(prompt, output, max_len)))


def test_chaining_reaches_past_the_first_span_only_through_a_long_enough_overlap():
    prompt = [1, 2, 3, 4, 5, 6, 90, 4, 5, 6, 7, 8]
    output = [1, 2, 3, 4, 5, 6, 7, 8]
    assert copyable_lengths(prompt, output, 10)[0] == 6  # "1 .. 6" from the prompt's start
    assert copyable_lengths(prompt, output, 10, chain_overlap=3)[0] == 8  # "4 5 6" joins the second copy
    assert copyable_lengths(prompt, output, 10, chain_overlap=4)[0] == 6  # the shared stretch is only 3 long


@pytest.mark.parametrize("seed", range(12))
def test_copyable_lengths_equal_a_brute_force_search(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 16))]
    history = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(0, 3))]
    max_len = rng.randrange(1, 7)
    assert copyable_lengths(prompt, output, max_len, history) == _copyable_by_search(prompt, output, max_len, history)


def _cheapest_by_recursion(copyable, curve, max_k):
    n = len(copyable)

    @lru_cache(maxsize=None)
    def best(i):
        if i >= n:
            return 0.0
        top = min(copyable[i], max_k, n - 1 - i)
        return min(interpolate_cost(curve, k + 1) + best(i + k + 1) for k in range(top + 1))

    return best(1)


@pytest.mark.parametrize("seed", range(10))
def test_the_cheapest_schedule_equals_an_exhaustive_recursion(seed):
    rng = random.Random(100 + seed)
    copyable = [rng.randrange(0, 9) for _ in range(rng.randrange(2, 40))]
    cost, passes = cheapest_decode_cost(copyable, CURVE, 8)
    assert cost == pytest.approx(_cheapest_by_recursion(copyable, CURVE, 8))
    assert 1 <= passes <= len(copyable) - 1


def test_nothing_copyable_costs_plain_decoding_and_a_perfect_copy_reaches_the_ceiling():
    bound = copy_bound([7] * 3, [1, 2, 3, 4, 5, 6], CURVE, 32)
    assert bound["speedup"] == pytest.approx(1.0) and bound["copyable_tokens"] == 0
    assert bound["plain_cost"] == pytest.approx(5 * 36.0)
    # The whole answer stands in the prompt: 1 + 33 * m tokens decode in m passes of 33 rows after the first.
    answer = list(range(100, 100 + 1 + 33 * 3))
    bound = copy_bound(answer, answer, CURVE, 32)
    ceiling, k = machine_ceiling(CURVE, 32)
    assert k == 32 and bound["passes"] == 3
    assert bound["speedup"] == pytest.approx(ceiling)


def test_the_copy_bound_never_passes_the_ceiling_and_aggregates_by_cost():
    rng = random.Random(7)
    ceiling, _ = machine_ceiling(CURVE, 32)
    bounds = []
    for _ in range(20):
        prompt = [rng.randrange(6) for _ in range(30)]
        output = [rng.randrange(6) for _ in range(40)]
        bound = copy_bound(prompt, output, CURVE, 32)
        assert 1.0 <= bound["speedup"] <= ceiling + 1e-9
        bounds.append(bound)
    total = combined_speedup(bounds)
    assert total == pytest.approx(sum(b["plain_cost"] for b in bounds) / sum(b["copy_cost"] for b in bounds))
    assert combined_speedup([]) is None
