"""A fresh k policy by its public name (SpecConfig.k_policy: fixed, heuristic, adaptive)."""

from __future__ import annotations

from specdec.kpolicy.adaptive import AdaptiveK
from specdec.kpolicy.base import FixedK, HeuristicK, KPolicy


def make_policy(name: str, k: int, pass_costs=None) -> KPolicy:
    """Build a fresh per-request policy by name (fixed, heuristic, adaptive); pass_costs: the target's
    measured pass-cost curve, which the adaptive policy reads."""
    if name == "fixed":
        return FixedK(k)
    if name == "heuristic":
        return HeuristicK(k)
    if name == "adaptive":
        return AdaptiveK(max_k=k, pass_costs=pass_costs)
    raise ValueError(f"unknown k policy {name!r}")
