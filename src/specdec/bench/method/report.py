"""Aggregate raw bench runs per method (overall and per task) and write results.json, results.md and the plot.

Definitions (the same in the JSON, the markdown and the docs):
- tokens/s: total generated tokens / total wall time of the generate calls (prefill included).
- prefill tok/s: prompt tokens through the prefill / prefill seconds, as each framework times its prefill
  (our engine: the target's prompt pass plus the drafter's setup; llama-server: its timings.prompt_ms).
- decode tok/s: generated tokens / (wall time - prefill seconds).
- relative per task: a method's tokens/s in a task over the reference's in the same task, the reference being
  llamacpp_plain when it ran, else plain; its minimum over tasks is the worst category.
- speedup: a method's tokens/s over plain decoding's (our engine, no drafter) in the same scope;
  transformers' methods are also given over transformers' own plain generate, and every method over
  llama.cpp's llama-server plain decoding (llamacpp_plain) when it ran; the exact_ methods (our methods on
  llama.cpp's exact kernels, --exact) also over exact_plain.
- exact vs default: each exact_<m>'s tokens/s over <m>'s (same method, default fast kernels), per task and
  overall: the price of bit-identical greedy output.
- greedy differences: our default-kernel methods against plain are near-tie flips of llama.cpp's fast
  kernels (information); the exact_ methods against exact_plain, or any of ours on exact kernels (torch,
  or --exact), must never differ (a warning: a bug).
- acceptance rate: accepted draft tokens / drafted tokens.
- mean acceptance length: 1 + accepted / drafts, i.e. tokens per target pass *including the bonus token*.
- c: mean draft-model forward (1-2 new tokens) / mean target single-token forward, timed on the nn.Modules;
  for model-free drafters (and hybrid), drafting seconds per drafted token / target single-token forward.
- Leviathan bound: (1 - a^(k+1)) / ((1 - a)(k c + 1)) from the measured a, k (the mean drafted length
  for adaptive policies) and c.
- ceiling, rows per token, share of the ceiling: see ceiling.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from specdec.core.stats import SpecStats, leviathan_speedup
from specdec.bench.cells import format_cell
from specdec.bench.method.ceiling import ceiling_markdown, ceiling_summary
from specdec.bench.method.paired import noise_floor, noise_floor_markdown, paired_intervals, paired_markdown
from specdec.bench.method.methods import BASELINES, EXACT_BASELINE, EXACT_PREFIX, PEER_BASELINES
from specdec.bench.method.runner import stats_from_raw
from specdec.bench.method.speed_and_length import speed_and_length_markdown


def _merged_stats(runs: list[dict]) -> SpecStats:
    total = SpecStats()
    for run in runs:
        total.merge(stats_from_raw(run["stats"]))
    return total


def _single_forward_seconds(runs: list[dict], baseline: str) -> float | None:
    calls = sum(r["target_forwards"]["short_calls"] for r in runs if r["method"] == baseline)
    seconds = sum(r["target_forwards"]["short_seconds"] for r in runs if r["method"] == baseline)
    return seconds / calls if calls else None


def _round(value, digits=4):
    return None if value is None else round(value, digits)


def _prefill_totals(runs: list[dict]) -> tuple[int, float]:
    """(prompt tokens through a timed prefill, its seconds) over the runs that timed one."""
    tokens, seconds = 0, 0.0
    for run in runs:
        timed = run["stats"].get("prefill_seconds", 0.0)
        # Results written before prefill_tokens was recorded: the prompt but its last token (our engine's).
        count = run.get("prefill_tokens", max(run["prompt_tokens"] - 1, 0) if timed > 0 else None)
        if timed > 0 and count is not None:
            tokens += count
            seconds += timed
    return tokens, seconds


def _server_decode_rate(runs: list[dict]) -> float | None:
    timings = [(r.get("llamacpp_settings") or {}).get("timings") or {} for r in runs]
    tokens = sum(t.get("predicted_n") or 0 for t in timings)
    ms = sum(t.get("predicted_ms") or 0.0 for t in timings)
    return round(tokens / ms * 1000, 3) if tokens and ms > 0 else None


def _method_summary(method: dict, runs: list[dict], scope_runs: list[dict]) -> dict:
    tokens = sum(r["generated_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    stats = _merged_stats(runs)
    prefill = sum(r["stats"].get("prefill_seconds", 0.0) for r in runs)
    prefill_tokens, prefill_timed = _prefill_totals(runs)
    out: dict = {
        "runs": len(runs),
        "generated_tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "prefill_tokens": prefill_tokens,
        "prefill_tokens_per_second": round(prefill_tokens / prefill_timed, 3) if prefill_timed > 0 else None,
        # Without the prompt prefill (identical work for every method of a framework): the decoding itself.
        "prefill_seconds": round(prefill, 4),
        "decode_tokens_per_second": round(tokens / (seconds - prefill), 3) if 0 < prefill < seconds else None,
        # llama-server's own clock (predicted_n / predicted_ms, no HTTP), to check the wall-clock figure.
        "server_decode_tokens_per_second": _server_decode_rate(runs),
        "mean_tokens_per_run": round(tokens / len(runs), 2) if runs else 0.0,
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_target_forwards": stats.num_target_forwards,
    }
    drafting = stats.num_drafts > 0
    # llama-server reports drafted and accepted tokens but not how many drafts: no mean length for it.
    out["acceptance_rate"] = round(stats.acceptance_rate, 4) if stats.num_draft_tokens else None
    out["mean_acceptance_length"] = (
        round(stats.mean_acceptance_length, 4) if drafting or not stats.num_draft_tokens else None
    )  # incl. bonus; 1.0 without drafts
    out["acceptance_rate_per_pos"] = [round(x, 4) for x in stats.acceptance_rate_per_pos]
    out["num_accepted_tokens_per_pos"] = list(stats.num_accepted_tokens_per_pos)
    out["num_drafts_per_pos"] = list(stats.num_drafts_per_pos)
    out["mean_k"] = round(stats.num_draft_tokens / stats.num_drafts, 3) if drafting else None
    out["tokens_per_target_forward"] = (
        round(stats.num_generated_tokens / stats.num_target_forwards, 4) if stats.num_target_forwards else None
    )

    # Cost ratio c against the single-token target forward of the matching plain baseline (exact_plain for
    # the exact_ methods: their target runs other kernels).
    exact = bool(method.get("exact"))
    own_plain = EXACT_BASELINE if exact else "plain"
    baseline = EXACT_BASELINE if exact else PEER_BASELINES.get(method["kind"], "plain")
    t_single = _single_forward_seconds(scope_runs, baseline) or _single_forward_seconds(scope_runs, "plain")
    out["target_single_forward_ms"] = _round(t_single * 1000 if t_single else None, 3)
    draft_calls = sum(r["draft_forwards"]["short_calls"] for r in runs)
    draft_secs = sum(r["draft_forwards"]["short_seconds"] for r in runs)
    c_forward = (draft_secs / draft_calls) / t_single if draft_calls and t_single else None
    c_per_token = (stats.draft_seconds / stats.num_draft_tokens) / t_single \
        if drafting and t_single and stats.draft_seconds > 0 else None
    out["draft_forward_ms"] = _round(draft_secs / draft_calls * 1000 if draft_calls else None, 3)
    out["cost_ratio_forward"] = _round(c_forward)
    out["cost_ratio_per_draft_token"] = _round(c_per_token)
    # The backends' counters (what `specdec generate` prints): draft forward incl. its prefill / plain step.
    counted_calls = sum(r["backend_counters"]["draft"]["calls"] for r in runs)
    counted_secs = sum(r["backend_counters"]["draft"]["seconds"] for r in runs)
    plain_runs = [r for r in scope_runs if r["method"] == own_plain]
    plain_stats = _merged_stats(plain_runs)
    t_plain_step = plain_stats.target_seconds / plain_stats.num_target_forwards if plain_stats.num_target_forwards else None
    out["cost_ratio_counters"] = _round(
        (counted_secs / counted_calls) / t_plain_step if counted_calls and t_plain_step and method["kind"] != "hf"
        else None
    )
    if method.get("uses_draft_model") and c_forward is not None:
        c, source = c_forward, "draft forward"
    else:
        c, source = c_per_token, ("drafting time per token" if c_per_token is not None else None)
    out["cost_ratio"] = _round(c)
    out["cost_ratio_source"] = source
    # Verify cost: a method's mean target pass in one-token passes of plain decoding (Leviathan assumes 1).
    t_step = stats.target_seconds / stats.num_target_forwards if stats.num_target_forwards else None
    verify_cost = t_step / t_plain_step if t_step and t_plain_step and method["kind"] == "specdec" else None
    out["verify_cost"] = _round(verify_cost)
    if drafting:
        k = method["k"] if method.get("fixed_k") and method.get("k") else stats.num_draft_tokens / stats.num_drafts
        out["k_for_bound"] = round(float(k), 3)
        out["leviathan_bound"] = round(leviathan_speedup(stats.acceptance_rate, k, c or 0.0), 4)
        out["cost_model_bound"] = round(
            leviathan_speedup(stats.acceptance_rate, k, c or 0.0, verify_cost), 4
        ) if verify_cost else None
        out["expected_tokens_per_step"] = round(
            (1 - stats.acceptance_rate ** (k + 1)) / (1 - stats.acceptance_rate) if stats.acceptance_rate < 1
            else k + 1, 4,
        )
    else:
        out["k_for_bound"] = out["leviathan_bound"] = out["expected_tokens_per_step"] = None
        out["cost_model_bound"] = None

    for key in (f"identical_to_{b}" for b in BASELINES):
        flags = [r[key] for r in runs if r.get(key) is not None]
        if flags:
            out[key] = all(flags)
            out[key.replace("identical", "num_identical")] = f"{sum(flags)}/{len(flags)}"
        else:
            out[key] = None
    out["finish_reasons"] = {
        reason: sum(1 for r in runs if r["finish_reason"] == reason) for reason in sorted({r["finish_reason"] for r in runs})
    }
    return out


def _scope_summary(methods: list[dict], runs: list[dict]) -> dict:
    table: dict[str, dict] = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method["name"]]
        if mine:
            table[method["name"]] = _method_summary(method, mine, runs)
    plain_runs = {(r["task"], r["prompt_id"], r["repeat"]): r for r in runs if r["method"] == "plain"}
    for name, row in table.items():
        for baseline in BASELINES:
            key = "speedup" if baseline == "plain" else f"speedup_vs_{baseline}"
            base = table.get(baseline, {}).get("tokens_per_second")
            # transformers' methods are also compared with hf_plain; every method with llama.cpp's plain
            # decoding, what a llama.cpp user would otherwise run.
            if baseline == "hf_plain" and not name.startswith("hf_"):
                continue
            if baseline == EXACT_BASELINE and not name.startswith(EXACT_PREFIX):
                continue  # the exact_ methods are also given over exact_plain, the others are not
            row[key] = round(row["tokens_per_second"] / base, 4) if base else None
        # Per-prompt speedups vary; their geometric mean is the Spec-Bench-style robust figure.
        ratios = []
        for run in (r for r in runs if r["method"] == name):
            base_run = plain_runs.get((run["task"], run["prompt_id"], run["repeat"]))
            if base_run and base_run["tokens_per_second"] > 0 and run["tokens_per_second"] > 0:
                ratios.append(run["tokens_per_second"] / base_run["tokens_per_second"])
        row["speedup_geomean"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 4) if ratios else None
    return table


def reference_method(overall: dict) -> str:
    """What the per-task ratios are taken over: llama.cpp's plain decoding when it ran (what a user would otherwise
    run), else ours."""
    return "llamacpp_plain" if "llamacpp_plain" in overall else "plain"


def relative_per_task(overall: dict, per_task: dict, tasks: list[str]) -> dict:
    """Each method's tokens/s over the reference's, per task and overall, and its worst task.

    The reference is reference_method(overall). A task where either has no runs gets None and is left out of
    the minimum; `tasks_measured` says how many tasks the minimum covers.
    """
    baseline = reference_method(overall)
    key = "speedup" if baseline == "plain" else f"speedup_vs_{baseline}"
    methods = [name for name in overall if name != baseline]
    table = {task: {name: per_task[task].get(name, {}).get(key) for name in methods} for task in tasks}
    worst: dict[str, dict | None] = {}
    for name in methods:
        measured = [(table[task][name], task) for task in tasks if table[task][name] is not None]
        lowest = min(measured, key=lambda pair: pair[0]) if measured else None
        worst[name] = None if lowest is None else {
            "ratio": lowest[0], "task": lowest[1], "tasks_measured": len(measured), "tasks": len(tasks),
        }
    return {
        "baseline": baseline,
        "baseline_tokens_per_second": {task: per_task[task].get(baseline, {}).get("tokens_per_second")
                                       for task in tasks},
        "per_task": table,
        "overall": {name: overall[name].get(key) for name in methods},
        "min": worst,
    }


def exact_vs_default(overall: dict, per_task: dict, tasks: list[str]) -> dict:
    """Each exact_<m> beside <m> (same method, default kernels): both tok/s and exact/default, per task and
    overall, and how many of its prompts were greedy-identical to exact_plain. {} without exact_ methods."""
    def pair(fast: dict | None, exact: dict | None) -> dict:
        fast_rate = (fast or {}).get("tokens_per_second")
        exact_rate = (exact or {}).get("tokens_per_second")
        return {"default_tokens_per_second": fast_rate, "exact_tokens_per_second": exact_rate,
                "ratio": round(exact_rate / fast_rate, 4) if fast_rate and exact_rate is not None else None}

    out = {}
    for name, row in overall.items():
        if not name.startswith(EXACT_PREFIX):
            continue
        default = name[len(EXACT_PREFIX):]
        entry = {"default": default if default in overall else None, "overall": pair(overall.get(default), row)}
        for key in ("decode_tokens_per_second", "prefill_tokens_per_second"):
            fast_value, exact_value = (overall.get(default) or {}).get(key), row.get(key)
            entry["overall"][f"default_{key}"] = fast_value
            entry["overall"][f"exact_{key}"] = exact_value
        entry["per_task"] = {task: pair(per_task[task].get(default), per_task[task].get(name)) for task in tasks}
        entry["identical_to_exact_plain"] = row.get(f"num_identical_to_{EXACT_BASELINE}")
        out[name] = entry
    return out


def fast_kernels_ran(results: dict) -> bool:
    """Whether our methods ran on llama.cpp's default fast kernels (the recorded target is not exact)."""
    target = (results.get("environment") or {}).get("target") or {}
    return target.get("backend") == "llama.cpp" and target.get("batch_invariant") is False


def greedy_differences(results: dict) -> dict:
    """Where greedy outputs part from their baseline, sorted by what it means.

    near_tie_flips: our default-kernel methods against plain on llama.cpp's fast kernels (allowed: a
    verification pass rounds differently from one-row passes; information). exact_mismatches: exact_
    methods against exact_plain (a bug). unexpected: any other of ours against plain (exact kernels: a
    bug, as is transformers' generate parting from plain or hf_plain). peers: llama.cpp's llama-server
    against plain or llamacpp_plain (its own batch-dependent kernels, not our engine).
    Each entry: {method: {"baseline", "prompts" differing, "of" prompts compared, "first_positions"}}.
    """
    kinds = {m["name"]: m.get("kind", "specdec") for m in results["config"]["methods"]}
    fast = fast_kernels_ran(results)
    out: dict[str, dict] = {"near_tie_flips": {}, "exact_mismatches": {}, "unexpected": {}, "peers": {}}
    for run in results["runs"]:
        name = run["method"]
        for baseline in BASELINES:
            flag = run.get(f"identical_to_{baseline}")
            if flag is None:
                continue
            if kinds.get(name) == "llamacpp":
                group = "peers"
            elif name.startswith(EXACT_PREFIX):
                group = "exact_mismatches"
            elif kinds.get(name) == "specdec" and fast:
                group = "near_tie_flips"
            else:
                group = "unexpected"  # ours (or transformers' on the same modules) on exact kernels
            entry = out[group].setdefault(f"{name} vs {baseline}", {
                "method": name, "baseline": baseline, "prompts": 0, "of": 0, "first_positions": []})
            entry["of"] += 1
            if flag is False:
                entry["prompts"] += 1
                index = run.get(f"first_mismatch_to_{baseline}")
                if index is not None:
                    entry["first_positions"].append(index)
    return {group: {key: entry for key, entry in entries.items() if entry["prompts"]}
            for group, entries in out.items()}


def summarise(results: dict) -> dict:
    methods = results["config"]["methods"]
    runs = results["runs"]
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    overall = _scope_summary(methods, runs)
    per_task = {task: _scope_summary(methods, [r for r in runs if r["task"] == task]) for task in tasks}
    reference = reference_method(overall)
    return {
        "overall": overall,
        "per_task": per_task,
        "tasks": tasks,
        "ceiling": ceiling_summary(results, overall, per_task),
        "relative_per_task": relative_per_task(overall, per_task, tasks),
        "paired_intervals": paired_intervals(runs, reference, list(overall), tasks),
        "noise_floor": noise_floor(runs, reference, tasks),
        "exact_vs_default": exact_vs_default(overall, per_task, tasks),
        "greedy_differences": greedy_differences(results),
        "definitions": {
            "tokens_per_second": "generated tokens / wall time of the generate calls (prefill included)",
            "prefill_tokens_per_second": "prompt tokens through the prefill / prefill seconds (our engine: "
                                         "target prompt pass + drafter setup; llama-server: "
                                         "timings.prompt_ms)",
            "decode_tokens_per_second": "generated tokens / (wall time - prefill seconds)",
            "server_decode_tokens_per_second": "llama-server's own predicted_n / predicted_ms (peers only)",
            "relative_per_task": "tokens/s in a task over the reference's (llamacpp_plain when it ran, else "
                                 "plain) in that task; min = the lowest over tasks",
            "speedup": "tokens/s over plain decoding (our engine, no drafter) on the same weights, same run",
            "speedup_vs_hf_plain": "tokens/s over transformers' own plain generate (hf_plain)",
            "speedup_vs_llamacpp_plain": "tokens/s over llama.cpp's llama-server plain decoding of the same GGUF",
            "speedup_vs_exact_plain": "exact_ methods: tokens/s over plain decoding on the exact kernels (exact_plain)",
            "exact_vs_default": "exact_<m>'s tokens/s over <m>'s (same method on the default fast kernels)",
            "greedy_differences": "near_tie_flips: ours on llama.cpp's fast kernels vs plain (allowed, information); "
                                  "exact_mismatches: exact_ methods vs exact_plain (a bug); unexpected: ours on "
                                  "exact kernels vs plain (a bug); peers: llama-server's methods",
            "speedup_geomean": "geometric mean over prompts of per-prompt speedup over plain",
            "mean_acceptance_length": "1 + accepted/drafts: tokens per target pass INCLUDING the bonus token",
            "acceptance_rate": "accepted draft tokens / drafted tokens",
            "cost_ratio": "c = draft forward / target single-token forward (module time via hooks); for "
                          "model-free drafters drafting seconds per drafted token / target single-token forward",
            "leviathan_bound": "(1 - a^(k+1)) / ((1 - a)(k c + 1)) from measured a, k and c",
            "verify_cost": "v = a method's mean target pass / plain decoding's one-token pass (Leviathan assumes 1)",
            "cost_model_bound": "(1 - a^(k+1)) / ((1 - a)(k c + v)): the bound at the measured verify cost",
        },
    }


# -- markdown -------------------------------------------------------------------------------------------------

def _identical_cell(row: dict, near_ties: bool = False) -> str:
    """yes/**NO** (identical/compared) per baseline; near_ties: a difference from plain is a near-tie flip of the
    fast kernels, shown as such rather than as **NO**."""
    cells = []
    if row.get("identical_to_plain") is not None:
        flag = "no: near-tie flips" if near_ties and row["identical_to_plain"] is False \
            else format_cell(row["identical_to_plain"])
        cells.append(f"{flag} ({row['num_identical_to_plain']})")
    for baseline in BASELINES[1:]:
        if row.get(f"identical_to_{baseline}") is not None:
            cells.append(f"vs {baseline} {format_cell(row[f'identical_to_{baseline}'])} "
                         f"({row[f'num_identical_to_{baseline}']})")
    return "; ".join(cells) if cells else ("baseline" if row.get("is_baseline") else "–")


def _peer_columns(summary: dict) -> list[str]:
    """The peer baselines present in this run (their speedup columns are shown)."""
    return [b for b in BASELINES[1:] if b in summary["overall"]]


def _differences(results_or_summary: dict) -> dict:
    """The summary's greedy_differences (computed here for results written before it existed)."""
    summary = results_or_summary.get("summary", results_or_summary)
    if "greedy_differences" in summary:
        return summary["greedy_differences"]
    if "runs" in results_or_summary:
        return greedy_differences(results_or_summary)
    return {}


def _flipping_methods(summary: dict) -> set[str]:
    return {entry["method"] for entry in _differences(summary).get("near_tie_flips", {}).values()}


def method_table(summary: dict) -> str:
    peers = _peer_columns(summary)
    flipping = _flipping_methods(summary)
    lines = [
        ("| method | tok/s | prefill tok/s | decode tok/s | speedup vs plain | "
         + "".join(f"vs {b} | " for b in peers)
         + "accept rate | mean accept len (incl. bonus) "
        "| k (mean) | c | verify cost | Leviathan bound | bound at verify cost | greedy identical |"),
        "|---|---:|---:|---:|---:|" + "---:|" * len(peers) + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in summary["overall"].items():
        peer_cells = "".join(f"| {format_cell(row.get(f'speedup_vs_{b}'), '.2f', 'x')} " for b in peers)
        lines.append(
            f"| {name} | {format_cell(row['tokens_per_second'])} "
            f"| {format_cell(row.get('prefill_tokens_per_second'), '.1f')} "
            f"| {format_cell(row.get('decode_tokens_per_second'))} "
            f"| {format_cell(row.get('speedup'), '.2f', 'x')} {peer_cells}| {format_cell(row['acceptance_rate'], '.3f')} "
            f"| {format_cell(row['mean_acceptance_length'], '.2f')} | {format_cell(row['mean_k'], '.1f')} "
            f"| {format_cell(row['cost_ratio'], '.3f')} | {format_cell(row.get('verify_cost'), '.2f')} "
            f"| {format_cell(row['leviathan_bound'], '.2f', 'x')} | {format_cell(row.get('cost_model_bound'), '.2f', 'x')} "
            f"| {_identical_cell({**row, 'is_baseline': name in ('plain', EXACT_BASELINE)}, name in flipping)} |"
        )
    return "\n".join(lines)


def task_table(summary: dict, baseline: str = "plain") -> str:
    """Spec-Bench style: speedup over `baseline` per task, overall, and mean acceptance length."""
    key = "speedup" if baseline == "plain" else f"speedup_vs_{baseline}"
    tasks = summary["tasks"]
    header = "| method | " + " | ".join(tasks) + " | overall | mean accept len (incl. bonus) | tok/s |"
    lines = [header, "|---|" + "---:|" * (len(tasks) + 3)]
    for name, row in summary["overall"].items():
        if row.get(key) is None:
            continue
        cells = [format_cell(summary["per_task"][t].get(name, {}).get(key), ".2f", "x") for t in tasks]
        lines.append(
            f"| {name} | " + " | ".join(cells)
            + f" | {format_cell(row.get(key), '.2f', 'x')} | {format_cell(row['mean_acceptance_length'], '.2f')} "
            f"| {format_cell(row['tokens_per_second'])} |"
        )
    return "\n".join(lines)


def category_table(summary: dict) -> str:
    """Rows = tasks (Spec-Bench categories, code tasks), columns = each method's tokens/s over the reference's
    in that task; then the overall ratio and each method's minimum over the tasks (and the task it is in)."""
    relative = _relative(summary)
    baseline, methods = relative["baseline"], list(relative["overall"])
    lines = [f"| task | {baseline} tok/s | " + " | ".join(methods) + " |",
             "|---|---:|" + "---:|" * len(methods)]
    for task in summary["tasks"]:
        cells = [format_cell(relative["per_task"][task][name], ".2f", "x") for name in methods]
        lines.append(f"| {task} | {format_cell(relative['baseline_tokens_per_second'][task])} | "
                     + " | ".join(cells) + " |")
    overall_rate = summary["overall"].get(baseline, {}).get("tokens_per_second")
    lines.append(f"| **overall** | {format_cell(overall_rate)} | "
                 + " | ".join(format_cell(relative["overall"][name], ".2f", "x") for name in methods) + " |")
    lines.append("| **min over tasks** | | "
                 + " | ".join(_worst_cell(relative["min"][name]) for name in methods) + " |")
    return "\n".join(lines)


def exact_table(summary: dict) -> str:
    """Rows = tasks, then overall; for each exact_<m>: <m>'s tok/s (default kernels), exact_<m>'s, and exact over
    default. The last row: how many prompts each exact method reproduced exact_plain on. "" without exact_."""
    pairs = summary.get("exact_vs_default") or {}
    if not pairs:
        return ""
    header, rule = "| task |", "|---|"
    for name, entry in pairs.items():
        header += f" {entry['default'] or name[len(EXACT_PREFIX):]} | {name} | exact/default |"
        rule += "---:|---:|---:|"
    lines = [header, rule]

    def cells(pair: dict) -> str:
        return (f" {format_cell(pair['default_tokens_per_second'])} | {format_cell(pair['exact_tokens_per_second'])} "
                f"| {format_cell(pair['ratio'], '.2f', 'x')} |")

    for task in summary["tasks"]:
        lines.append(f"| {task} |" + "".join(cells(entry["per_task"][task]) for entry in pairs.values()))
    lines.append("| **overall** |" + "".join(cells(entry["overall"]) for entry in pairs.values()))
    identity = []
    for name, entry in pairs.items():
        same = "baseline" if name == EXACT_BASELINE else (entry.get("identical_to_exact_plain") or "–")
        identity.append(f" | {same} | |")
    lines.append("| **greedy identical to exact_plain** |" + "".join(identity))
    return "\n".join(lines)


def _relative(summary: dict) -> dict:
    # Summaries written before relative_per_task existed get it computed here.
    return summary.get("relative_per_task") or relative_per_task(
        summary["overall"], summary["per_task"], summary["tasks"])


def _worst_cell(worst: dict | None) -> str:
    if worst is None:
        return "–"
    # A minimum over fewer tasks than ran is weaker evidence: say how many it covers.
    measured, ran = worst["tasks_measured"], worst["tasks"]
    partial = f"; {measured}/{ran} tasks" if measured < ran else ""
    return f"{worst['ratio']:.2f}x ({worst['task']}{partial})"


def task_acceptance_table(summary: dict) -> str:
    tasks = summary["tasks"]
    lines = ["| method | " + " | ".join(f"{t} accept rate / len" for t in tasks) + " |",
             "|---|" + "---:|" * len(tasks)]
    for name in summary["overall"]:
        cells = []
        for t in tasks:
            row = summary["per_task"][t].get(name)
            cells.append("–" if not row or row["acceptance_rate"] is None
                         else f"{row['acceptance_rate']:.3f} / {format_cell(row['mean_acceptance_length'])}")
        if any(c != "–" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def position_table(summary: dict) -> str:
    rows = {n: r["acceptance_rate_per_pos"] for n, r in summary["overall"].items() if r["acceptance_rate_per_pos"]}
    if not rows:
        return ""
    width = min(max(len(v) for v in rows.values()), 12)
    lines = ["| method | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |",
             "|---|" + "---:|" * width]
    for name, values in rows.items():
        cells = [f"{v:.2f}" if i < len(values) else "" for i, v in enumerate(values[:width])]
        cells += [""] * (width - len(cells))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_DIFFERENCE_KINDS = {  # greedy_differences group -> (the mismatch table's label, order: bugs first)
    "exact_mismatches": ("**bug**: exact mode", 0),
    "unexpected": ("**bug**: exact kernels", 1),
    "near_tie_flips": ("near-tie flip (fast kernels)", 2),
    "peers": ("llama.cpp's kernels", 3),
}


def mismatch_lines(results: dict, limit: int = 30) -> list[str]:
    """Where greedy outputs diverge: prompt, method, token index, the two tokens (a near-tie shows here) and
    what the difference means; bugs first, so a long list of near-tie flips cannot hide one."""
    groups = {key: group for group, entries in _differences(results).items() for key in entries}
    lines = ["| prompt | method | vs | first differing token | method's token | baseline's token | kind |",
             "|---|---|---|---:|---|---|---|"]
    rows = []
    for run in results["runs"]:
        for baseline in BASELINES:
            detail = run.get(f"mismatch_to_{baseline}")
            if not detail:
                continue
            label, order = _DIFFERENCE_KINDS.get(groups.get(f"{run['method']} vs {baseline}"), ("", 4))
            rows.append((order, (
                f"| {run['task']}/{run['prompt_id']} | {run['method']} | {baseline} | {detail['index']} "
                f"| `{detail['method_text']!r}` ({detail['method_token']}) "
                f"| `{detail['baseline_text']!r}` ({detail['baseline_token']}) | {label} |"
            )))
    rows.sort(key=lambda row: row[0])  # stable: run order within a kind
    lines += [line for _, line in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"| … | {len(rows) - limit} more in results.json | | | | | |")
    return lines


def _difference_list(entries: dict) -> str:
    """"adaptive 2/45 prompts (first differing tokens at 37, 101)", one per method and baseline."""
    parts = []
    for entry in entries.values():
        positions = ", ".join(map(str, entry["first_positions"][:8])) + (
            ", …" if len(entry["first_positions"]) > 8 else "")
        vs = "" if entry["baseline"] == "plain" else f" vs {entry['baseline']}"
        parts.append(f"`{entry['method']}`{vs} {entry['prompts']}/{entry['of']} prompts "
                     f"(first differing token at {positions or '?'})")
    return "; ".join(parts)


def difference_lines(results: dict) -> list[str]:
    """The report's paragraphs on greedy differences: warnings for what must be identical, information for the
    fast kernels' near-tie flips and for llama.cpp's peers."""
    differences = _differences(results)
    lines: list[str] = []
    if differences.get("exact_mismatches"):
        lines += ["", (f"**Warning:** exact-mode greedy output differs from `{EXACT_BASELINE}` for: "
                       f"{_difference_list(differences['exact_mismatches'])}. `--exact` promises output "
                       "bit-identical to plain decoding with the exact kernels: this is a bug."), ""]
    if differences.get("unexpected"):
        lines += ["", ("**Warning:** greedy output differs from the baseline for: "
                       f"{_difference_list(differences['unexpected'])}. These ran on exact kernels, where "
                       "greedy speculative decoding must reproduce plain decoding: this is a bug."), ""]
    if differences.get("near_tie_flips"):
        lines += ["", ("Near-tie flips of the fast kernels (information, not a bug): greedy output differs from "
                       f"`plain` for {_difference_list(differences['near_tie_flips'])}. On llama.cpp's default "
                       "fast kernels a verification pass of several rows rounds differently from the one-row "
                       "passes of plain decoding, so where two tokens nearly tie the argmax can flip and the "
                       "outputs part from there; the output still follows the target's distribution. "
                       "`--exact` (the exact_ methods here) is the bit-identical mode."), ""]
    if differences.get("peers"):
        names = ", ".join(dict.fromkeys(e["method"] for e in differences["peers"].values()))
        lines += ["", (f"llama.cpp's greedy output differs from a baseline for: {names} "
                       "(llama.cpp's batch-dependent kernels, not specdec's engine)."), ""]
    if any(differences.values()):
        lines += mismatch_lines(results)
    return lines


def _runtime(env: dict) -> str:
    target = env.get("target") or {}
    if target.get("backend") == "llama.cpp":
        invariant = "exact (batch-invariant)" if target.get("batch_invariant") else "default fast (batch-dependent)"
        exact = " and, for the exact_ methods, the same target on exact kernels" if env.get("exact_target") else ""
        return (f"llama.cpp (llama-cpp-python {target.get('llama_cpp_python')}, {target.get('threads')} threads, "
                f"{invariant} kernels{exact})")
    return f"torch {env['torch']}, transformers {env['transformers']}, {env['torch_threads']} torch threads"


def to_markdown(results: dict, title: str = "specdec bench") -> str:
    config, env, summary = results["config"], results["environment"], results["summary"]
    sampling = config["sampling"]
    target = (env.get("target") or {}).get("name", "?")
    draft = (env.get("draft") or {}).get("name") or "none"
    decoding = "greedy" if sampling["greedy"] else f"sampled (T={sampling['temperature']}, seed={sampling['seed']})"
    relative = _relative(summary)
    lines = [
        f"# {title}",
        "",
        (f"- target `{target}`, draft `{draft}`, weights {env.get('weight_format') or '?'}"
         f"{' (draft ' + config['draft_weight_format'] + ')' if config.get('draft_weight_format') else ''}; "
        f"{_runtime(env)}; {env.get('cpu_model') or env['cpu_count']} "
        f"({env['cpu_count']} CPUs){', CUDA' if env.get('cuda') else ''}"),
        (f"- tasks {', '.join(summary['tasks'])}; {config['num_prompts']} prompts, {config['repeats']} repeat(s), "
        f"{decoding}, max {sampling['max_tokens']} new tokens"
        f"{', ignore EOS' if sampling['ignore_eos'] else ', stop at EOS'}; "
        f"{'chat template' if config['chat'] else 'raw completion prompts'}"),
        ("- methods interleaved per prompt (order rotated), each warmed up once before timing; "
        f"wall time {results.get('wall_seconds', 0):.0f}s"),
        "",
        "## Per method (all tasks)",
        "",
        method_table(summary),
        "",
        f"## tok/s per task relative to {relative['baseline']}",
        "",
        (f"Each method's tok/s in a task over `{relative['baseline']}`'s in the same task (its own tok/s in "
         "the second column); overall = over all prompts; min = the lowest task ratio and its task."),
        "",
        category_table(summary),
        "",
        *(paired_markdown(summary["paired_intervals"], relative["baseline"]) if summary.get("paired_intervals")
          else []),
        *noise_floor_markdown(summary.get("noise_floor")),
        *speed_and_length_markdown(summary, relative["baseline"], list(relative["overall"])),
        *([
            "## --exact beside the default kernels",
            "",
            ("Each exact_ method (our method on a second target loaded with llama.cpp's exact, batch-invariant "
             "kernels: what `--exact` runs) beside the same method on the default fast kernels, tok/s per task "
             "and overall; exact/default below 1 is the exact mode's cost. The last row: prompts on which its "
             f"greedy output equals `{EXACT_BASELINE}`'s (must be all)."),
            "",
            exact_table(summary),
            "",
        ] if summary.get("exact_vs_default") else []),
        "## Speedup per task (Spec-Bench style)",
        "",
        task_table(summary),
        *([
            "",
            "## Speedup per task over llama.cpp's plain decoding (llama-server, same GGUF, same threads)",
            "",
            task_table(summary, "llamacpp_plain"),
        ] if "llamacpp_plain" in summary["overall"] else []),
        "",
        task_acceptance_table(summary),
        "",
    ]
    if summary.get("ceiling"):
        lines += ceiling_markdown(summary["ceiling"], summary["tasks"])
    positions = position_table(summary)
    if positions:
        lines += ["## Acceptance rate per draft position", "", "P(position i accepted | a draft reached it).", "",
                  positions, ""]
    lines += [
        ("Speedup = tokens/s over `plain` (our engine without a drafter, same weights, same run); tokens/s = "
        "generated tokens / wall time incl. prefill; prefill tok/s = prompt tokens through the prefill / "
        "prefill seconds (ours: the target's prompt pass plus the drafter's setup, e.g. the draft model's "
        "prefill; llama-server: its own prompt_ms); decode tok/s = generated tokens / (wall time - prefill "
        "seconds). "
        "Mean acceptance length = 1 + accepted/drafts: tokens per "
        "target pass **including the bonus token** (plain = 1.00). c = draft forward / target single-token "
        "forward (drafting time per drafted token for model-free drafters). Leviathan bound = "
        "(1 - a^(k+1)) / ((1 - a)(k c + 1)) from the measured a, k and c; it assumes verifying k+1 tokens "
        "costs one plain step. Verify cost v = the method's mean target pass in plain steps, and the bound at "
        "that cost = (1 - a^(k+1)) / ((1 - a)(k c + v)). Greedy identical = token-for-token "
        "equal to `plain` on every prompt (transformers' methods also against `hf_plain`, llama.cpp's "
        "against `llamacpp_plain`; the exact_ methods against `exact_plain` only)."),
    ]
    if "llamacpp_plain" in summary["overall"]:
        lines += ["", ("llama.cpp's peers (`llamacpp_*`): tokens/s from the wall time of each `/completion` "
                       "call, accept rate = llama-server's draft_n_accepted / draft_n (it reports no draft "
                       "count, so no mean length). Their speculative greedy output is not guaranteed to "
                       "equal llama.cpp's plain output: its batched and single-token kernels round "
                       "differently and flip near-ties; the identity column shows where.")]
    lines += difference_lines(results)
    if results.get("skipped_methods"):
        lines += ["", "Skipped methods: " + "; ".join(f"{k} ({v})" for k, v in results["skipped_methods"].items())]
    if results.get("skipped_prompts"):
        lines += ["", f"Skipped {len(results['skipped_prompts'])} prompt(s) that do not fit the context."]
    return "\n".join(lines) + "\n"


def write_results(results: dict, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (with matplotlib) bench.png into out_dir; return their paths."""
    from specdec.bench.plot import plot_results

    return write_outputs(results, out_dir, to_markdown(results), plot_results if plot else None, "bench.png")


def write_outputs(results: dict, out_dir: str | Path, markdown: str, plot_fn=None, png_name: str = "bench.png"
                  ) -> dict[str, Path]:
    """results.json, results.md (`markdown`) and, given plot_fn(results, path), a plot into out_dir; their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown, encoding="utf-8")
    if plot_fn is not None:
        png = plot_fn(results, out / png_name)
        if png is not None:
            paths["plot"] = png
    return paths


def threads_table(by_threads: dict) -> str:
    """Rows = methods; for each thread count, tokens/s over the reference overall and in the worst task."""
    counts = list(by_threads)
    relatives = {n: _relative(by_threads[n]["summary"]) for n in counts}
    methods = list(dict.fromkeys(name for n in counts for name in relatives[n]["overall"]))
    header = "| method | " + " | ".join(
        f"{n} thr: overall vs {relatives[n]['baseline']} | {n} thr: min over tasks" for n in counts) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(counts)]
    for name in methods:
        cells = []
        for n in counts:
            cells.append(format_cell(relatives[n]["overall"].get(name), ".2f", "x"))
            cells.append(_worst_cell(relatives[n]["min"].get(name)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exact_threads_table(by_threads: dict) -> str:
    """Rows = exact_ methods; per thread count the default method's tok/s, the exact one's and their ratio
    (overall), and its greedy identity to exact_plain. "" when no count ran an exact_ method."""
    pairs = {n: r["summary"].get("exact_vs_default") or {} for n, r in by_threads.items()}
    names = list(dict.fromkeys(name for entries in pairs.values() for name in entries))
    if not names:
        return ""
    counts = list(by_threads)
    lines = ["| method | " + " | ".join(
        f"{n} thr: default tok/s | {n} thr: exact tok/s | {n} thr: exact/default | {n} thr: identical to "
        f"{EXACT_BASELINE}" for n in counts) + " |", "|---|" + "---:|---:|---:|---:|" * len(counts)]
    for name in names:
        cells = []
        for n in counts:
            entry = pairs[n].get(name)
            overall = entry["overall"] if entry else {}
            same = "baseline" if name == EXACT_BASELINE else ((entry or {}).get("identical_to_exact_plain") or "–")
            cells += [format_cell(overall.get("default_tokens_per_second")),
                      format_cell(overall.get("exact_tokens_per_second")),
                      format_cell(overall.get("ratio"), ".2f", "x"), same]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_markdown_by_threads(by_threads: dict) -> str:
    """One report for a run per thread count: the overview across counts, then each count's full report."""
    counts = ", ".join(str(n) for n in by_threads)
    lines = [
        f"# specdec bench at {counts} threads",
        "",
        ("Each thread count ran the whole method matrix on models loaded with that many threads "
         "(llama-server peers started with it), one count after the other; the full tables of each follow."),
        "",
        "## tok/s relative to the reference, overall and in the worst task, per thread count",
        "",
        threads_table(by_threads),
        "",
    ]
    exact = exact_threads_table(by_threads)
    if exact:
        lines += ["## --exact beside the default kernels, per thread count", "",
                  "Each exact_ method's tok/s beside the same method on the default kernels, over all prompts.",
                  "", exact, ""]
    for n, results in by_threads.items():
        part = to_markdown(results, title=f"{n} thread{'s' if n != 1 else ''}")
        lines += [("#" + line if line.startswith("#") else line) for line in part.splitlines()] + [""]
    return "\n".join(lines)


def write_results_by_threads(by_threads: dict, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Each thread count's results in out_dir/threads-N/ (as write_results), the combined results.md, and
    threads.json: the thread counts, where each count's results.json is, each count's per-task ratios."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for n, results in by_threads.items():
        for kind, path in write_results(results, out / f"threads-{n}", plot=plot).items():
            paths[f"{kind} ({n} threads)"] = path
    index = {
        "thread_counts": list(by_threads),
        "results": {str(n): f"threads-{n}/results.json" for n in by_threads},
        "relative_per_task": {str(n): r["summary"].get("relative_per_task") for n, r in by_threads.items()},
    }
    paths["index"] = out / "threads.json"
    paths["index"].write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    paths["markdown"] = out / "results.md"
    paths["markdown"].write_text(to_markdown_by_threads(by_threads), encoding="utf-8")
    return paths


__all__ = [
    "category_table", "difference_lines", "exact_table", "exact_threads_table", "exact_vs_default",
    "greedy_differences", "method_table", "position_table", "reference_method", "relative_per_task", "summarise",
    "task_table", "threads_table", "to_markdown", "to_markdown_by_threads", "write_results", "write_results_by_threads",
]
