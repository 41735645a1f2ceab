"""row_allocation: the jointly chosen draft lengths are the best of every allocation (exhaustive search), find what
one sequence at a time cannot on a non-convex curve, and the scheduler drafts exactly what they say."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.scheduler import BatchEngine
from specdec.engine.single import plain_engine
from specdec.kpolicy import draft_lengths
from specdec.kpolicy.adaptive import AdaptiveK
from specdec.kpolicy.calibration import interpolate_cost
from specdec.kpolicy.row_allocation import Candidate, allocate_rows
from test_engine import PrefixLM

# The engine's own decode-only passes of eight sequences, default pair, 2 threads, 2-vCPU EPYC (ttft_profile.py):
# median seconds by row count. 16 rows run a faster kernel than 9-15.
MEASURED = {8: 0.218, 9: 0.238, 10: 0.251, 11: 0.264, 12: 0.283, 13: 0.292, 14: 0.293, 15: 0.308, 16: 0.275,
            17: 0.349, 24: 0.396, 32: 0.526}


def rate(candidates, ks, base_rows, base_tokens, cost):
    tokens = base_tokens + sum(sum(c.gains[:k]) for c, k in zip(candidates, ks))
    seconds = cost(base_rows + sum(ks)) + sum(c.draft_seconds * k for c, k in zip(candidates, ks))
    return tokens / seconds


def falling(rng, k_max):
    """Survival products of random acceptance rates: what AdaptiveK.position_gains gives."""
    gains, survive = [], 1.0
    for _ in range(k_max):
        survive *= rng.random()
        gains.append(survive)
    return gains


def test_the_allocation_is_the_best_of_all_allocations():
    """Against exhaustive search over every k vector, on random non-convex curves, acceptance and drafting costs."""
    rng = random.Random(7)
    for trial in range(300):
        candidates = [Candidate(falling(rng, rng.randrange(0, 5)), rng.choice([0.0, 0.002, 0.02]))
                      for _ in range(rng.randrange(1, 4))]
        curve = {n: rng.uniform(0.5, 1.5) * (0.03 + 0.02 * n) for n in (1, 2, 3, 4, 6, 8, 12, 16)}
        cost = lambda n: interpolate_cost(curve, n)  # noqa: E731
        base_rows, base_tokens = rng.randrange(1, 8), float(rng.randrange(1, 6))
        ks = allocate_rows(candidates, base_rows, base_tokens, cost)
        assert all(0 <= k <= len(c.gains) for c, k in zip(candidates, ks))
        best = max(rate(candidates, v, base_rows, base_tokens, cost)
                   for v in itertools.product(*(range(len(c.gains) + 1) for c in candidates)))
        assert rate(candidates, ks, base_rows, base_tokens, cost) == pytest.approx(best, rel=1e-12), trial
        assert allocate_rows(candidates, base_rows, base_tokens, curve) == ks  # the curve itself, sorted once


def test_eight_sequences_buy_sixteen_rows_where_one_at_a_time_buys_none():
    """Eight sequences at acceptance 0.5 on the measured curve: together they fill the pass to 16 rows (k = 1
    each, 12 expected tokens in 0.275 s against 8 in 0.218 s); each deciding alone beside the other seven (the
    load-aware AdaptiveK, negative control) sees a ninth row cost 20 ms for half a token and drafts nothing."""
    cost = lambda n: interpolate_cost(MEASURED, n)  # noqa: E731
    candidates = [Candidate([0.5, 0.25, 0.125, 0.0625])] * 8
    assert allocate_rows(candidates, 8, 8.0, cost) == [1] * 8
    alone = AdaptiveK(max_k=4, pass_costs=MEASURED, explore_every=0)
    alone.learn_from_plans()
    alone.doubt = 0.0
    for _ in range(200):
        alone.observe(0, True), alone.observe(0, False), alone.observe(1, True), alone.observe(1, False)
        alone.observe(2, True), alone.observe(2, False), alone.observe(3, True), alone.observe(3, False)
    assert alone.position_gains(4) == pytest.approx([0.5, 0.25, 0.125, 0.0625], abs=0.02)
    alone.other_rows, alone.other_tokens = 7, 7.0
    assert alone.best_k() == 0


def test_no_drafting_where_rows_cost_in_proportion_and_full_drafts_where_they_are_free():
    linear = lambda n: 0.03 * n  # noqa: E731
    flat = lambda n: 0.03 + 0.0001 * n  # noqa: E731
    candidates = [Candidate([0.9, 0.8, 0.7]), Candidate([0.6, 0.3])]
    assert allocate_rows(candidates, 2, 2.0, linear) == [0, 0]
    assert allocate_rows(candidates, 2, 2.0, flat) == [3, 2]
    assert allocate_rows([], 3, 3.0, flat) == []
    assert allocate_rows([Candidate([])], 1, 1.0, flat) == [0]
    # A dear drafter is priced too: the same free rows are not worth a drafting second each.
    assert allocate_rows([Candidate([0.9, 0.8, 0.7], draft_seconds=1.0)], 1, 1.0, flat) == [0]
    with pytest.raises(ValueError):
        allocate_rows([Candidate([-0.1])], 1, 1.0, flat)


class EchoLM(PrefixLM):
    """Greedy continues the prefix with period 3 (prompt lookup finds it), over PrefixLM's pseudo-random logits."""

    def logits(self, prefix):
        row = super().logits(prefix).clone()
        if len(prefix) >= 3:
            row[prefix[-3]] += 20.0
        return row


def test_the_scheduler_drafts_what_the_joint_allocation_chose(monkeypatch):
    """Four copying sequences on a curve where 8 rows cost about what 4 do: every shared decode pass holds the
    rows allocate_rows bought (each draft as long as its k), the policies record those k, and the outputs are
    plain decoding's."""
    target = EchoLM(vocab=12, seed=5, max_context=256)
    target.pass_costs = {1: 1.0, 4: 4.0, 8: 4.2, 16: 12.0}
    spec = SpecConfig(num_speculative_tokens=4, k_policy="adaptive", drafter="prompt_lookup")
    drafter = create_drafter("prompt_lookup", draft_backend=None, spec=spec)
    batch = BatchEngine(target, drafter, spec, max_running=4)
    calls = []
    real = draft_lengths.allocate_rows

    def recording(candidates, base_rows, base_tokens, pass_cost, margin):
        ks = real(candidates, base_rows, base_tokens, pass_cost, margin)
        calls.append((base_rows, ks))
        return ks

    monkeypatch.setattr(draft_lengths, "allocate_rows", recording)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6, 4], [7, 8, 9, 7, 8, 9], [2, 5, 8, 2, 5, 8, 2, 5]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    sequences = [batch.add(p, params, tag=i) for i, p in enumerate(prompts)]
    tags = {s.request_id: s.tag for s in sequences}
    outputs = {i: [] for i in range(4)}
    checked = 0
    while batch.running:
        before = len(calls)
        decoding = sum(not s.prefilling for s in batch.running)
        prefilling = any(s.prefilling for s in batch.running)
        for output in batch.step():
            outputs[tags[output.request_id]] += output.tokens
        if len(calls) > before and not prefilling and decoding == 4:
            base_rows, ks = calls[-1]
            assert batch.last_pass_rows == base_rows + sum(ks)
            checked += 1
    assert checked >= 3 and any(sum(ks) > 0 for _, ks in calls)
    assert all(base + sum(ks) == 8 for base, ks in calls if base == 4)  # 8 rows cost about what 4 do
    history = [k for s in sequences for policy in s.policies.values() for k in policy.history]
    assert sum(history) > 0
    for i, prompt in enumerate(prompts):
        assert outputs[i] == plain_engine(target).generate(prompt, params).tokens


def test_a_margin_buys_rows_only_where_the_best_allocation_beats_the_pass_by_it():
    """With margin m the allocation is the best one when that beats the pass without drafts by the factor 1 + m, and
    no drafting otherwise; both sides occur in these trials."""
    rng = random.Random(11)
    sides = set()
    for trial in range(300):
        candidates = [Candidate(falling(rng, rng.randrange(1, 5)), rng.choice([0.0, 0.002]))
                      for _ in range(rng.randrange(1, 4))]
        curve = {n: rng.uniform(0.8, 1.2) * (0.06 + 0.01 * n) for n in (1, 2, 3, 4, 6, 8, 12, 16)}
        cost = lambda n: interpolate_cost(curve, n)  # noqa: E731
        base_rows, base_tokens = rng.randrange(1, 4), float(rng.randrange(1, 4))
        best = max(rate(candidates, v, base_rows, base_tokens, cost)
                   for v in itertools.product(*(range(len(c.gains) + 1) for c in candidates)))
        plain = base_tokens / cost(base_rows)
        ks = allocate_rows(candidates, base_rows, base_tokens, cost, margin=0.1)
        if best > plain * 1.1 * (1 + 1e-9):
            assert rate(candidates, ks, base_rows, base_tokens, cost) == pytest.approx(best, rel=1e-12), trial
            sides.add("drafts")
        elif best < plain * 1.1 * (1 - 1e-9):
            assert ks == [0] * len(candidates), trial
            sides.add("plain")
            if best > plain * (1 + 1e-9):
                sides.add("plain although drafting gains")
                assert sum(allocate_rows(candidates, base_rows, base_tokens, cost)) > 0, trial
    assert sides == {"drafts", "plain", "plain although drafting gains"}
