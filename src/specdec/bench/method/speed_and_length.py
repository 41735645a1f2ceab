"""Per task, each method's decode speed and answer length over the reference's: tok/s per task mixes them.

A greedy near-tie flip that ends an answer early lowers tok/s over a fixed prefill without any token coming
slower. Decode ratio = the method's decode tok/s (generated tokens / (wall time - prefill seconds)) over the
reference's in the same task; length ratio = its generated tokens over the reference's on the same prompts.
The reference is the one the per-task tok/s table uses (llama.cpp's plain decoding when it ran, else ours).
A ratio is None where either side has no figure.
"""

from __future__ import annotations

from specdec.bench.cells import format_cell


def speed_and_length(summary: dict, baseline: str, methods: list[str]) -> dict:
    """{"per_task": {task: {method: {"decode": ratio, "length": ratio}}}, "overall": {...}}, over baseline."""

    def ratios(scope: dict) -> dict:
        base = scope.get(baseline) or {}
        out = {}
        for name in methods:
            row = scope.get(name) or {}
            out[name] = {
                "decode": _ratio(row.get("decode_tokens_per_second"), base.get("decode_tokens_per_second")),
                "length": _ratio(row.get("generated_tokens"), base.get("generated_tokens")),
            }
        return out

    return {"per_task": {task: ratios(summary["per_task"][task]) for task in summary["tasks"]},
            "overall": ratios(summary["overall"])}


def _ratio(value, base) -> float | None:
    return round(value / base, 4) if value is not None and base else None


def speed_and_length_markdown(summary: dict, baseline: str, methods: list[str]) -> list[str]:
    """The section: one row per task (and overall), one column per method, "decode x / length x"."""
    if not methods:
        return []
    table = speed_and_length(summary, baseline, methods)

    def cells(scope: dict) -> str:
        return " | ".join(f"{format_cell(scope[name]['decode'], '.2f', 'x')} / "
                          f"{format_cell(scope[name]['length'], '.2f', 'x')}" for name in methods)

    lines = [f"## Decode speed and answer length per task relative to {baseline}", "",
             (f"Each cell: the method's decode tok/s (without prefill) over `{baseline}`'s in the task / its "
              f"generated tokens over `{baseline}`'s there. tok/s per task above is prefill and decoding "
              "together, so an answer that ends earlier (a greedy near-tie flip of the fast kernels) lowers "
              "it over the same prefill even where decoding ran faster; this table tells the two apart."), "",
             "| task | " + " | ".join(methods) + " |", "|---|" + "---:|" * len(methods)]
    lines += [f"| {task} | {cells(table['per_task'][task])} |" for task in summary["tasks"]]
    lines += [f"| **overall** | {cells(table['overall'])} |", ""]
    return lines


__all__ = ["speed_and_length", "speed_and_length_markdown"]
