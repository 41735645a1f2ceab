"""Paired confidence intervals for the bench's per-task ratios: each method's tok/s over the reference's, prompt by prompt in the same interleaved turn, as a geometric mean with a 95% Student-t interval (intervals.speedup_interval).

The per-task table divides aggregate tok/s; a task of three prompts moves 5-10% between runs on a shared
2-core VM, so a ratio of 0.92x says nothing by itself. Its interval does: one that reaches above 1 is inside the
noise, one whose top is below 1 is a loss the run can show. The noise floor says how small a per-task difference
the run could show at all: our plain decoding and llama-server's do the same work (same tokens, same kernels), so
the spread of their paired ratios is the machine's noise alone. Pure: reads the run records only.
"""

from __future__ import annotations

import math

from specdec.core.intervals import paired_ratios, speedup_interval, t_quantile

# The method whose turns repeat the reference's work when its greedy tokens are the same (both on the fast kernels).
SAME_WORK_METHOD = "plain"


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


def noise_floor(runs: list[dict], reference: str, tasks: list[str], bar: float = 0.97,
                confidence: float = 0.95) -> dict | None:
    """What identical work measures as: `plain` over the reference on the turns where the reference reproduced plain's
    greedy tokens (its record's identical_to_plain), an A/A comparison whose true ratio is 1.

    Returns None without such a pair (no llama-server in the run, or fewer than two turns in some task). Else
    {"pair", "turns", "of", "sd_log" (standard deviation of the log ratio within tasks, pooled over tasks),
    "per_task": {task: {"prompts", "half_width"}} (the `confidence` half-width of a task's geometric mean at that
    spread, as a fraction: 0.05 = +-5%), "all_half_width" (the same over every prompt of the run), "bar",
    "prompts_for_bar" (prompts per task for a half-width of 1 - bar), "chance_all_clear_bar" (the chance that the
    same work's geometric mean clears `bar` in every task, normal approximation)}."""
    if reference == SAME_WORK_METHOD:
        return None
    same = {(r["task"], r["prompt_id"], r["repeat"]) for r in runs
            if r["method"] == reference and r.get(f"identical_to_{SAME_WORK_METHOD}") is True}
    of = sum(1 for r in runs if r["method"] == reference)
    logs: dict[str, list[float]] = {}
    for task in tasks:
        chosen = [r for r in runs if r["task"] == task and (r["task"], r["prompt_id"], r["repeat"]) in same]
        values = [math.log(x) for x in paired_ratios(chosen, SAME_WORK_METHOD, reference)]
        if values:
            logs[task] = values
    if not logs or any(len(values) < 2 for values in logs.values()):
        return None
    squares = sum(sum((x - sum(v) / len(v)) ** 2 for x in v) for v in logs.values())
    freedom = sum(len(v) - 1 for v in logs.values())
    sd = math.sqrt(squares / freedom)
    quantile = 0.5 + confidence / 2.0

    def half_width(n: int) -> float:
        return math.expm1(t_quantile(quantile, n - 1) * sd / math.sqrt(n))

    needed = 2
    while needed < 10_000 and half_width(needed) > 1.0 - bar:
        needed += 1
    margin = -math.log(bar)
    chance = 1.0  # with no spread at all, the same work always measures 1.00x
    for values in logs.values() if sd > 0 else ():
        chance *= 0.5 * (1.0 + math.erf(margin / (sd / math.sqrt(len(values))) / math.sqrt(2.0)))
    turns = sum(len(v) for v in logs.values())
    return {
        "pair": [SAME_WORK_METHOD, reference], "turns": turns, "of": of, "sd_log": sd, "confidence": confidence,
        "per_task": {task: {"prompts": len(v), "half_width": half_width(len(v))} for task, v in logs.items()},
        "all_half_width": half_width(turns), "bar": bar, "prompts_for_bar": needed,
        "chance_all_clear_bar": chance,
    }


def noise_floor_markdown(floor: dict | None) -> list[str]:
    """One paragraph under the paired table; nothing without an A/A pair."""
    if not floor:
        return []
    mine, reference = floor["pair"]
    width_by_prompts = {e["prompts"]: round(100 * e["half_width"]) for e in floor["per_task"].values()}
    resolves = ", ".join(f"+-{width_by_prompts[n]}% with {n} prompts" for n in sorted(width_by_prompts))
    tasks = len(floor["per_task"])
    confidence = round(100 * floor["confidence"])
    chance = "under 1%" if floor["chance_all_clear_bar"] < 0.01 else f"{100 * floor['chance_all_clear_bar']:.0f}%"
    return [(f"Noise floor: `{mine}` and `{reference}` did the same work on {floor['turns']} of {floor['of']} prompts "
             "(the same greedy tokens on the same kernels), so the spread of their paired ratio is what this "
             "machine's noise does to one prompt (any real difference between the two programs included): standard "
             f"deviation {100 * floor['sd_log']:.1f}% per prompt (log ratio, within tasks). At that spread a task's "
             f"ratio is known to {resolves} ({confidence}%), all prompts together to "
             f"+-{100 * floor['all_half_width']:.1f}%; resolving +-{100 * (1 - floor['bar']):.0f}% per task takes "
             f"{floor['prompts_for_bar']} prompts per task, and the same work clears {floor['bar']:.2f}x in all "
             f"{tasks} tasks in {chance} of runs like this one."), ""]


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


__all__ = ["SAME_WORK_METHOD", "noise_floor", "noise_floor_markdown", "paired_intervals", "paired_markdown"]
