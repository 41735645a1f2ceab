"""The k-policy protocol (how many tokens to propose next step, learned from what was accepted) and the two simple
policies: a fixed k and transformers' heuristic schedule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping


class KPolicy(ABC):
    """How many tokens one draft source proposes next step, learned from what was accepted.

    `next_k` and `update` are every policy's; the rest has defaults for a policy that decides alone from its own
    steps. A load-aware policy (adaptive) overrides them: `set_pass_context` tells it the rows and tokens the
    other sequences put in this step's pass, `expected_tokens(k)` what k drafted tokens are expected to emit,
    `shared_pass_costs` what shared passes of each row count cost on this engine. A policy that
    `can_learn_from_plans` takes acceptance from a deterministic drafter's scored plans (`learn_from_plans`,
    then `observe` per scored position, plan_ledger.py), and when `allocatable` the scheduler chooses its k
    jointly with others' (row_allocation.py: `position_gains`, `draft_cost`, `shared_pass_curve`, `margin`,
    then `take_k`).
    """

    max_k: int = 0  # the largest k the policy proposes
    can_learn_from_plans = False
    allocatable = False
    margin = 0.0  # a draft must beat plain decoding's expected rate by this fraction
    shared_pass_costs: Mapping[int, object] | None = None

    @abstractmethod
    def next_k(self) -> int: ...

    @abstractmethod
    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        """Learn from one step; catchup_seconds is what the drafter spent first feeding context it had not seen."""

    def begin_request(self, carry: float | None = None) -> None:
        """A new request starts on this policy (one kept across requests)."""

    def set_pass_context(self, other_rows: int, other_tokens: float) -> None:
        """The rows other sequences put in this step's pass and the tokens they are expected to emit."""

    def expected_tokens(self, k: int) -> float:
        """Tokens a step drafting k is expected to emit (1 without a model of acceptance: the target's own)."""
        return 1.0

    def learn_from_plans(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not learn from plans")

    def observe(self, position: int, accepted: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not learn from plans")

    def take_k(self, k: int) -> int:
        """Record a k chosen for this policy from outside (the scheduler's joint allocation)."""
        return k

    def position_gains(self, k_max: int) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} is not allocatable")

    @property
    def draft_cost(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} is not allocatable")

    def shared_pass_curve(self) -> dict[int, float]:
        raise NotImplementedError(f"{type(self).__name__} is not allocatable")


class FixedK(KPolicy):
    """Always propose k tokens."""

    def __init__(self, k: int):
        self.k = self.max_k = k

    def next_k(self) -> int:
        return self.k

    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        pass


class HeuristicK(KPolicy):
    """transformers' 'heuristic' schedule: +2 after a fully accepted draft, -1 otherwise (min 1)."""

    def __init__(self, k: int, max_k: int = 64):
        self.k = k
        self.max_k = max_k

    def next_k(self) -> int:
        return self.k

    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        if num_proposed == 0:
            return
        if num_accepted == num_proposed:
            self.k = min(self.k + 2, self.max_k)
        else:
            self.k = max(1, self.k - 1)
