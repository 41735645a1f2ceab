"""The measured pass-cost curve: measuring it leaves the cache as it was, interpolation, and the adaptive policy reading it."""

from __future__ import annotations

import pytest

from specdec.adaptive import AdaptiveK
from specdec.calibration import interpolate_cost, marginal_row_costs, measure_pass_costs


def test_measure_pass_costs_times_each_size_and_restores_the_cache(target_backend):
    cache = target_backend.new_cache(128)
    costs = measure_pass_costs(target_backend, sizes=(1, 2, 4), context_tokens=16, repeats=2, warmup=1, cache=cache)
    assert sorted(costs) == [1, 2, 4] and all(c > 0 for c in costs.values())
    assert cache.length == 0


def test_measure_pass_costs_stops_at_the_cache_capacity(target_backend):
    cache = target_backend.new_cache(40)
    costs = measure_pass_costs(target_backend, sizes=(1, 8, 32), context_tokens=16, repeats=1, warmup=0, cache=cache)
    assert sorted(costs) == [1, 8]  # 16 + 32 rows do not fit in 40


def test_interpolation_between_below_and_beyond_the_measured_sizes():
    curve = {1: 1.0, 4: 1.6, 8: 3.2}
    assert interpolate_cost(curve, 1) == 1.0
    assert interpolate_cost(curve, 2) == pytest.approx(1.2)
    assert interpolate_cost(curve, 6) == pytest.approx(2.4)
    assert interpolate_cost(curve, 12) == pytest.approx(4.8)  # the last segment's slope
    assert interpolate_cost({1: 1.0, 8: 0.5}, 20) == 0.5  # never cheaper than the largest measured
    assert marginal_row_costs(curve)[8] == pytest.approx(3.2)
    with pytest.raises(ValueError):
        interpolate_cost({}, 3)


def _feed_perfect_drafts(policy, curve, steps=40, draft_cost=1e-4):
    for _ in range(steps):
        k = policy.next_k()
        policy.update(k, k, draft_cost * k, interpolate_cost(curve, k + 1))


def test_adaptive_policy_reads_the_curve_to_draft_long_where_rows_are_free():
    """A GPU-like curve (64 rows cost 1.2 passes): with drafts accepted, the policy goes to its maximum k."""
    gpu = {1: 0.010, 2: 0.0102, 4: 0.0104, 8: 0.0106, 16: 0.011, 32: 0.0115, 64: 0.012}
    policy = AdaptiveK(max_k=32, pass_costs=gpu)
    _feed_perfect_drafts(policy, gpu)
    assert policy.best_k() == 32


def test_adaptive_policy_reads_the_curve_to_stop_where_rows_cost_a_pass_each():
    """A compute-bound curve (each row costs a pass): even perfect drafts do not pay, so k stays 0."""
    cpu = {size: 0.05 * size for size in (1, 2, 4, 8, 16, 32)}
    policy = AdaptiveK(max_k=16, pass_costs=cpu)
    _feed_perfect_drafts(policy, cpu, draft_cost=0.005)
    assert policy.best_k() == 0 and not policy.drafting_could_pay()


def test_negative_control_without_the_curve_a_line_through_two_sizes_misjudges():
    """The kinked curve of a bucketed GPU pass: 9 rows cost double 8 rows. A line through sizes 1 and 5
    cannot see the kink; the measured curve can, and the policy then stops at 7 drafted tokens."""
    kinked = {1: 0.010, 2: 0.010, 4: 0.010, 5: 0.010, 8: 0.010, 9: 0.020, 16: 0.020}
    with_curve = AdaptiveK(max_k=8, pass_costs=kinked)
    _feed_perfect_drafts(with_curve, kinked, draft_cost=1e-3)
    assert with_curve.best_k() == 7
    blind = AdaptiveK(max_k=8)
    blind.update(0, 0, 0.0, 0.010)
    blind.update(4, 4, 4e-3, 0.010)
    assert blind.best_k() == 8


def test_default_k_is_16_for_the_adaptive_policy_on_cuda_only():
    import argparse

    from specdec.cli_common import default_k, spec_from_args

    def args(**kw):
        base = dict(k=None, k_policy="adaptive", device="cpu", backend="auto", drafter=None, draft_p_min=0.0)
        return argparse.Namespace(**{**base, **kw})

    assert default_k(args()) == 5
    assert default_k(args(device="cuda")) == 16
    assert default_k(args(device="cuda", k_policy="fixed")) == 5
    assert spec_from_args(args(device="cuda", k=3), has_draft_model=True).num_speculative_tokens == 3  # given: kept
