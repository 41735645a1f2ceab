"""Rank measured configurations by speedup and pick the recommendation (a configuration, or plain decoding); pure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import SpecConfig


@dataclass(frozen=True)
class Recommendation:
    """What tune recommends: a measured configuration (row) or, when none helps, no drafting at all."""

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
        return {"speculate": self.speculate, "reason": self.reason,
                "candidate": self.row["candidate"] if self.row else None,
                "speedup": self.row["speedup"] if self.row else None,
                "draft": self.draft_reference, "spec": dataclasses.asdict(self.spec)}


def verdict(row: dict, min_speedup: float) -> str:
    """One word for the table: a lossless-contract failure first, then slower / no gain / faster."""
    if row.get("identical_to_plain") is False:
        return "NOT IDENTICAL to plain"
    speedup = row.get("speedup")
    if speedup is None:
        return "not measured"
    if speedup < 1.0:
        return "SLOWER than plain"
    if speedup < min_speedup:
        return "no clear gain"
    return "faster"


def rank(rows: list[dict], min_speedup: float) -> tuple[list[dict], Recommendation]:
    """Sort rows by measured speedup (best first), mark rank, verdict and `slower`, and choose the recommendation.

    A configuration is recommended only if greedy output was identical to plain decoding and its speedup
    reaches min_speedup; otherwise the recommendation is plain decoding (no draft).
    """
    ranked = sorted(
        (dict(r) for r in rows),
        key=lambda r: (r.get("speedup") is None, -(r.get("speedup") or 0.0), -(r.get("acceptance_rate") or 0.0)),
    )
    for position, row in enumerate(ranked, 1):
        row["rank"] = position
        row["slower"] = row.get("speedup") is not None and row["speedup"] < 1.0
        row["verdict"] = verdict(row, min_speedup)
    eligible = [r for r in ranked if r.get("speedup") is not None and r.get("identical_to_plain") is not False]
    if not eligible:
        return ranked, Recommendation(False, "no configuration could be measured: decode plainly (no draft)")
    best = eligible[0]
    if best["speedup"] >= min_speedup:
        return ranked, Recommendation(
            True, f"{best['candidate']} is the fastest: {best['speedup']:.2f}x plain decoding", best
        )
    return ranked, Recommendation(
        False,
        f"nothing reaches {min_speedup:.2f}x (best: {best['candidate']} at {best['speedup']:.2f}x): decode plainly "
        "(no draft)",
        best,
    )


__all__ = ["Recommendation", "rank", "verdict"]
