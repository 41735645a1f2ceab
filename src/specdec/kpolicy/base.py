"""Draft-length policies: how many tokens to propose next step, learned from what was accepted."""

from __future__ import annotations

from typing import Protocol


class KPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        """Learn from one step; catchup_seconds is what the drafter spent first feeding context it had not seen."""
        ...


class FixedK:
    """Always propose k tokens."""

    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def update(self, num_proposed: int, num_accepted: int, draft_seconds: float, target_seconds: float,
               catchup_seconds: float = 0.0) -> None:
        pass


class HeuristicK:
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


def make_policy(name: str, k: int, pass_costs=None) -> KPolicy:
    """Build a fresh per-request policy by name (fixed, heuristic, adaptive); pass_costs: the target's
    measured pass-cost curve, which the adaptive policy reads."""
    if name == "fixed":
        return FixedK(k)
    if name == "heuristic":
        return HeuristicK(k)
    if name == "adaptive":
        from specdec.kpolicy.adaptive import AdaptiveK

        return AdaptiveK(max_k=k, pass_costs=pass_costs)
    raise ValueError(f"unknown k policy {name!r}")
