"""Aggregate raw bench runs per method, overall and per task: tokens/s, speedups, acceptance, the Leviathan bound and greedy
differences, as one summary dict (the definitions: bench/method/render.py's docstring and docs/bench.md)."""

from __future__ import annotations

import math

from specdec.bench.method.ceiling import ceiling_summary
from specdec.bench.method.methods import BASELINES, EXACT_BASELINE, EXACT_PREFIX, PEER_BASELINES
from specdec.bench.method.paired import noise_floor, paired_intervals
from specdec.bench.method.records import stats_from_raw
from specdec.core.stats import SpecStats, leviathan_speedup


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
