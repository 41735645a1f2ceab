"""What a perfect drafter would buy on the run's measured pass costs, and a perfect copier on the run's texts, beside what each method reached: per method and task, rows per emitted token, decode speedup over its own plain decoding, the share of the ceiling and of the copy bound.

The ceiling (calibration.machine_ceiling) is a decode-time figure: the best (k + 1) x cost(1) / (cost(k + 1) +
k c cost(1)) over k up to the method's maximum, on the curve the adaptive policies read in the run
(results["pass_costs_ms"], "exact" for the exact_ methods). What a method reached is its decode tok/s over its
own plain decoding's in the same scope (prefill excluded on both sides, since no drafter changes it).
Rows per emitted token = target rows verified in decoding passes / generated tokens (1.00 for plain decoding;
below 1 only when drafts are accepted, above when rejected rows are paid for).

The copy bound (copy_bound.py) of a method whose drafter copies from its context (suffix, prompt lookup) is the
most a drafter that only copies spans could buy on the same texts: plain decoding's outputs, the prompts' ids as
run, earlier prompts' outputs as the cross-request cache (the suffix drafter's bound on it), spans chained where
the suffix drafter chains them (through suffix_depth / 2 shared tokens), at the method's maximum k on its curve.
It says how much of the ceiling the text leaves to copying (copy bound / ceiling), and how much of that the
method found (reached / copy bound).
"""

from __future__ import annotations

from specdec.bench.method.copy_bound import combined_speedup, copy_bound
from specdec.bench.method.methods import EXACT_BASELINE
from specdec.config import COPYING_DRAFTERS, SpecConfig
from specdec.kpolicy.calibration import machine_ceiling


class _CopyBounds:
    """Copy bounds of the run's outputs by (curve mode, max k), per task and over all, computed once each."""

    def __init__(self, results: dict):
        self.results = results
        self._by_key: dict[tuple[str, int], dict[str, list[dict]]] = {}

    def speedup(self, exact: bool, max_k: int, task: str | None) -> float | None:
        mode = "exact" if exact else "default"
        if (mode, max_k) not in self._by_key:
            self._by_key[(mode, max_k)] = self._compute(_curve(self.results, exact), max_k)
        bounds = self._by_key[(mode, max_k)]
        return combined_speedup(bounds.get(task, []) if task is not None else
                                [b for task_bounds in bounds.values() for b in task_bounds])

    def _compute(self, curve: dict[int, float] | None, max_k: int) -> dict[str, list[dict]]:
        by_task: dict[str, list[dict]] = {}
        if not curve:
            return by_task
        history: list[list[int]] = []  # earlier outputs, newest last, at most the cross-request cache's tokens
        defaults = SpecConfig()
        budget, chain = defaults.suffix_cache_tokens, defaults.suffix_depth // 2
        for key, output in (self.results.get("outputs") or {}).items():
            tokens = output.get("plain_tokens")
            if not tokens:
                continue
            if output.get("prompt_ids") is not None:
                bound = copy_bound(output["prompt_ids"], tokens, curve, max_k, history, chain)
                by_task.setdefault(key.split("/", 1)[0], []).append(bound)
            history.append(list(tokens))
            while sum(len(h) for h in history) > budget:
                history.pop(0)
        return by_task


def _curve(results: dict, exact: bool) -> dict[int, float] | None:
    curves = results.get("pass_costs_ms") or {}
    curve = curves.get("exact" if exact else "default")
    return {int(rows): float(ms) for rows, ms in curve.items()} if curve else None


def rows_per_token(row: dict) -> float | None:
    """Verified rows per generated token: drafted tokens plus one row per pass that emitted tokens (passes: our
    engine's decoding passes plus each run's prefill pass, whose last row gives the first token; a peer's,
    which it does not report, as generated - accepted, each pass emitting accepted + 1, the prefill's too)."""
    tokens = row.get("generated_tokens") or 0
    if not tokens:
        return None
    forwards = row.get("num_target_forwards")
    if forwards:
        passes = forwards + (row.get("runs") or 0)
    else:
        passes = tokens - (row.get("num_accepted_tokens") or 0)
    return round(((row.get("num_draft_tokens") or 0) + passes) / tokens, 4)


def _copies(method: dict) -> bool:
    return (method.get("spec") or {}).get("drafter") in COPYING_DRAFTERS


def _scope_ceilings(scope: dict, methods: dict, results: dict, bounds: _CopyBounds, task: str | None) -> dict:
    out: dict[str, dict] = {}
    for name, row in scope.items():
        method = methods.get(name) or {}
        entry = {"rows_per_token": rows_per_token(row)}
        exact = bool(method.get("exact"))
        curve = _curve(results, exact)
        own_plain = scope.get(EXACT_BASELINE if exact else "plain")
        if method.get("kind") == "specdec" and method.get("k") and curve:
            speedup, best_k = machine_ceiling(curve, int(method["k"]), row.get("cost_ratio") or 0.0)
            entry.update(ceiling=round(speedup, 4), ceiling_k=best_k, max_k=int(method["k"]))
            plain_rate = (own_plain or {}).get("decode_tokens_per_second")
            rate = row.get("decode_tokens_per_second")
            if plain_rate and rate:
                entry["decode_speedup"] = round(rate / plain_rate, 4)
                entry["share_of_ceiling"] = round(rate / plain_rate / speedup, 4) if speedup > 1 else None
            bound = bounds.speedup(exact, int(method["k"]), task) if _copies(method) else None
            if bound is not None:
                entry["copy_bound"] = round(bound, 4)
                entry["copy_bound_share_of_ceiling"] = round(bound / speedup, 4) if speedup > 1 else None
                if entry.get("decode_speedup") and bound > 1:
                    entry["share_of_copy_bound"] = round(entry["decode_speedup"] / bound, 4)
        out[name] = entry
    return out


def ceiling_summary(results: dict, overall: dict, per_task: dict) -> dict | None:
    """{"curves_ms", "overall": {method: {...}}, "per_task": {task: {method: {...}}}}, or None without a curve."""
    if not results.get("pass_costs_ms"):
        return None
    methods = {m["name"]: m for m in results["config"]["methods"]}
    bounds = _CopyBounds(results)
    return {
        "curves_ms": results["pass_costs_ms"],
        "overall": _scope_ceilings(overall, methods, results, bounds, None),
        "per_task": {task: _scope_ceilings(scope, methods, results, bounds, task) for task, scope in per_task.items()},
    }


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def ceiling_markdown(ceiling: dict, tasks: list[str]) -> list[str]:
    """The curve(s), then per method: max k, ceiling, decode speedup, share of the ceiling overall and per task."""
    lines = ["## Cost curve and ceiling", ""]
    for mode, curve in ceiling["curves_ms"].items():
        rows = sorted(curve, key=int)
        lines += [f"Pass costs the adaptive policies read ({mode} kernels), ms per target pass of n rows:", "",
                  "| rows | " + " | ".join(rows) + " |", "|---|" + "---:|" * len(rows),
                  "| ms | " + " | ".join(f"{curve[r]:.1f}" for r in rows) + " |", ""]
    lines += [("Ceiling = what a drafter whose every token is accepted would buy in decode time on that curve, at "
               "its best k up to the method's maximum (with its measured c); reached = decode tok/s over its own "
               "plain decoding's; share = reached / ceiling. Rows per token = verified rows per generated token "
               "(llama-server's passes inferred as generated - accepted)."), "",
              "| method | max k | ceiling (at k) | rows per token | decode speedup | share of ceiling | "
              + " | ".join(f"{t} share" for t in tasks) + " |",
              "|---|---:|---:|---:|---:|---:|" + "---:|" * len(tasks)]
    for name, entry in ceiling["overall"].items():
        per_task = [_pct((ceiling["per_task"].get(t, {}).get(name) or {}).get("share_of_ceiling")) for t in tasks]
        ceiling_cell = f"{entry['ceiling']:.2f}x ({entry['ceiling_k']})" if "ceiling" in entry else "–"
        speedup = f"{entry['decode_speedup']:.2f}x" if entry.get("decode_speedup") else "–"
        rows = f"{entry['rows_per_token']:.2f}" if entry.get("rows_per_token") is not None else "–"
        lines.append(f"| {name} | {entry.get('max_k', '–')} | {ceiling_cell} | {rows} | {speedup} | "
                     f"{_pct(entry.get('share_of_ceiling'))} | " + " | ".join(per_task) + " |")
    return lines + [""] + _copy_bound_markdown(ceiling, tasks)


def _copy_bound_markdown(ceiling: dict, tasks: list[str]) -> list[str]:
    """Per copying method and task: the copy bound, its share of the ceiling, and the share of it reached."""
    names = [name for name, entry in ceiling["overall"].items() if "copy_bound" in entry]
    if not names:
        return []
    lines = [("Copy bound = the decode speedup of a drafter that copies, from the prompt, the output so far and "
              "earlier outputs, exactly the longest span the target then emits, at the length that costs least on "
              "the curve (plain decoding's outputs; bench/ceiling.py): the most any copying drafter could buy on "
              "these texts here. Cells: copy bound (its share of the ceiling) / share of the copy bound reached."), "",
             "| method | all | " + " | ".join(tasks) + " |", "|---|---:|" + "---:|" * len(tasks)]
    for name in names:
        cells = []
        for entry in [ceiling["overall"][name]] + [ceiling["per_task"].get(t, {}).get(name) or {} for t in tasks]:
            if "copy_bound" not in entry:
                cells.append("–")
                continue
            cells.append(f"{entry['copy_bound']:.2f}x ({_pct(entry.get('copy_bound_share_of_ceiling'))}) / "
                         f"{_pct(entry.get('share_of_copy_bound'))}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


__all__ = ["ceiling_markdown", "ceiling_summary", "rows_per_token"]
