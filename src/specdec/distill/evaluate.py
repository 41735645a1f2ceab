"""Before/after evaluation of a draft on held-out prompts with the bench runner, and the distillation report.

Each draft is measured by specdec.bench (the same runner, warm-up, interleaving and summary formulas as
`specdec bench`): plain decoding and the chosen speculative methods on one loaded target, so a speedup is
always over plain decoding in the same run. The report puts the two summaries side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specdec.bench.cells import format_cell
from specdec.bench.datasets import BenchPrompt
from specdec.bench.method.methods import MethodOptions, resolve_methods
from specdec.bench.method.render import write_results
from specdec.bench.method.runner import BenchConfig, run_bench
from specdec.config import SamplingParams
from specdec.decoder import SpecDecoder

DEFAULT_EVAL_METHODS = "spec_k4"
_COLUMNS = (
    ("acceptance_rate", "accept rate", ".3f"),
    ("mean_acceptance_length", "mean accept len (incl. bonus)", ".2f"),
    ("speedup", "speedup vs plain", ".2f"),
    ("tokens_per_second", "tok/s", ".2f"),
)


def eval_methods(text: str | None = None, k_max: int = 8):
    """Bench methods for the evaluation (plain is always added): every one needs only our engine and a draft."""
    methods, _ = resolve_methods(text or DEFAULT_EVAL_METHODS, MethodOptions(k_max=k_max), has_draft_model=True)
    others = [m.name for m in methods if m.kind != "specdec"]
    if others:
        raise ValueError(f"--eval-methods takes our engine's methods only, not {', '.join(others)}")
    return methods


def evaluate_draft(target, draft, prompts: Sequence[BenchPrompt], methods, params: SamplingParams | None = None,
                   chat: bool | None = None, extra: dict | None = None, log=None) -> dict:
    """Bench results (with their summary) of one draft on the prompts: what `specdec bench` would report."""
    params = params or SamplingParams(max_tokens=64)
    config = BenchConfig(methods=list(methods), params=params, chat=chat, extra=dict(extra or {}))
    return run_bench(SpecDecoder(target, draft), list(prompts), config, log=log)


def compare(before: dict, after: dict) -> dict:
    """Per method (overall and per task): acceptance rate, mean acceptance length and speedup, before and after."""

    def rows(scope_before: dict, scope_after: dict) -> dict:
        out = {}
        for name, row in scope_after.items():
            if name == "plain":
                continue
            old = scope_before.get(name, {})
            out[name] = {key: {"before": old.get(key), "after": row.get(key)} for key, _, _ in _COLUMNS}
            out[name]["identical_to_plain"] = {"before": old.get("identical_to_plain"),
                                               "after": row.get("identical_to_plain")}
        return out

    summary_b, summary_a = before["summary"], after["summary"]
    return {
        "overall": rows(summary_b["overall"], summary_a["overall"]),
        "per_task": {task: rows(summary_b["per_task"].get(task, {}), summary_a["per_task"][task])
                     for task in summary_a["tasks"]},
        "definitions": {k: summary_a["definitions"][k] for k in ("acceptance_rate", "mean_acceptance_length", "speedup")},
    }


def _cell(pair: dict, spec: str) -> str:
    return f"{format_cell(pair['before'], spec)} → {format_cell(pair['after'], spec)}"


def comparison_table(rows: dict) -> str:
    lines = ["| method | " + " | ".join(title for _, title, _ in _COLUMNS) + " | greedy identical to plain |",
             "|---|" + "---:|" * len(_COLUMNS) + "---|"]
    for name, row in rows.items():
        cells = " | ".join(_cell(row[key], spec) for key, _, spec in _COLUMNS)
        lines.append(f"| {name} | {cells} | {_cell(row['identical_to_plain'], '')} |")
    return "\n".join(lines)


def report_markdown(report: dict) -> str:
    """report.md: what was trained on what, the training curve's ends, and the before → after table."""
    data, train, comparison = report["data"], report["training"], report.get("comparison")
    lines = [
        "# specdec distill",
        "",
        f"- target `{report['target']}`, draft `{report['draft']}` → `{report['out_dir']}`"
        + (f" and `{report['gguf']}`" if report.get("gguf") else ""),
        (f"- data: {data['train_examples']} training prompts ({data['source']}), target continuations of up to "
         f"{data['max_tokens']} tokens ({data['decoding']}), {data['train_positions']} positions, target top-"
         f"{data['top_k']} log-probs per position (renormalised over those K ids)"),
        (f"- training: {train['method']}, loss {train['loss']}, {train['steps']} steps of batch {train['batch_size']}, "
         f"lr {train['lr']}, {train['dtype']} on {train['device']}, seed {train['seed']}; loss "
         f"{format_cell(train.get('loss_first'), '.4f')} → {format_cell(train.get('loss_last'), '.4f')} "
         "(mean of the first and last tenth of the steps)"),
    ]
    if report.get("gguf_note"):
        lines.append(f"- GGUF: {report['gguf_note']}")
    if comparison is None:
        lines += ["", "No evaluation was run (--no-eval)."]
        return "\n".join(lines) + "\n"
    evaluation = report["evaluation"]
    lines += [
        (f"- evaluation: {evaluation['num_prompts']} held-out prompts ({', '.join(evaluation['tasks'])}) never "
         f"trained on, greedy, max {evaluation['max_tokens']} new tokens; draft before: "
         f"`{evaluation['draft_before']}`, after: `{evaluation['draft_after']}`; measured with the bench runner "
         "(plain decoding and each method on the same target in one run, warm-up first)"),
        "",
        "## Before → after (held-out prompts)",
        "",
        comparison_table(comparison["overall"]),
        "",
    ]
    if len(comparison["per_task"]) > 1:
        for task, rows in comparison["per_task"].items():
            lines += [f"### {task}", "", comparison_table(rows), ""]
    lines += [
        ("Acceptance rate = accepted draft tokens / drafted tokens. Mean acceptance length = 1 + accepted/drafts: "
         "tokens per target pass **including the bonus token**. Speedup = tokens/s over plain decoding (our engine "
         "without a drafter, same target, same run). The full bench tables are in eval-before/ and eval-after/."),
    ]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path, before: dict | None = None, after: dict | None = None) -> dict:
    """Write report.json, report.md and the two bench result folders (eval-before/, eval-after/) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    for name, results in (("eval-before", before), ("eval-after", after)):
        if results is not None:
            paths[name] = write_results(results, out / name, plot=False)["markdown"]
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(report_markdown(report), encoding="utf-8")
    return paths


__all__ = ["DEFAULT_EVAL_METHODS", "compare", "comparison_table", "eval_methods", "evaluate_draft",
           "report_markdown", "write_report"]
