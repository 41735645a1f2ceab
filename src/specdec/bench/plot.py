"""bench.png: speedup over plain decoding per method and task, and acceptance rate per draft position."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or None when matplotlib is not installed."""
    try:
        import matplotlib  # the bench extra: without it there is no plot, and the tables say so

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt  # the bench extra
    except ImportError:
        return None
    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write and close a figure; returns the path written."""
    import matplotlib.pyplot as plt  # the bench extra (a figure exists only where pyplot() found it)

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_results(results: dict, path: str | Path) -> Path | None:
    """Draw the two panels with matplotlib's Agg backend; None (and no file) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    summary = results["summary"]
    methods = list(summary["overall"])
    groups = summary["tasks"] + ["overall"]
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(max(10.0, 1.1 * len(methods) + 6), 4.8))

    width = 0.8 / max(len(groups), 1)
    for g, group in enumerate(groups):
        table = summary["overall"] if group == "overall" else summary["per_task"][group]
        values = [(table.get(m) or {}).get("speedup") or 0.0 for m in methods]
        positions = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(methods))]
        bars.bar(positions, values, width, label=group)
    bars.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    bars.set_xticks(range(len(methods)))
    bars.set_xticklabels(methods, rotation=40, ha="right", fontsize=8)
    bars.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    bars.set_title("Speedup per method and task")
    bars.legend(fontsize=8)

    plotted = False
    for name in methods:
        per_pos = summary["overall"][name].get("acceptance_rate_per_pos") or []
        if per_pos:
            lines.plot(range(1, len(per_pos) + 1), per_pos, marker="o", markersize=3, label=name)
            plotted = True
    lines.set_xlabel("draft position")
    lines.set_ylabel("P(accepted | reached)")
    lines.set_ylim(0, 1.05)
    lines.set_title("Acceptance rate per draft position")
    if plotted:
        lines.legend(fontsize=7)
    return save_figure(fig, path)


__all__ = ["plot_results", "pyplot", "save_figure"]
