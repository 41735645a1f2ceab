"""SpecStats counters and derived rates (vLLM's definitions) and the Leviathan et al. performance model."""

from __future__ import annotations

import pytest

from specdec.core.stats import SpecStats, expected_tokens_per_step, leviathan_speedup


def test_empty_stats_have_safe_rates():
    stats = SpecStats()
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0  # plain decoding
    assert stats.acceptance_rate_per_pos == []
    assert stats.tokens_per_second == 0.0
    assert stats.decode_seconds == 0.0


def test_record_step_counts_drafts_and_positions():
    stats = SpecStats()
    stats.record_step(3, 3)  # all accepted
    stats.record_step(3, 1)
    stats.record_step(2, 0)  # a shorter draft
    stats.record_step(0, 0)  # a plain step: a target forward, no draft
    assert stats.num_target_forwards == 4
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 8
    assert stats.num_accepted_tokens == 4
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert stats.num_drafts_per_pos == [3, 3, 2]
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 2])


def test_merge_adds_everything_and_grows_per_position_lists():
    a, b = SpecStats(), SpecStats()
    a.record_step(2, 1)
    a.num_generated_tokens, a.num_prompt_tokens, a.draft_seconds, a.total_seconds = 2, 5, 0.5, 1.0
    b.record_step(4, 4)
    b.num_generated_tokens, b.num_prompt_tokens, b.target_seconds, b.total_seconds = 5, 3, 0.25, 2.0
    merged = SpecStats().merge(a).merge(b)
    assert merged.num_drafts == 2 and merged.num_draft_tokens == 6 and merged.num_accepted_tokens == 5
    assert merged.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert merged.num_drafts_per_pos == [2, 2, 1, 1]
    assert merged.num_generated_tokens == 7 and merged.num_prompt_tokens == 8
    assert merged.draft_seconds == 0.5 and merged.target_seconds == 0.25 and merged.total_seconds == 3.0
    assert merged.num_target_forwards == 2
    # merge must not alias the other's lists
    merged.record_step(1, 1)
    assert b.num_accepted_tokens_per_pos == [1, 1, 1, 1]


def test_time_derived_rates():
    stats = SpecStats(num_generated_tokens=30, total_seconds=2.0, prefill_seconds=0.5)
    assert stats.tokens_per_second == 15.0
    assert stats.decode_seconds == 1.5


def test_to_dict_has_the_documented_fields():
    stats = SpecStats()
    stats.record_step(4, 2)
    stats.num_generated_tokens, stats.total_seconds = 3, 0.5
    data = stats.to_dict()
    assert data["num_drafts"] == 1 and data["num_draft_tokens"] == 4 and data["num_accepted_tokens"] == 2
    assert data["acceptance_rate"] == 0.5
    assert data["mean_acceptance_length"] == 3.0
    assert data["num_accepted_tokens_per_pos"] == [1, 1, 0, 0]
    assert data["acceptance_rate_per_pos"] == [1.0, 1.0, 0.0, 0.0]
    assert data["tokens_per_second"] == 6.0
    import json

    json.dumps(data)  # serialisable


@pytest.mark.parametrize(
    "a,k,expected",
    [(0.0, 5, 1.0), (1.0, 5, 6.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.8, 4, (1 - 0.8**5) / 0.2), (1.5, 3, 4.0), (-1, 3, 1.0)],
)
def test_expected_tokens_per_step(a, k, expected):
    assert expected_tokens_per_step(a, k) == pytest.approx(expected)


def test_expected_tokens_per_step_matches_a_simulation():
    """Independent check of the closed form: each draft token accepted i.i.d. with prob a, stop at first rejection."""
    import random

    rng = random.Random(0)
    a, k, steps = 0.7, 4, 100_000
    total = 0
    for _ in range(steps):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        total += n + 1
    assert total / steps == pytest.approx(expected_tokens_per_step(a, k), rel=0.01)


def test_leviathan_speedup():
    assert leviathan_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert leviathan_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx(((1 - 0.8**5) / 0.2) / 1.4)
    # a useless draft that costs something is a slowdown
    assert leviathan_speedup(0.0, 3, 0.2) < 1.0
