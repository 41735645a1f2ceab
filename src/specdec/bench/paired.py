"""Paired confidence intervals for the bench's per-task ratios: each method's tok/s over the reference's, prompt by prompt in the same interleaved turn, as a geometric mean with a 95% Student-t interval (intervals.speedup_interval).

The per-task table divides aggregate tok/s; a task of three prompts moves 5-10% between runs on a shared
2-core VM, so a ratio of 0.92x says nothing by itself. Its interval does: one that reaches above 1 is inside the
noise, one whose top is below 1 is a loss the run can show. Pure: reads the run records only.
"""

from __future__ import annotations

from ..intervals import paired_ratios, speedup_interval


def paired_intervals(runs: list[dict], baseline: str, methods: list[str], tasks: list[str],
                     confidence: float = 0.95) -> dict:
    """{"confidence", "per_task": {task: {method: interval dict | None}}, "overall": {method: ...}}: None where
    fewer than two turns pair the method with the baseline (one pair says nothing about the noise)."""
    def interval(records: list[dict], method: str) -> dict | None:
        found = speedup_interval(paired_ratios(records, method, baseline), confidence)
        return None if found is None else found.to_dict()

    names = [name for name in methods if name != baseline]
    return {
        "confidence": confidence,
        "per_task": {task: {name: interval([r for r in runs if r["task"] == task], name) for name in names}
                     for task in tasks},
        "overall": {name: interval(runs, name) for name in names},
    }


def _cell(entry: dict | None) -> str:
    if not entry:
        return "–"
    return f"{entry['estimate']:.2f}x [{entry['low']:.2f}, {entry['high']:.2f}]"


def paired_markdown(intervals: dict, baseline: str) -> list[str]:
    """Rows = tasks, then overall; a cell per method: geometric mean of its paired ratios [interval]."""
    names = list(intervals["overall"])
    if not names:
        return []
    confidence = round(100 * intervals["confidence"])
    lines = [(f"Paired per prompt: each method's tok/s over `{baseline}`'s in the same interleaved turn, geometric "
              f"mean and {confidence}% interval (Student-t on the log ratios, prompts as the samples). A task whose "
              "interval reaches 1.00 is inside this run's noise."), "",
             "| task | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for task, row in intervals["per_task"].items():
        lines.append(f"| {task} | " + " | ".join(_cell(row.get(name)) for name in names) + " |")
    lines.append("| **all prompts** | " + " | ".join(_cell(intervals["overall"].get(name)) for name in names) + " |")
    return lines + [""]


__all__ = ["paired_intervals", "paired_markdown"]
