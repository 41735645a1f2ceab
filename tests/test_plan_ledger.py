"""Plans scored against what followed: the ledger's evidence equals the prefix matches computed directly, a plan-learning policy never drafts to explore, and the engine's output does not change."""

from __future__ import annotations

import random

import pytest

from markov_backend import one_torch_thread  # noqa: F401
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine
from specdec.kpolicy.adaptive import AdaptiveK
from specdec.kpolicy.plan_ledger import PlanLedger


class Recorder:
    def __init__(self):
        self.seen: list[tuple[int, bool]] = []

    def observe(self, position: int, accepted: bool) -> None:
        self.seen.append((position, accepted))


def direct_evidence(start, plan, context):
    """Written out: positions up to the first mismatch are accepted, the mismatch is rejected, later ones unseen."""
    out = []
    for i, token in enumerate(plan):
        if start + i >= len(context):
            break
        out.append((i, context[start + i] == token))
        if context[start + i] != token:
            break
    return out


def test_evidence_equals_the_prefix_matches_however_the_context_grows():
    rng = random.Random(3)
    for trial in range(200):
        final = [rng.randrange(4) for _ in range(60)]
        ledger, expected, recorders = PlanLedger(), [], []
        known = rng.randrange(1, 10)
        while known < len(final):
            plan = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
            if rng.random() < 0.5:  # often a plan that copies what comes next for a while
                plan = final[known : known + rng.randrange(0, 8)] + plan
            recorder = Recorder()
            ledger.add(known, plan, recorder)
            recorders.append(recorder)
            expected.append((known, plan))
            known = min(len(final), known + rng.randrange(1, 6))  # a step emits one or more tokens
            ledger.resolve(final[:known])
        for recorder, (start, plan) in zip(recorders, expected):
            assert recorder.seen == direct_evidence(start, plan, final), (trial, start, plan)


def test_a_plan_waits_only_while_it_matches():
    ledger, recorder = PlanLedger(), Recorder()
    ledger.add(2, [7, 8, 9], recorder)
    ledger.resolve([1, 2, 7])
    assert recorder.seen == [(0, True)] and len(ledger) == 1
    ledger.resolve([1, 2, 7, 5, 8])
    assert recorder.seen == [(0, True), (1, False)] and len(ledger) == 0
    ledger.add(0, [], recorder)  # an empty plan teaches nothing and does not wait
    assert len(ledger) == 0


def test_the_ledger_is_bounded():
    ledger = PlanLedger(limit=4)
    for start in range(10):
        ledger.add(start, [1] * 50, Recorder())
    assert len(ledger) == 4


def _plan_learner(max_k=8):
    policy = AdaptiveK(max_k, pass_costs={1: 1.0, 2: 1.6, 9: 4.0})  # a steep CPU curve, in one-row passes
    policy.learns_from_plans = True
    return policy


def test_a_plan_learner_never_drafts_to_explore_where_plans_fail():
    plan_learner, explorer = _plan_learner(), AdaptiveK(8, pass_costs={1: 1.0, 2: 1.6, 9: 4.0})
    for policy in (plan_learner, explorer):
        ks = []
        for _ in range(300):
            k = policy.next_k()
            ks.append(k)
            if policy.learns_from_plans:
                policy.observe(0, False)  # every plan's first token is wrong
            policy.update(k, 0, 0.0, 1.0 + 0.6 * k)
        policy.ks = ks
    assert set(plan_learner.ks) == {0}
    assert any(k > 0 for k in explorer.ks)  # control: the drafting policy spends rows to find the same thing out


def test_a_plan_learner_drafts_long_where_plans_copy():
    policy = _plan_learner()
    assert policy.next_k() == 0  # nothing known: a plain step, not a prior draft
    policy.update(0, 0, 0.0, 1.0)
    for _ in range(20):
        for position in range(8):
            policy.observe(position, True)
    assert policy.next_k() == 8
    before = list(policy._accepted)
    policy.update(8, 8, 0.0, 4.0)  # a drafted step teaches timings only: the plan behind it is scored instead
    assert policy._accepted == before
    assert before[0] == pytest.approx(sum(policy.plan_decay ** i for i in range(20)))


def test_suffix_policies_learn_from_plans_and_greedy_output_is_unchanged(target_backend):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = plain_engine(target_backend).generate(prompt, params).tokens
    for name in ("suffix", "prompt_lookup"):
        spec = SpecConfig(num_speculative_tokens=8, drafter=name, k_policy="adaptive")
        engine = SpeculativeEngine(target_backend, create_drafter(name, spec=spec), spec)
        assert engine.generate(prompt, params).tokens == expected, name
        policies = list(engine.adaptive_policies.values())
        assert policies and all(p.learns_from_plans for p in policies), name
        assert any(sum(p._reached) > 0 for p in policies), name  # evidence arrived through the plans
