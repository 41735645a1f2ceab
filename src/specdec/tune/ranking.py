"""Rank measured configurations by what their paired runs show and pick the recommendation (a configuration, or
do not speculate); pure.

A configuration counts as faster than plain decoding only when it drafted and the confidence interval of its
paired speedup (intervals.py) lies above 1; as slower only when the interval lies below 1; otherwise it
is no faster than plain. Ranked by that first, then by the paired speedup. A speedup above the
configuration's own Leviathan bound (1.0 for one that never drafted: it decoded plainly) is flagged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specdec.config import SpecConfig

# Verdicts, in ranking order of their class.
FASTER, BELOW_MINIMUM = "faster", "faster, below --min-speedup"
NO_FASTER, NEVER_DRAFTED, NO_INTERVAL = (
    "no faster than plain", "never drafted: plain decoding", "not shown faster: one paired run, no interval",
)
SLOWER, NOT_IDENTICAL, NOT_MEASURED = "SLOWER than plain", "NOT IDENTICAL to plain", "not measured"
# Bounds are rounded to 4 digits in the bench summary; a speedup within this of its bound is not above it.
BOUND_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Recommendation:
    """What tune recommends: a measured configuration (row) or, when none is shown faster, no drafting at all."""

    speculate: bool
    reason: str
    row: dict | None = None  # the winning row when speculate, else the best row measured (or None)

    @property
    def spec(self) -> SpecConfig:
        if self.speculate:
            return SpecConfig(**self.row["spec"])
        # The CLI's defaults apart from the drafter, so a flag given over the config behaves as without it.
        return SpecConfig(drafter="none", k_policy="adaptive")

    @property
    def draft_reference(self) -> str | None:
        return self.row.get("draft_reference") if self.speculate else None

    def to_dict(self) -> dict:
        """The decision; a winner's figures at the top level, the best measured row's under best_measured when
        the answer is not to speculate (so a speedup at the top level always belongs to what is recommended)."""
        figures = {key: self.row.get(key) for key in ("candidate", "speedup", "speedup_paired", "speedup_interval",
                                                      "leviathan_bound", "evidence")} if self.row else None
        out = {"speculate": self.speculate, "reason": self.reason, "draft": self.draft_reference,
               "spec": dataclasses.asdict(self.spec)}
        if self.speculate:
            out.update(figures)
        else:
            out["best_measured"] = figures
        return out


def never_drafted(row: dict) -> bool:
    """The configuration made no draft at all (adaptive k at 0 throughout, or no n-gram ever matched)."""
    if row.get("num_drafts") is not None:
        return row["num_drafts"] == 0
    return row.get("speedup") is not None and row.get("mean_k") is None


def own_bound(row: dict) -> float | None:
    """The speedup the row's own measurements allow: its Leviathan bound, 1.0 when it never drafted."""
    return 1.0 if never_drafted(row) else row.get("leviathan_bound")


def above_bound(row: dict) -> float | None:
    """The largest measured speedup (overall or paired) above the row's own bound, or None."""
    bound = own_bound(row)
    if bound is None:
        return None
    measured = [v for v in (row.get("speedup"), row.get("speedup_paired")) if v is not None]
    worst = max(measured, default=None)
    return worst if worst is not None and worst > bound + BOUND_TOLERANCE else None


def evidence(row: dict, min_speedup: float) -> str:
    """What the paired runs show about speed (before the lossless check)."""
    if row.get("speedup") is None:
        return NOT_MEASURED
    if never_drafted(row):
        return NEVER_DRAFTED
    interval = row.get("speedup_interval")
    if interval is None:
        return NO_INTERVAL
    if interval["high"] < 1.0:
        return SLOWER
    if interval["low"] <= 1.0:
        return NO_FASTER
    return FASTER if (row.get("speedup_paired") or 0.0) >= min_speedup else BELOW_MINIMUM


_CLASS = {FASTER: 0, BELOW_MINIMUM: 0, NO_FASTER: 1, NEVER_DRAFTED: 1, NO_INTERVAL: 1, SLOWER: 2, NOT_MEASURED: 3}


def verdict(row: dict, min_speedup: float) -> str:
    """One phrase for the table: a lossless-contract failure first, then what the paired runs show."""
    if row.get("identical_to_plain") is False:
        return NOT_IDENTICAL
    return evidence(row, min_speedup)


def _point(row: dict) -> float:
    value = row.get("speedup_paired")
    return value if value is not None else (row.get("speedup") or 0.0)


def _interval_text(row: dict) -> str:
    interval = row.get("speedup_interval")
    if not interval:
        return f"no interval from {row.get('paired_runs', 0)} paired run(s)"
    return f"{interval['confidence']:.0%} CI {interval['low']:.2f}-{interval['high']:.2f}x"


def rank(rows: list[dict], min_speedup: float) -> tuple[list[dict], Recommendation]:
    """Sort rows (shown faster, then no faster than plain, then shown slower; by paired speedup within each),
    mark rank, verdict, `slower` and `above_bound`, and choose the recommendation.

    A configuration is recommended only if greedy output was identical to plain decoding, it drafted, the
    interval of its paired speedup lies above 1 and its paired speedup reaches min_speedup; otherwise the
    recommendation is not to speculate (plain decoding).
    """
    ranked = [dict(r) for r in rows]
    for row in ranked:
        row["evidence"] = evidence(row, min_speedup)
    ranked.sort(key=lambda r: (_CLASS[r["evidence"]], -_point(r), -(r.get("acceptance_rate") or 0.0)))
    for position, row in enumerate(ranked, 1):
        row["rank"] = position
        row["verdict"] = verdict(row, min_speedup)
        row["slower"] = row["evidence"] == SLOWER
        row["own_bound"] = own_bound(row)
        row["above_bound"] = above_bound(row)
    lossless = [r for r in ranked if r.get("identical_to_plain") is not False and r["evidence"] != NOT_MEASURED]
    winners = [r for r in lossless if r["evidence"] == FASTER]
    if winners:
        best = winners[0]
        return ranked, Recommendation(
            True, f"{best['candidate']} is the fastest: {_point(best):.2f}x plain decoding ({_interval_text(best)})",
            best,
        )
    if not lossless:
        return ranked, Recommendation(False, "no configuration could be measured: do not speculate here (decode "
                                             "plainly)")
    best = lossless[0]
    if best["evidence"] == BELOW_MINIMUM:
        why = (f"the best, {best['candidate']}, is faster than plain decoding but only {_point(best):.2f}x "
               f"({_interval_text(best)}), below --min-speedup {min_speedup:.2f}")
    else:
        never = "; it never drafted" if best["evidence"] == NEVER_DRAFTED else ""
        why = (f"no configuration is shown faster than plain decoding (best measured: {best['candidate']} at "
               f"{_point(best):.2f}x, {_interval_text(best)}{never})")
    return ranked, Recommendation(False, f"do not speculate here: {why}; decode plainly", best)


__all__ = ["Recommendation", "above_bound", "evidence", "never_drafted", "own_bound", "rank", "verdict"]
