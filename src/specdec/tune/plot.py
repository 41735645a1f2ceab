"""The tune plots: measured speedup vs rejection rate (with the Leviathan bound curves) and acceptance by position."""

from __future__ import annotations

import statistics
from pathlib import Path

from specdec.bench.plot import pyplot, save_figure
from specdec.core.stats import leviathan_speedup

_MARKERS = {"fixed": "o", "adaptive": "s", "heuristic": "^"}
MAX_POSITION_LINES = 10


def plot_speedup_vs_rejection(result, path: str | Path) -> Path | None:
    """Each configuration at (1 - acceptance rate, measured speedup); per drafter, the Leviathan bound over the
    rejection rate at that drafter's median measured c and k. None (no file) without matplotlib or data."""
    plt = pyplot()
    rows = [r for r in result.rows if r.get("speedup") is not None and r.get("rejection_rate") is not None]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    colours = {}
    for row in rows:
        colour = colours.setdefault(row["drafter"], f"C{len(colours)}")
        ax.scatter(row["rejection_rate"], row["speedup"], color=colour, marker=_MARKERS.get(row["k_policy"], "o"),
                   s=40, zorder=3)
        ax.annotate(str(row["rank"]), (row["rejection_rate"], row["speedup"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    grid = [i / 100 for i in range(100)]
    for drafter, colour in colours.items():
        mine = [r for r in rows if r["drafter"] == drafter]
        costs = [r["cost_ratio"] for r in mine if r.get("cost_ratio") is not None]
        ks = [r["mean_k"] for r in mine if r.get("mean_k")]
        if not costs or not ks:
            continue
        c, k = statistics.median(costs), statistics.median(ks)
        ax.plot(grid, [leviathan_speedup(1 - x, k, c) for x in grid], color=colour, linestyle=":", linewidth=1,
                label=f"{drafter} (bound at c={c:.2f}, k={k:.1f})")
    for policy, marker in _MARKERS.items():
        if any(r["k_policy"] == policy for r in rows):
            ax.scatter([], [], color="grey", marker=marker, label=f"{policy} k")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("rejection rate (1 - accepted / drafted tokens)")
    ax.set_ylabel("measured speedup over plain decoding")
    ax.set_title("Speedup vs rejection rate (numbers: rank; below the dashed line is slower)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_acceptance_by_position(result, path: str | Path) -> Path | None:
    """P(position i accepted | a draft reached it) per configuration, best-ranked first (at most 10 lines)."""
    plt = pyplot()
    rows = [r for r in result.rows if r.get("acceptance_rate_per_pos")][:MAX_POSITION_LINES]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for row in rows:
        values = row["acceptance_rate_per_pos"]
        ax.plot(range(1, len(values) + 1), values, marker=_MARKERS.get(row["k_policy"], "o"), markersize=3,
                label=f"{row['rank']}. {row['candidate']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize=6)
    return save_figure(fig, path)


__all__ = ["plot_acceptance_by_position", "plot_speedup_vs_rejection"]
