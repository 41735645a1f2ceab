"""The measured pass-cost curve: measuring it leaves the cache as it was, interpolation, and the adaptive policy reading it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.backends.base import ModelBackend
from specdec.kpolicy.adaptive import AdaptiveK
from specdec.kpolicy.calibration import (
    cached_pass_costs,
    cost_table,
    interpolate_cost,
    machine_ceiling,
    marginal_row_costs,
    measure_pass_costs,
)


def test_measure_pass_costs_times_each_size_and_restores_the_cache(target_backend):
    cache = target_backend.new_cache(128)
    costs = measure_pass_costs(target_backend, sizes=(1, 2, 4), context_tokens=16, repeats=2, warmup=1, cache=cache)
    assert sorted(costs) == [1, 2, 4] and all(c > 0 for c in costs.values())
    assert cache.length == 0


def test_measure_pass_costs_stops_at_the_cache_capacity(target_backend):
    cache = target_backend.new_cache(40)
    costs = measure_pass_costs(target_backend, sizes=(1, 8, 32), context_tokens=16, repeats=1, warmup=0, cache=cache)
    assert sorted(costs) == [1, 8]  # 16 + 32 rows do not fit in 40


class _ClockedBackend(ModelBackend):
    """A backend whose pass of n rows takes n + 1 ticks of a fake clock, 1.5x as long during a slow spell of
    consecutive passes (a shared VM's neighbour busy for a while)."""

    vocab_size = 100
    max_context = 1024

    def __init__(self, slow_calls: range):
        self.now, self.calls, self.slow_calls = 0.0, 0, slow_calls

    def new_cache(self, capacity):
        class Cache:
            length = 0

            def trim(self, n):
                n = max(0, min(n, self.length))
                self.length -= n
                return n

        cache = Cache()
        cache.capacity = capacity
        return cache

    def forward(self, ids, cache, num_logits=1):
        self.calls += 1
        self.now += (len(ids) + 1) * (1.5 if self.calls in self.slow_calls else 1.0)
        cache.length += len(ids)
        return torch.zeros(num_logits, self.vocab_size)


def test_a_slow_spell_does_not_bend_the_measured_curve(monkeypatch):
    """Rounds over every size: a spell of slow passes as long as one size's repeats moves no size's median. The
    negative control measures size by size, as before rounds, and the spell bends the curve there."""
    import specdec.kpolicy.calibration as calibration

    sizes = (1, 2, 3, 4)
    truth = {size: size + 1.0 for size in sizes}
    # calls: 1 prefix pass, then warm-up and timed passes; the spell covers 7 consecutive passes from the 10th
    backend = _ClockedBackend(slow_calls=range(10, 17))
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: backend.now))
    curve = measure_pass_costs(backend, sizes=sizes, context_tokens=8, repeats=5, warmup=2)
    assert curve == truth

    def size_by_size(backend, sizes, context_tokens, repeats, warmup):
        cache = backend.new_cache(64)
        backend.forward(list(range(context_tokens)), cache)
        costs = {}
        for size in sizes:
            times = []
            for attempt in range(warmup + repeats):
                began = calibration.time.perf_counter()
                backend.forward(list(range(size)), cache, num_logits=size)
                if attempt >= warmup:
                    times.append(calibration.time.perf_counter() - began)
                cache.trim(size)
            costs[size] = calibration.statistics.median(times)
        return costs

    control = _ClockedBackend(slow_calls=range(10, 17))
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=lambda: control.now))
    assert size_by_size(control, sizes, 8, 5, 2) != truth


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


def _interpolated(curve, size):
    """An independent statement of the rule: flat below the first size, straight between measured sizes, along the
    last two points' slope beyond the last (never below its cost)."""
    points = sorted(curve.items())
    if size <= points[0][0]:
        return points[0][1]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s0 <= size <= s1:
            return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
    if len(points) == 1:
        return points[-1][1]
    (s0, t0), (s1, t1) = points[-2], points[-1]
    return max(t1, t1 + (t1 - t0) / (s1 - s0) * (size - s1))


def test_cost_table_is_interpolate_cost_at_every_size():
    import random

    rng = random.Random(0)
    curves = [{1: 1.0}, {1: 1.0, 8: 0.5}, {1: 1.0, 4: 1.6, 8: 3.2},
              {1: 33.9, 2: 57.2, 3: 76.1, 4: 92.1, 5: 117.7, 8: 237.1, 9: 238.7, 16: 264.5, 17: 303.1, 32: 437.0}]
    for _ in range(30):
        sizes = rng.sample(range(1, 70), rng.randrange(2, 12))
        curves.append({s: rng.uniform(0.1, 5.0) for s in sizes})
    for curve in curves:
        ascending = list(range(0, 80))
        shuffled = ascending[:]
        rng.shuffle(shuffled)
        for sizes in (ascending, shuffled, [5, 3, 9, 2, 40]):
            assert cost_table(curve, sizes) == [interpolate_cost(curve, s) for s in sizes]
            assert cost_table(curve, sizes) == pytest.approx([_interpolated(curve, s) for s in sizes], rel=1e-12)
    with pytest.raises(ValueError):
        cost_table({}, [1])


def test_rates_table_equals_pricing_each_k_on_its_own():
    """The policy's one-pass rate table (one level, one sorted curve) gives what verify_cost gives k by k: alone
    with measured sizes, on the curve, and beside other rows on the shared curve."""
    curve = {1: 0.0339, 2: 0.0572, 3: 0.0761, 4: 0.0921, 8: 0.2371, 16: 0.2645, 32: 0.437, 33: 0.4837}
    for other_rows, measured in ((0, {}), (0, {1: 0.036, 3: 0.08}), (7, {1: 0.036}), (12, {2: 0.06})):
        policy = AdaptiveK(max_k=32, pass_costs=curve)
        for size, seconds in measured.items():
            for _ in range(3):
                policy.update(size - 1, size - 1, 1e-4 * (size - 1), seconds)
        policy.other_rows, policy.other_tokens = other_rows, float(other_rows)
        if other_rows:
            policy.shared_pass_costs = {other_rows + 1: SimpleNamespace(value=0.25, count=3)}
        rates = policy.acceptance_per_pos()
        level = policy._curve_level()
        shared = policy.other_tokens if other_rows else 0.0
        want = []
        for k in range(policy.max_k + 1):
            cost = k * policy.draft_cost + policy.verify_cost(k + 1, level)
            want.append((shared + policy.expected_tokens(k, rates)) / cost)
        assert policy._rates() == pytest.approx(want, rel=1e-12)
    no_curve = AdaptiveK(max_k=8)
    no_curve.update(0, 0, 0.0, 0.03)
    no_curve.update(3, 2, 3e-4, 0.05)
    assert no_curve._rates() == pytest.approx(
        [(no_curve.expected_tokens(k)) / (k * no_curve.draft_cost + no_curve.verify_cost(k + 1)) for k in range(9)])


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


def test_default_k_32_for_copying_drafters_16_on_cuda_else_5():
    import argparse

    from specdec.cli.flags import default_k, spec_from_args

    def args(**kw):
        base = dict(k=None, k_policy="adaptive", device="cpu", backend="auto", drafter=None, draft_p_min=0.0)
        return argparse.Namespace(**{**base, **kw})

    assert default_k(args()) == 5
    assert default_k(args(device="cuda")) == 16
    assert default_k(args(device="cuda", k_policy="fixed")) == 5
    assert default_k(args(), "suffix") == 32 and default_k(args(), "prompt_lookup") == 32
    assert default_k(args(), "draft_model") == 5 and default_k(args(), "hybrid") == 5
    assert default_k(args(k_policy="fixed"), "suffix") == 5
    assert spec_from_args(args(), has_draft_model=False).num_speculative_tokens == 32  # no flags: suffix drafter
    assert spec_from_args(args(), has_draft_model=True).num_speculative_tokens == 5  # draft model on a CPU
    assert spec_from_args(args(device="cuda", k=3), has_draft_model=True).num_speculative_tokens == 3  # given: kept


def test_machine_ceiling_on_measured_curves():
    """What a drafter whose every token is accepted buys: (k + 1) / cost(k + 1) in one-row passes, best k."""
    epyc = {1: 35.8, 2: 59.8, 3: 77.1, 4: 98.8, 8: 228.0}  # ms, llama.cpp 1.5B Q4_K_M, 2 threads (docs/llamacpp.md)
    speedup, k = machine_ceiling(epyc, max_k=7)
    assert k == 3 and speedup == pytest.approx(4 * 35.8 / 98.8)  # 4 rows are the best buy there: 1.45x
    gpu = {1: 5.0, 2: 5.1, 4: 5.1, 8: 5.2, 16: 5.3}
    assert machine_ceiling(gpu, max_k=7) == (pytest.approx(8 * 5.0 / 5.2), 7)  # rows nearly free: the longest k
    line = {s: float(s) for s in (1, 2, 4, 8)}  # each row costs a pass: drafting cannot pay
    assert machine_ceiling(line, max_k=7) == (1.0, 0)
    with_draft = machine_ceiling(gpu, max_k=7, draft_cost_ratio=0.3)[0]
    assert with_draft == pytest.approx(8 * 5.0 / (5.2 + 7 * 0.3 * 5.0))  # drafting time counts


def test_cached_pass_costs_measure_once_per_key(tmp_path, monkeypatch):
    from specdec.kpolicy import calibration

    monkeypatch.setattr(calibration, "_cache_file", lambda: tmp_path / "pass-costs.json")
    calls = []

    class Backend:
        key = "cpu A | lib | model | 2 threads"

        def calibration_key(self):
            return self.key

    def measure(sizes):
        calls.append(tuple(sizes))
        return {s: 0.01 * s for s in sizes}

    backend = Backend()
    assert cached_pass_costs(backend, (1, 2, 4), measure) == {1: 0.01, 2: 0.02, 4: 0.04}
    assert cached_pass_costs(backend, (1, 2), measure) == {1: 0.01, 2: 0.02}  # from the file
    assert calls == [(1, 2, 4)]
    cached_pass_costs(backend, (1, 8), measure)  # a size the file lacks: measured again
    backend.key = "cpu A | lib | model | 1 threads"  # another thread count: another curve
    cached_pass_costs(backend, (1, 2), measure)
    assert calls == [(1, 2, 4), (1, 8), (1, 2)]
    (tmp_path / "pass-costs.json").write_text("{not json")  # a corrupt file costs only a new measurement
    assert cached_pass_costs(backend, (1,), measure) == {1: 0.01}


def test_an_adaptive_llamacpp_engine_calibrates_once_and_reads_the_file(tmp_path, monkeypatch):
    from specdec.backends.llamacpp.backend import LlamaCppBackend
    from specdec.config import SamplingParams, SpecConfig
    from specdec.drafters import create_drafter
    from specdec.engine.single import SpeculativeEngine
    from specdec.kpolicy import calibration
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setattr(calibration, "_cache_file", lambda: tmp_path / "pass-costs.json")
    gguf = write_tiny_gguf(tmp_path / "target.gguf", seed=0, layers=2)
    spec = SpecConfig(4, drafter="prompt_lookup", k_policy="adaptive")
    for run in range(2):
        backend = LlamaCppBackend(gguf, max_context=512, threads=1)
        assert backend.calibrate_on_first_use and backend.pass_costs is None
        engine = SpeculativeEngine(backend, create_drafter("prompt_lookup", spec=spec), spec)
        engine.generate([1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        assert sorted(backend.pass_costs) == [1, 2, 3, 4, 5]
        if run == 0:
            first = dict(backend.pass_costs)
    assert backend.pass_costs == first  # the second backend read the curve the first one measured


def test_forget_pass_costs_drops_only_that_backends_curve(tmp_path, monkeypatch):
    from specdec.kpolicy import calibration

    monkeypatch.setattr(calibration, "_cache_file", lambda: tmp_path / "pass-costs.json")

    class Backend:
        def __init__(self, key):
            self.key = key

        def calibration_key(self):
            return self.key

    busy, other = Backend("busy"), Backend("other")
    for backend in (busy, other):
        cached_pass_costs(backend, (1, 2), lambda sizes: {s: 0.1 * s for s in sizes})
    calibration.forget_pass_costs(busy)
    calls = []
    cached_pass_costs(busy, (1,), lambda sizes: calls.append(sizes) or {1: 0.03})
    cached_pass_costs(other, (1,), lambda sizes: calls.append(sizes) or {1: 0.03})
    assert calls == [(1,)]  # the forgotten one is measured again, the other still read from the file


def test_a_curve_cached_by_an_earlier_way_of_measuring_is_measured_again(tmp_path, monkeypatch):
    """Curves stored before sizes were measured in rounds (key without MEASUREMENT_VERSION) are not read."""
    import json

    from specdec.kpolicy import calibration

    monkeypatch.setattr(calibration, "_cache_file", lambda: tmp_path / "pass-costs.json")
    (tmp_path / "pass-costs.json").write_text(json.dumps({"cpu A": {"1": 9.0, "2": 9.0}}))

    class Backend:
        def calibration_key(self):
            return "cpu A"

    assert cached_pass_costs(Backend(), (1, 2), lambda sizes: {s: 0.1 * s for s in sizes}) == {1: 0.1, 2: 0.2}
