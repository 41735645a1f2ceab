"""tune.md, tune.json, tuned.json and the plots: the ranked table with each paired speedup's confidence interval and
the Leviathan bound beside it, speedup per task, acceptance per draft position, drafts that could not be used, and
the winner's config (drafter none when the answer is not to speculate)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from specdec.bench.cells import format_cell
from specdec.bench.method.render import write_results
from specdec.cli.run_config import write_run_config
from specdec.config import ModelRef
from specdec.tune.plot import plot_acceptance_by_position, plot_speedup_vs_rejection
from specdec.tune.ranking import never_drafted
from specdec.tune.run import TuneResult


def interval_cell(row: dict) -> str:
    """'1.08x [1.02, 1.14]' (paired speedup and its interval), or why there is no interval."""
    interval = row.get("speedup_interval")
    if interval:
        return f"{interval['estimate']:.2f}x [{interval['low']:.2f}, {interval['high']:.2f}]"
    runs = row.get("paired_runs")
    return f"{format_cell(row.get('speedup_paired'), '.2f', 'x')} (no interval: {runs} paired run)" \
        if runs else "–"


def above_bound_text(row: dict) -> str:
    """The warning for a speedup measured above the configuration's own bound."""
    if never_drafted(row):
        why = "it never drafted, so it decoded plainly and the difference is timing noise"
    else:
        why = ("the bound assumes independent acceptance and exact costs: timing noise, or acceptance that "
               "comes in runs")
    return (f"{row['candidate']} measured {row['above_bound']:.2f}x, above its own bound of "
            f"{row['own_bound']:.2f}x ({why})")


def ranked_table(result: TuneResult) -> str:
    confidence = next((r["speedup_interval"]["confidence"] for r in result.rows if r.get("speedup_interval")), 0.95)
    lines = [
        (f"| rank | draft | drafter | k policy | speedup | paired speedup [{confidence:.0%} CI] | Leviathan bound "
         "| bound at verify cost | accept rate | mean accept len (incl. bonus) | mean k | c | verify cost "
         "| greedy identical | verdict |"),
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result.rows:
        verdict = row["verdict"]
        if row["slower"] or verdict.startswith("NOT"):
            verdict = f"**{verdict}**"
        if row.get("above_bound") is not None:
            verdict += f"; **above its bound of {row['own_bound']:.2f}x**"
        identical = row.get("identical_to_plain")
        bound = row.get("own_bound", row["leviathan_bound"])  # 1.0 for a configuration that never drafted
        lines.append(
            f"| {row['rank']} | {row['draft'] or '–'} | {row['drafter']} | {_policy(row)} "
            f"| {format_cell(row['speedup'], '.2f', 'x')} | {interval_cell(row)} | {format_cell(bound, '.2f', 'x')} "
            f"| {format_cell(row['cost_model_bound'], '.2f', 'x')} | {format_cell(row['acceptance_rate'], '.3f')} "
            f"| {format_cell(row['mean_acceptance_length'])} | {format_cell(row['mean_k'], '.1f')} | {format_cell(row['cost_ratio'], '.3f')} "
            f"| {format_cell(row['verify_cost'])} | {format_cell(identical)}"
            f"{' (' + row['num_identical_to_plain'] + ')' if identical is not None else ''} | {verdict} |"
        )
    return "\n".join(lines)


def _policy(row: dict) -> str:
    return {"fixed": f"fixed k={row['k']}", "adaptive": f"adaptive k≤{row['k']}",
            "heuristic": f"heuristic from k={row['k']}"}.get(row["k_policy"], row["k_policy"])


def task_table(result: TuneResult) -> str:
    tasks = result.info.get("tasks") or []
    lines = ["| rank | configuration | " + " | ".join(tasks) + " | all |", "|---:|---|" + "---:|" * (len(tasks) + 1)]
    for row in result.rows:
        cells = [format_cell(row["speedup_per_task"].get(t), ".2f", "x") for t in tasks]
        lines.append(f"| {row['rank']} | {row['candidate']} | " + " | ".join(cells)
                     + f" | {format_cell(row['speedup'], '.2f', 'x')} |")
    return "\n".join(lines)


def position_table(result: TuneResult) -> str:
    rows = [r for r in result.rows if r.get("acceptance_rate_per_pos")]
    if not rows:
        return ""
    width = min(max(len(r["acceptance_rate_per_pos"]) for r in rows), 12)
    lines = ["| rank | configuration | " + " | ".join(f"pos {i + 1}" for i in range(width)) + " |",
             "|---:|---|" + "---:|" * width]
    for row in rows:
        values = row["acceptance_rate_per_pos"][:width]
        cells = [f"{v:.2f}" for v in values] + [""] * (width - len(values))
        lines.append(f"| {row['rank']} | {row['candidate']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_markdown(result: TuneResult, config_path: str | None = None) -> str:
    info, rec = result.info, result.recommendation
    sampling = info.get("sampling") or {}
    decoding = "greedy" if not sampling.get("temperature") else f"sampled (T={sampling['temperature']})"
    lines = [
        "# specdec tune",
        "",
        (f"- target `{info.get('target')}`; {info.get('num_prompts')} prompts ({', '.join(info.get('tasks') or [])}), "
         f"{decoding}, max {sampling.get('max_tokens')} new tokens, {info.get('repeats', 1)} repeat(s)"),
        ("- each draft model measured in its own bench run with plain decoding in the same run (methods "
         "interleaved per prompt, order rotated, one warm-up each); model-free drafters join the first run"),
        "",
        f"**Recommendation:** {rec.reason}.",
    ]
    if config_path and rec.speculate:
        lines += ["", f"Written to `{config_path}`: `specdec generate --config {config_path}` (also serve, bench)."]
    elif config_path:
        lines += ["", f"Written to `{config_path}` as drafter `none` (plain decoding): `specdec generate --config "
                      f"{config_path}` decodes plainly (also serve, bench)."]
    slower = [r["candidate"] for r in result.rows if r["slower"]]
    if slower:
        lines += ["", f"**Slower than plain decoding** (the whole interval below 1): {'; '.join(slower)}."]
    above = [above_bound_text(r) for r in result.rows if r.get("above_bound") is not None]
    if above:
        lines += ["", "**Measured above its own bound:**", ""] + [f"- {text}" for text in above]
    lines += ["", "## Ranked by what the paired runs show, then by paired speedup", "", ranked_table(result), ""]
    if result.rows and len(info.get("tasks") or []) > 1:
        lines += ["## Speedup per task", "", task_table(result), ""]
    ceilings = [r for r in result.rows if r.get("ceiling") is not None]
    if ceilings:
        lines += ["## What a perfect drafter would buy here", "",
                  ("On the target's measured pass costs, a drafter whose every token is accepted would speed decoding "
                   "up by the ceiling (at its best k up to the configuration's maximum); reached = decode tok/s over "
                   "plain decoding's (prefill excluded), share = reached / ceiling."), "",
                  "| configuration | ceiling (at k) | reached | share | rows per token |", "|---|---:|---:|---:|---:|"]
        for r in ceilings:
            reached = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") else "–"
            share = f"{100 * r['share_of_ceiling']:.0f}%" if r.get("share_of_ceiling") is not None else "–"
            rows = f"{r['rows_per_token']:.2f}" if r.get("rows_per_token") is not None else "–"
            lines.append(f"| {r['candidate']} | {r['ceiling']:.2f}x ({r['ceiling_k']}) | {reached} | {share} | {rows} |")
        lines.append("")
    positions = position_table(result)
    if positions:
        lines += ["## Acceptance by draft position", "", "P(position i accepted | a draft reached it).", "",
                  positions, ""]
    if result.unusable:
        lines += ["## Drafts that cannot be used with this target", ""]
        lines += [f"- `{u['draft']}`: {u['reason']}" for u in result.unusable]
        lines.append("")
    for note in info.get("notes") or []:
        lines += [f"Note: {note}.", ""]
    lines.append(
        "Speedup = tokens/s over plain decoding (our engine without a drafter, same target, same run; prefill "
        "included). Paired speedup = geometric mean over interleaved turns (a prompt and repeat run by plain "
        "decoding and the configuration one after the other) of their tokens/s ratio, with a Student-t "
        "confidence interval on its logarithm; prompt-to-prompt differences count as noise. A configuration is "
        "faster than plain only when it drafted and its whole interval lies above 1, slower only when it lies "
        "below 1; otherwise it is no faster than plain. Leviathan bound = (1 - a^(k+1)) / ((1 - a)(k c + 1)) "
        "from the measured acceptance a, k (the "
        "mean drafted length for adaptive and heuristic policies) and cost ratio c; it assumes verifying k+1 "
        "tokens costs one plain step. The bound at verify cost puts the measured verify cost v in place of 1. "
        "Mean acceptance length = 1 + accepted/drafts: tokens per target pass **including the bonus token**. "
        "c = draft forward / target single-token forward (drafting time per drafted token for prompt lookup "
        "and hybrid). Each run's full bench tables are under runs/."
    )
    return "\n".join(lines) + "\n"


def tuned_model_ref(base: ModelRef, result: TuneResult) -> ModelRef:
    """The tune run's model settings with the winner's draft (none for model-free drafters or plain)."""
    return replace(base, draft=result.recommendation.draft_reference)


def write_outputs(result: TuneResult, out_dir: str | Path, base_ref: ModelRef | None = None,
                  config_path: str | Path | None = None, plot: bool = True) -> dict[str, Path]:
    """Write tune.json, tune.md, runs/<n>-<label>/results.{json,md}, the two plots and (with base_ref) the
    winner's config file (default out_dir/tuned.json). Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for number, run in enumerate(result.runs, 1):
        slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in run["label"])[-60:]
        paths[f"run{number}"] = write_results(run["results"], out / "runs" / f"{number}-{slug}", plot=False)["markdown"]
    if base_ref is not None:
        config_path = Path(config_path) if config_path else out / "tuned.json"
        rec = result.recommendation
        paths["config"] = write_run_config(
            config_path, tuned_model_ref(base_ref, result), rec.spec,
            info={**rec.to_dict(), "prompts": result.info.get("num_prompts"), "tasks": result.info.get("tasks"),
                  "repeats": result.info.get("repeats")},
        )
    paths["json"] = out / "tune.json"
    paths["json"].write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
    paths["markdown"] = out / "tune.md"
    paths["markdown"].write_text(to_markdown(result, str(paths.get("config")) if "config" in paths else None),
                                 encoding="utf-8")
    if plot:
        for key, draw, name in (("plot_speedup", plot_speedup_vs_rejection, "speedup_vs_rejection.png"),
                                ("plot_positions", plot_acceptance_by_position, "acceptance_by_position.png")):
            drawn = draw(result, out / name)
            if drawn is not None:
                paths[key] = drawn
    return paths


__all__ = ["above_bound_text", "interval_cell", "position_table", "ranked_table", "task_table", "to_markdown",
           "tuned_model_ref", "write_outputs"]
