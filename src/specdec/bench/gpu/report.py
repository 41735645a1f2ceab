"""Summarise a GPU bench run (bench/gpu/run.py) and write it as results.json and results.md: rates, ratios, the bandwidth limit, the pass-cost curves."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.cells import format_cell

DESCRIPTIONS = {
    "plain": "specdec plain decoding",
    "replay_k8": "specdec, replay drafter k=8 (every draft accepted: the ceiling)",
    "lookup_adaptive": "specdec, prompt lookup, adaptive k",
    "draft_k4": "specdec, draft model, k=4",
    "draft_adaptive": "specdec, draft model, adaptive k",
    "hf_eager": "transformers generate, eager (dynamic cache)",
    "hf_static": "transformers generate, static cache + torch.compile",
    "hf_assisted_k4": "transformers assisted generation, same draft, 4 tokens",
    "hf_prompt_lookup": "transformers prompt lookup decoding",
}


def summarise(results: dict) -> dict:
    """Per-method aggregates (total tokens over total seconds) and the headline ratios."""
    runs = results["runs"]
    bandwidth = results.get("copy_bandwidth_bytes_per_s")
    target_bytes = results["weights"]["target_bytes"]
    limit_pass = target_bytes / bandwidth if bandwidth else None  # seconds: read every weight once
    methods: dict[str, dict] = {}
    for run in runs:
        row = methods.setdefault(run["method"], {"tokens": 0, "seconds": 0.0, "steps": 0, "drafted": 0, "accepted": 0,
                                                 "target_seconds": 0.0, "draft_seconds": 0.0, "prompts": 0,
                                                 "identical": 0, "by_kind": {}})
        for key in ("steps", "drafted", "accepted", "target_seconds", "draft_seconds"):
            row[key] += run[key]
        row["tokens"] += run["generated"]
        row["seconds"] += run["seconds"]
        row["prompts"] += 1
        row["identical"] += int(run["identical_to_plain"])
        kind = row["by_kind"].setdefault(run["kind"], {"tokens": 0, "seconds": 0.0})
        kind["tokens"] += run["generated"]
        kind["seconds"] += run["seconds"]
    for row in methods.values():
        row["tok_s"] = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
        row["tokens_per_pass"] = row["tokens"] / row["steps"] if row["steps"] else None
        row["acceptance"] = row["accepted"] / row["drafted"] if row["drafted"] else None
        for kind in row["by_kind"].values():
            kind["tok_s"] = kind["tokens"] / kind["seconds"] if kind["seconds"] else 0.0
    plain = methods.get("plain", {}).get("tok_s")
    hf = methods.get("hf_eager", {}).get("tok_s")
    for row in methods.values():
        row["vs_plain"] = row["tok_s"] / plain if plain else None
        row["vs_hf_eager"] = row["tok_s"] / hf if hf else None
        row["of_limit"] = row["tok_s"] * limit_pass if limit_pass else None  # tokens/s over one token per limit pass
    curves = {role: {int(s): c for s, c in curve.items()} for role, curve in results.get("curves", {}).items()}
    headline: dict = {"limit_pass_ms": limit_pass * 1000 if limit_pass else None}
    target_curve = curves.get("target", {})
    if target_curve:
        one = target_curve[1]
        headline["one_row_pass_ms"] = one * 1000
        headline["one_row_over_limit"] = one / limit_pass if limit_pass else None
        headline["max_ratio_2_to_16_rows"] = max(c / one for s, c in target_curve.items() if 2 <= s <= 16)
    if "draft" in curves and target_curve:
        headline["cost_ratio_c_pass"] = curves["draft"][1] / target_curve[1]
    eager = {role: {int(s): c for s, c in curve.items()} for role, curve in results.get("curves_eager_layers", {}).items()}
    for role, curve in eager.items():
        if 1 in curve and 1 in curves.get(role, {}):
            headline[f"{role}_one_row_eager_layers_ms"] = curve[1] * 1000
            headline[f"{role}_one_row_compiled_over_eager_layers"] = curves[role][1] / curve[1]
    if 1 in eager.get("draft", {}) and 1 in eager.get("target", {}):
        headline["cost_ratio_c_pass_eager_layers"] = eager["draft"][1] / eager["target"][1]
    engine = _engine_pass_costs(methods)
    headline.update(engine)
    if plain and hf:
        headline["plain_over_hf_eager"] = plain / hf
    if plain and "replay_k8" in methods:
        headline["replay_k8_over_plain"] = methods["replay_k8"]["tok_s"] / plain
    return {"methods": methods, "curves": curves, "headline": headline}


def _engine_pass_costs(methods: dict) -> dict:
    """Costs as the engine paid them: seconds per verification step (forward + argmax read back), per method."""
    out = {}
    plain = methods.get("plain")
    if plain and plain["steps"]:
        out["engine_one_row_step_ms"] = plain["target_seconds"] / plain["steps"] * 1000
    replay = methods.get("replay_k8")
    if replay and replay["steps"] and plain and plain["steps"]:
        out["engine_nine_row_step_ms"] = replay["target_seconds"] / replay["steps"] * 1000
        out["engine_nine_over_one_row"] = out["engine_nine_row_step_ms"] / out["engine_one_row_step_ms"]
    draft = methods.get("draft_k4")
    if draft and draft["drafted"] and plain and plain["steps"]:
        per_token = draft["draft_seconds"] / draft["drafted"]
        out["engine_draft_ms_per_token"] = per_token * 1000
        out["cost_ratio_c_engine"] = per_token / (plain["target_seconds"] / plain["steps"])
    return out


def to_markdown(results: dict) -> str:
    summary = summarise(results)
    env, config, head = results["environment"], results.get("config", {}), summary["headline"]
    bandwidth = results.get("copy_bandwidth_bytes_per_s")
    lines = [
        f"# GPU bench: {config.get('target', '?')} (draft {config.get('draft') or 'none'})",
        "",
        f"{env.get('gpu', env['device'])} ({env.get('nvidia_smi', '')}), torch {env['torch']}, CUDA {env.get('cuda')}, "
        f"transformers {env['transformers']}; {config.get('dtype', '')} weights, {config.get('prompts', '?')} prompts of "
        f"{config.get('prompt_tokens', '?')} tokens ({results.get('prompts_run', '?')} run), greedy, {config.get('max_tokens', '?')} new tokens, one run, methods "
        f"interleaved; wall {results.get('wall_seconds')} s; peak GPU memory {results.get('peak_memory_gib')} GiB.",
        "",
        f"Runtime: target {results['runtime']['target']}; draft {results['runtime'].get('draft')}.",
        "",
        f"Bandwidth limit: the target's {results['weights']['target_bytes'] / 1e9:.2f} GB of weights over the measured "
        f"copy bandwidth {format_cell(bandwidth / 1e12 if bandwidth else None, '.2f', ' TB/s')} = "
        f"{format_cell(head.get('limit_pass_ms'), '.2f', ' ms')} per one-row pass.",
        "",
        "| method | tok/s | vs specdec plain | vs transformers eager | x of the one-token-per-limit rate | "
        "tokens per target pass | acceptance | greedy identical to plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in summary["methods"].items():
        lines.append(
            f"| {DESCRIPTIONS.get(name, name)} | {row['tok_s']:.1f} | {format_cell(row['vs_plain'], '.2f', 'x')} | "
            f"{format_cell(row['vs_hf_eager'], '.2f', 'x')} | {format_cell(row['of_limit'], '.2f')} | "
            f"{format_cell(row['tokens_per_pass'], '.2f')} | {format_cell(row['acceptance'], '.3f')} | "
            f"{row['identical']}/{row['prompts']} |"
        )
    kinds = sorted({k for row in summary["methods"].values() for k in row["by_kind"]})
    if len(kinds) > 1:
        lines += ["", "By prompt kind (copy: the prompt holds the text the output repeats; fresh: it does not), tok/s:",
                  "", "| method | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for name, row in summary["methods"].items():
            cells = [format_cell(row["by_kind"].get(k, {}).get("tok_s"), ".1f") for k in kinds]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for role, curve in summary["curves"].items():
        sizes = sorted(curve)
        lines += ["", f"Pass cost of the {role} (forward + argmax read back, device synchronised, median of 5, "
                      f"after {results.get('curve_context_tokens', '?')} cached tokens):", "",
                  "| rows | " + " | ".join(str(s) for s in sizes) + " |", "|---|" + "---:|" * len(sizes),
                  "| ms | " + " | ".join(f"{curve[s] * 1000:.2f}" for s in sizes) + " |",
                  "| x one row | " + " | ".join(f"{curve[s] / curve[sizes[0]]:.2f}" for s in sizes) + " |"]
    for role, curve in results.get("curves_eager_layers", {}).items():
        compiled = summary["curves"].get(role, {})
        sizes = sorted(int(s) for s in curve)
        lines += ["", f"The {role}'s passes with eager layers (no torch.compile; graphs as above), same run:", "",
                  "| rows | " + " | ".join(str(s) for s in sizes) + " |", "|---|" + "---:|" * len(sizes),
                  "| ms, eager layers | " + " | ".join(f"{curve[str(s)] * 1000:.2f}" for s in sizes) + " |",
                  "| ms, compiled layers | " + " | ".join(format_cell(compiled[s] * 1000 if s in compiled else None, ".2f")
                                                       for s in sizes) + " |"]
    if results.get("compile_seconds"):
        lines += ["", "torch.compile of the layer function, every bucket, seconds (once per model): " + ", ".join(
            f"{role} {format_cell(sec, '.1f')}" for role, sec in results["compile_seconds"].items())]
    for role, profile in results.get("kernel_profile", {}).items():
        if profile and "kernels" in profile:
            lines += ["", f"One one-row pass of the {role} run without a graph, profiled: {profile['kernels']} kernels, "
                          f"{profile['device_ms']:.2f} ms of summed device time (a graph replays these without launch gaps)."]
    lines += ["", "Headline figures:", ""]
    for key, value in head.items():
        lines.append(f"- {key}: {format_cell(value, '.3f')}")
    if results.get("first_call_seconds"):
        lines += ["", "First (warm-up) call per method, seconds (transformers' static path compiles here): " + ", ".join(
            f"{m} {s:.1f}" for m, s in results["first_call_seconds"].items())]
    if results.get("skipped"):
        lines += ["", "Not run: " + "; ".join(f"{m} ({why})" for m, why in results["skipped"].items())]
    if config.get("load_format") == "dummy":
        lines += ["", "Dummy weights (bench/dummy.py): every model follows one successor rule by construction, so "
                      "drafts from the replay drafter and the draft model are accepted because the models were built "
                      "to agree. These rows measure what passes cost and what full acceptance buys on this GPU, "
                      "not a real draft's acceptance."]
    return "\n".join(lines) + "\n"


def write(results: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    results = dict(results, summary=summarise(results))
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["md"].write_text(to_markdown(results))
    return paths


__all__ = ["summarise", "to_markdown", "write"]
