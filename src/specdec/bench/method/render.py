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
from pathlib import Path

from specdec.bench.cells import format_cell
from specdec.bench.method.aggregate import greedy_differences, relative_per_task
from specdec.bench.method.ceiling import ceiling_markdown
from specdec.bench.method.methods import BASELINES, EXACT_BASELINE, EXACT_PREFIX
from specdec.bench.method.paired import noise_floor_markdown, paired_markdown
from specdec.bench.method.speed_and_length import speed_and_length_markdown
from specdec.bench.plot import plot_results


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
