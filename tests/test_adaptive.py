"""AdaptiveK: the cost model picks the k that maximises expected tokens per second, and follows shifts; greedy output never depends on it."""

from __future__ import annotations

import math
import random

import pytest

from markov_backend import one_torch_thread  # noqa: F401
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.core.stats import expected_tokens_per_step
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine
from specdec.kpolicy.adaptive import AdaptiveK
from specdec.kpolicy.factory import make_policy

FLAT = lambda size: 1.0


def simulate(policy, steps, acceptance, draft_cost, verify_cost=FLAT, seed=0):
    """Feed the policy synthetic steps: position i of a draft is accepted with acceptance(i) (or a constant)."""
    rng = random.Random(seed)
    ks = []
    for _ in range(steps):
        k = policy.next_k()
        assert 0 <= k <= policy.max_k
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < (acceptance(accepted) if callable(acceptance) else acceptance):
            accepted += 1
        policy.update(k, accepted, k * draft_cost, verify_cost(k + 1))
    return ks


def typical(ks):
    """The most common k (exploration steps are the minority)."""
    return max(set(ks), key=ks.count)


def test_make_policy_builds_adaptive_with_max_k():
    policy = make_policy("adaptive", 7)
    assert isinstance(policy, AdaptiveK)
    assert policy.max_k == 7
    assert policy.next_k() == 4  # the prior before anything is measured
    assert AdaptiveK(2).next_k() == 2


def test_expected_tokens_matches_leviathan_for_a_constant_rate():
    policy = AdaptiveK(8)
    for a in (0.0, 0.3, 0.8, 1.0):
        for k in range(9):
            assert policy.expected_tokens(k, [a] * 8) == pytest.approx(expected_tokens_per_step(a, k))
    # Per-position product: 1 + a0 + a0*a1.
    assert policy.expected_tokens(2, [0.5, 0.2] + [0.0] * 6) == pytest.approx(1 + 0.5 + 0.5 * 0.2)


def test_per_position_acceptance_is_conditional_on_being_reached():
    policy = AdaptiveK(4, decay=1.0, shrink=0.0)
    policy.update(4, 2, 0.4, 1.0)  # positions 0, 1 accepted, 2 rejected, 3 never looked at
    policy.update(4, 4, 0.4, 1.0)
    rates = policy.acceptance_per_pos()
    assert rates[:3] == pytest.approx([1.0, 1.0, 0.5])
    assert rates[3] == pytest.approx(1.0)  # reached once (second step), accepted once
    assert policy.acceptance_rate == pytest.approx(6 / 7)  # 3 looked at + 4 looked at; 6 accepted
    assert policy.draft_cost == pytest.approx(0.1)


def test_best_k_is_the_argmax_of_the_formula_written_out(monkeypatch):
    """The one-pass rate sweep (linear in max_k) against rate(k) = E[tokens | k] / (k c + v(k + 1)) computed
    independently for each k, on a measured curve, on fitted costs and in a shared pass."""
    rng = random.Random(3)
    curve = {1: 0.035, 2: 0.055, 3: 0.076, 4: 0.092, 6: 0.135, 8: 0.221, 9: 0.233, 16: 0.264, 17: 0.291,
             32: 0.443, 33: 0.462}
    for trial in range(30):
        policy = AdaptiveK(32, pass_costs=curve if trial % 3 else None)
        if trial % 3 == 2:
            policy.other_rows, policy.other_tokens = 3, 3.0
        for _ in range(40):
            k = rng.randrange(0, 33)
            policy.update(k, rng.randrange(0, k + 1), k * 1e-4, curve.get(k + 1, 0.03 * (k + 1)))
        rates = policy.acceptance_per_pos()

        def written_out(k):
            expected = 1 + sum(math.prod(rates[:j + 1]) for j in range(k))
            shared = policy.other_tokens if policy.other_rows > 0 and policy.pass_costs else 0.0
            return (shared + expected) / (k * policy.draft_cost + policy.verify_cost(k + 1))

        reference = [written_out(k) for k in range(33)]
        assert [policy.expected_rate(k) for k in range(33)] == pytest.approx(reference, rel=1e-9)
        best = max(range(33), key=lambda k: (reference[k], -k))
        assert reference[policy.best_k()] == pytest.approx(reference[best], rel=1e-9)


def test_high_acceptance_and_cheap_draft_picks_max_k():
    policy = AdaptiveK(8)
    ks = simulate(policy, 150, acceptance=0.9, draft_cost=0.01)
    assert typical(ks[-50:]) == 8


def test_free_drafts_pick_max_k_even_at_moderate_acceptance():
    # Prompt lookup costs ~nothing, so with a flat verify cost every extra token is a free lottery ticket.
    ks = simulate(AdaptiveK(6), 150, acceptance=0.5, draft_cost=0.0)
    assert typical(ks[-50:]) == 6


def test_low_acceptance_or_expensive_draft_turns_speculation_off():
    ks = simulate(AdaptiveK(8), 150, acceptance=0.2, draft_cost=0.5)
    assert typical(ks[-50:]) == 0
    ks = simulate(AdaptiveK(8), 150, acceptance=0.0, draft_cost=0.01)
    assert typical(ks[-50:]) == 0
    # A drafter as slow as the target cannot pay for itself even at 80% acceptance.
    ks = simulate(AdaptiveK(8), 150, acceptance=0.8, draft_cost=1.0)
    assert typical(ks[-50:]) == 0


def test_middling_acceptance_with_costly_draft_picks_a_short_draft():
    # a=0.6, c=0.3: rate(1)=1.23, rate(2)=1.225, rate(3)=1.15, rate(0)=1: the optimum is k in {1, 2}.
    ks = simulate(AdaptiveK(8), 200, acceptance=0.6, draft_cost=0.3)
    assert typical(ks[-60:]) in (1, 2)
    assert sum(ks[-60:]) / 60 < 2.5


def test_measured_verify_curve_shortens_drafts_when_verification_is_compute_bound():
    flat = simulate(AdaptiveK(8), 200, acceptance=0.8, draft_cost=0.02, seed=3)
    steep = simulate(AdaptiveK(8), 200, acceptance=0.8, draft_cost=0.02, verify_cost=lambda s: 0.5 + 0.25 * s, seed=3)
    assert typical(flat[-60:]) >= 7
    assert typical(steep[-60:]) <= 3
    assert sum(steep[-60:]) < sum(flat[-60:])


def test_verify_cost_fit_for_unseen_sizes():
    policy = AdaptiveK(8)
    assert policy.verify_cost(3) == 1.0  # nothing measured: neutral
    policy.update(2, 0, 0.01, 0.30)  # size 3
    assert policy.verify_cost(3) == pytest.approx(0.30)
    assert policy.verify_cost(8) == pytest.approx(0.30)  # one size known: flat
    policy.update(4, 0, 0.01, 0.50)  # size 5
    assert policy.verify_cost(4) == pytest.approx(0.40)  # interpolated on the line
    assert policy.verify_cost(9) == pytest.approx(0.90)  # extrapolated on the line
    assert policy.verify_cost(1) == pytest.approx(0.30)  # never cheaper than the smallest measured size
    policy.update(0, 0, 0.0, 0.25)  # a plain step measures size 1
    assert policy.verify_cost(1) == pytest.approx(0.25)


def test_per_position_rates_find_a_drafter_that_is_only_good_for_one_token():
    # Position 0 is accepted 90% of the time, later positions never: k=1 is optimal
    # (rate(1) = 1.9/1.1 = 1.73 > rate(2) = 1.9/1.2 = 1.58 > rate(0) = 1).
    policy = AdaptiveK(8)
    ks = simulate(policy, 200, acceptance=lambda i: 0.9 if i == 0 else 0.0, draft_cost=0.1)
    assert typical(ks[-60:]) == 1
    rates = policy.acceptance_per_pos()
    assert rates[0] > 0.75 and rates[1] < 0.2


def test_adapts_when_acceptance_shifts_down_and_back_up():
    policy = AdaptiveK(8)
    high = simulate(policy, 60, acceptance=0.95, draft_cost=0.3, seed=1)
    low = simulate(policy, 80, acceptance=0.05, draft_cost=0.3, seed=2)
    back = simulate(policy, 100, acceptance=0.95, draft_cost=0.3, seed=3)
    assert typical(high[-20:]) >= 5
    assert typical(low[-30:]) == 0
    assert 1 in low[-30:]  # still exploring while speculation is off, so it can notice recovery
    assert typical(back[-30:]) >= 5


def test_explores_neighbours_of_the_best_k():
    ks = simulate(AdaptiveK(8, explore_every=4), 80, acceptance=0.9, draft_cost=0.01)
    assert 7 in ks[-40:]  # the best is 8; every 4th step tries 7 (8 + 1 is out of range)
    no_explore = simulate(AdaptiveK(8, explore_every=0), 80, acceptance=0.9, draft_cost=0.01)
    assert set(no_explore[-40:]) == {8}


def test_decisions_are_a_pure_function_of_the_updates():
    a = simulate(AdaptiveK(6), 100, acceptance=0.7, draft_cost=0.1, seed=9)
    b = simulate(AdaptiveK(6), 100, acceptance=0.7, draft_cost=0.1, seed=9)
    assert a == b


def test_empty_drafts_only_update_the_verify_cost():
    policy = AdaptiveK(4)
    policy.update(0, 0, 0.001, 0.2)  # e.g. prompt lookup found nothing
    assert policy.acceptance_rate == policy.prior_acceptance
    assert policy.verify_cost(1) == pytest.approx(0.2)
    assert policy.next_k() == 4  # nothing known about drafting yet: keep the prior


def test_max_k_zero_never_drafts():
    policy = AdaptiveK(0)
    assert simulate(policy, 20, acceptance=1.0, draft_cost=0.0) == [0] * 20


@pytest.fixture()
def self_draft_backend(target_model):
    # The target as its own draft: every draft token is accepted under greedy, so k matters.
    return TransformersBackend(target_model, name="self-draft", max_context=256)


def test_adaptive_policy_in_the_engine_keeps_greedy_output(target_backend, draft_backend, self_draft_backend):
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = plain_engine(target_backend).generate(prompt, params).tokens
    for name, draft in (("draft_model", draft_backend), ("draft_model", self_draft_backend), ("prompt_lookup", None)):
        spec = SpecConfig(num_speculative_tokens=6, drafter=name, k_policy="adaptive")
        engine = SpeculativeEngine(target_backend, create_drafter(name, draft_backend=draft, spec=spec), spec)
        result = engine.generate(prompt, params)
        assert result.tokens == expected, name
        assert result.stats.num_generated_tokens == len(expected)


def test_adaptive_policy_learns_from_the_engine(target_backend, self_draft_backend, monkeypatch):
    import specdec.engine.scheduler as engine_module  # the step code lives there

    policies = []

    def recording_make_policy(name, k, pass_costs=None):
        policy = make_policy(name, k, pass_costs)
        policies.append(policy)
        return policy

    monkeypatch.setattr(engine_module, "make_policy", recording_make_policy)
    spec = SpecConfig(num_speculative_tokens=4, drafter="draft_model", k_policy="adaptive")
    engine = SpeculativeEngine(target_backend, create_drafter("draft_model", draft_backend=self_draft_backend, spec=spec), spec)
    result = engine.generate([10, 20, 30], SamplingParams(max_tokens=24, ignore_eos=True))
    (policy,) = policies
    assert len(policy.history) == result.stats.num_target_forwards  # one decision per step
    assert policy.history[0] == 4  # the prior
    if result.stats.num_drafts:
        assert result.stats.acceptance_rate == 1.0
        assert policy.acceptance_rate > 0.9  # learned from the engine's feedback
        assert policy.draft_cost > 0
    assert policy.verify_cost(1) > 0


def test_explorations_back_off_while_drafting_does_not_pay():
    # Each extra verified row costs 0.6 of a plain step (a compute-bound CPU) and drafts are mostly wrong:
    # k = 0 wins (though perfect drafts would pay), and each exploration that confirms it doubles the wait.
    def verify(size):
        return 1.0 + 0.6 * (size - 1)

    policy = AdaptiveK(4, explore_every=4, max_explore_every=32)
    ks = simulate(policy, 300, acceptance=0.3, draft_cost=0.05, verify_cost=verify)
    assert policy.drafting_could_pay()
    assert typical(ks[20:]) == 0
    explored = [i for i, k in enumerate(ks) if k > 0 and i > 2]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[-1] > gaps[0] and max(gaps) <= 32 + 1
    # Control: the same policy without back-off keeps exploring every 4 steps.
    flat = AdaptiveK(4, explore_every=4, max_explore_every=4)
    flat_ks = simulate(flat, 300, acceptance=0.3, draft_cost=0.05, verify_cost=verify)
    assert sum(k > 0 for k in flat_ks) > 2 * sum(k > 0 for k in ks)


def test_no_exploration_when_even_perfect_acceptance_could_not_pay():
    # Each extra verified row costs a whole plain step and drafting costs half of one: no draft can win.
    policy = AdaptiveK(4, explore_every=4)
    ks = simulate(policy, 200, acceptance=1.0, draft_cost=0.5, verify_cost=lambda size: float(size))
    assert not policy.drafting_could_pay()
    assert all(k == 0 for k in ks[40:])
    # Negative control: cheap drafting at the same verify costs could pay, so k = 0 is still explored.
    cheap = AdaptiveK(4, explore_every=4)
    cheap_ks = simulate(cheap, 200, acceptance=0.1, draft_cost=0.0, verify_cost=lambda size: 1.0 + 0.5 * (size - 1))
    assert cheap.drafting_could_pay() and any(k > 0 for k in cheap_ks[40:])


def test_each_draft_source_gets_its_own_adaptive_policy(target_backend, draft_backend):
    # A copied 3-gram and a draft model are accepted at different rates and cost different amounts, so the
    # hybrid's two sources learn separate k; the output is still plain decoding's.
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = plain_engine(target_backend).generate(prompt, params).tokens
    spec = SpecConfig(num_speculative_tokens=4, drafter="hybrid", k_policy="adaptive")
    engine = SpeculativeEngine(target_backend, create_drafter("hybrid", draft_backend=draft_backend, spec=spec), spec)
    result = engine.generate(prompt, params)
    assert result.tokens == expected
    sources = set(engine.adaptive_policies)
    assert "model" in sources and any(s.startswith("ngram") for s in sources), sources
    assert sum(len(p.history) for p in engine.adaptive_policies.values()) == result.stats.num_target_forwards


def test_prompt_lookup_names_its_source_by_match_length():
    drafter = create_drafter("prompt_lookup", spec=SpecConfig(drafter="prompt_lookup", lookup_min_ngram=2))
    drafter.begin([1, 2, 3, 4])
    assert drafter.next_source([1, 2, 3, 4]) is None  # nothing repeats: the engine takes a plain step
    assert drafter.next_source([1, 2, 3, 4, 9, 2, 3]) == "ngram2"
    assert drafter.next_source([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]) == "ngram3"
    assert drafter.propose([1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3], 2).tokens == [4, 9]


def test_catch_up_is_charged_only_to_explorations_from_k0():
    def verify(size):
        return 1.0 + 0.6 * (size - 1)

    # The prior draft's catch-up (a draft model reading the prompt) is a one-off: not a per-token cost.
    policy = AdaptiveK(4, explore_every=2)
    k = policy.next_k()
    policy.update(k, k, 0.05 * k, verify(k + 1), catchup_seconds=50.0)
    assert policy.draft_cost == pytest.approx(0.05)
    # Drive it to k = 0 with rejections, then let it explore: that exploration pays for its catch-up.
    for _ in range(40):
        k = policy.next_k()
        explored = policy._explored_from == 0
        policy.update(k, 0, 0.05 * k, verify(k + 1), catchup_seconds=50.0 if k else 0.0)
        if explored and k > 0:
            break
    else:
        pytest.fail("the policy never explored from k = 0")
    assert policy.draft_cost > 1.0 and not policy.drafting_could_pay()
    assert all(policy.next_k() == 0 for _ in range(200))


def test_a_new_request_restarts_exploration_and_halves_old_acceptance():
    """After many requests where drafts were rejected (k = 0 best, exploration backed off to 128 steps), a new
    request explores drafting again within explore_every steps; without begin_request it would not (control)."""
    def trained():
        policy = AdaptiveK(max_k=4, explore_every=8, max_explore_every=128,
                           pass_costs={1: 0.03, 2: 0.045, 3: 0.06, 4: 0.075, 5: 0.09})
        for _ in range(600):  # drafts always rejected: k = 0 wins and exploration backs off
            k = policy.next_k()
            policy.update(k, 0, 1e-5 * k, 0.03 + 0.015 * k)
        return policy

    def explores_within(policy, steps):
        for _ in range(steps):
            k = policy.next_k()
            policy.update(k, 0, 1e-5 * k, 0.03 + 0.015 * k)
            if k > 0:
                return True
        return False

    control = trained()
    assert control.best_k() == 0 and control._explore_wait > 32
    assert not explores_within(control, 30)
    policy = trained()
    before = sum(policy._reached)
    policy.begin_request()
    assert sum(policy._reached) == pytest.approx(before / 2)
    assert explores_within(policy, 9)


def test_a_plan_learner_drafts_only_for_a_gain_above_its_margin():
    """A draft that promises 1.05x plain decoding is taken without a margin and not with the plans' 10% margin; one
    that promises more than 1.1x is taken with it."""
    from specdec.kpolicy import adaptive

    def policy_at(acceptance_runs):
        policy = AdaptiveK(1, pass_costs={1: 1.0, 2: 1.5})
        policy.learn_from_plans()
        policy.update(0, 0, 0.0, 1.0)  # a plain step measured: the curve's level
        for accepted in acceptance_runs:
            policy.observe(0, accepted)
        return policy

    modest = policy_at([True, True, True, False, False] * 8)  # ~0.6 accepted: (1 + a) / 1.5 ~ 1.05
    gain = modest.expected_rate(1) / modest.expected_rate(0)
    assert 1.0 < gain < 1.0 + adaptive.PLAN_MARGIN and modest.margin == adaptive.PLAN_MARGIN
    assert modest.best_k() == 0
    modest.margin = 0.0
    assert modest.best_k() == 1
    sure = policy_at([True, True, True, True, False] * 8)  # ~0.8: ~1.19x
    assert sure.expected_rate(1) / sure.expected_rate(0) > 1.0 + adaptive.PLAN_MARGIN
    assert sure.best_k() == 1
