"""The serving bench's numbers: per system and concurrency level, ratios, identity; results.md and serve.png.

Definitions (the same in the JSON, the markdown and docs/serving-bench.md):
- aggregate tok/s: completion tokens of the level's successful requests / the level's wall time (first
  request sent to last stream ended);
- TTFT: seconds from sending a request to its first non-empty content delta (queueing included);
  e2e: seconds from sending it to the end of its stream; p50/p90 over the level's successful requests,
  linearly interpolated;
- failures: requests with an HTTP error, an error event, an incomplete stream or an exception;
- peak RSS: the largest resident memory of the server's process tree, sampled every 0.2 s while the
  level ran (its lifetime peak, model loading included, is in results.json);
- identical x/N: of the level's N requests, x succeeded with text equal, character for character, to the
  reference's text for the same prompt (`specdec serve --drafter none --exact`, concurrency 1);
- ratios: aggregate tok/s over llama-server plain's, and over today's one-at-a-time server's, at the same
  concurrency; none where either level failed a request or did not run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from specdec.bench.method.render import write_outputs
from specdec.bench.plot import pyplot, save_figure
from specdec.bench.serving.systems import REFERENCE

LLAMA_BASELINE = "llamacpp_plain"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    position = (len(data) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return data[low] + (data[high] - data[low]) * (position - low)


def references(levels: Sequence[dict]) -> dict[tuple[str, str], str]:
    """(task, id) -> the reference's text, from its successful requests."""
    for level in levels:
        if level["system"] == REFERENCE and level["status"] == "ok":
            return {(r["task"], r["id"]): r["text"] for r in level["records"] if r["error"] is None}
    return {}


def identity(records: Sequence[dict], reference: dict[tuple[str, str], str]) -> dict:
    """How many requests succeeded with the reference's text for their prompt; requests whose prompt has no
    reference text (the reference failed on it) are counted apart."""
    identical = unreferenced = 0
    mismatched = []
    for record in records:
        key = (record["task"], record["id"])
        if key not in reference:
            unreferenced += 1
        elif record["error"] is None and record["text"] == reference[key]:
            identical += 1
        else:
            mismatched.append(f"{record['task']}/{record['id']}")
    return {"identical": identical, "requests": len(records), "without_reference": unreferenced,
            "differing": mismatched}


def summarise_level(level: dict, reference: dict[tuple[str, str], str]) -> dict:
    """One row: the level's aggregate numbers (None where nothing could be measured)."""
    records = level["records"]
    good = [r for r in records if r["error"] is None]
    row = {"system": level["system"], "concurrency": level["concurrency"], "status": level["status"],
           "error": level.get("error"), "requests": len(records), "failures": len(records) - len(good)}
    if level["status"] != "ok":
        return row
    counted = [r["completion_tokens"] for r in good if r["completion_tokens"] is not None]
    tokens = sum(counted)
    wall = level.get("wall_seconds") or 0.0
    ttfts, e2es = [r["ttft"] for r in good], [r["e2e"] for r in good]
    row.update(
        completion_tokens=tokens,
        uncounted=len(good) - len(counted),
        wall_seconds=round(wall, 3),
        tok_per_s=round(tokens / wall, 3) if wall > 0 and len(counted) == len(good) else None,
        ttft_p50=percentile(ttfts, 50), ttft_p90=percentile(ttfts, 90),
        e2e_p50=percentile(e2es, 50), e2e_p90=percentile(e2es, 90),
        peak_rss_mb=_mb(level.get("peak_rss_bytes")),
        server_peak_rss_mb=_mb(level.get("server_peak_rss_bytes")),
        identity=identity(records, reference) if reference else None,
    )
    return row


def _mb(value) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def serial_baseline(systems: Sequence[str], parallel: bool) -> str | None:
    """The one-at-a-time server: ours_serial (--parallel 1), or `ours` where serve has no --parallel."""
    if parallel:
        return "ours_serial" if "ours_serial" in systems else None
    return "ours" if "ours" in systems else None


def ratio(row: dict, base: dict | None) -> float | None:
    """row's aggregate tok/s over base's; None unless both ran every request successfully."""
    if base is None or row is base:
        return None
    for side in (row, base):
        if side.get("status") != "ok" or side.get("failures") or not side.get("tok_per_s"):
            return None
    return round(row["tok_per_s"] / base["tok_per_s"], 3)


def add_ratios(rows: list[dict], serial: str | None) -> None:
    """Each row's tok/s over llama-server plain's and over the one-at-a-time server's at its concurrency."""
    by_key = {(r["system"], r["concurrency"]): r for r in rows}
    for row in rows:
        if row["system"] == REFERENCE:
            continue
        row["vs_llamacpp_plain"] = ratio(row, by_key.get((LLAMA_BASELINE, row["concurrency"])))
        row["vs_serial"] = ratio(row, by_key.get((serial, row["concurrency"]))) if serial else None


def summarise(results: dict) -> dict:
    config = results["config"]
    reference = references(results["levels"])
    rows = [summarise_level(level, reference) for level in results["levels"]]
    systems = [s for s in config["systems"] if s != REFERENCE]
    serial = serial_baseline(systems, config["specdec_serve_parallel"])
    add_ratios(rows, serial)
    failed = [f"{r['system']}@{r['concurrency']}" for r in rows if r["status"] != "ok" or r["failures"]]
    return {"rows": rows, "serial_baseline": serial, "reference_prompts": len(reference),
            "failed_levels": failed}


# --------------------------------------------------------------------------------------------- markdown


def _cell(value, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _identity_cell(row: dict) -> str:
    if row["system"] == REFERENCE:
        return "(the reference)"
    ident = row.get("identity")
    if ident is None:
        return "no reference"
    cell = f"{ident['identical']}/{ident['requests']}"
    if ident["without_reference"]:
        cell += f" ({ident['without_reference']} without reference)"
    return cell


def _ratio_cell(row: dict, key: str, base: dict | None) -> str:
    if key not in row:  # the reference
        return "–"
    if base is row:
        return "baseline"
    if row[key] is not None:
        return f"{row[key]:.2f}x"
    if base is None:
        return "–"
    if base["status"] != "ok":
        return "n/a (no baseline)"
    if row["failures"] or base["failures"]:
        return "n/a (failures)"
    return "–"


def serving_table(summary: dict) -> str:
    rows = summary["rows"]
    by_key = {(r["system"], r["concurrency"]): r for r in rows}
    serial = summary.get("serial_baseline")
    lines = [
        ("| system | C | tok/s | x llama plain | x one-at-a-time | TTFT p50 (s) | TTFT p90 (s) | "
         "e2e p50 (s) | e2e p90 (s) | failures | peak RSS (MiB) | identical |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        c = row["concurrency"]
        if row["status"] != "ok":
            what = row["status"].replace("_", " ")
            lines.append(f"| {row['system']} | {c} | {what}: {(row.get('error') or '')[:160]} |"
                         + " |" * 9)
            continue
        lines.append(
            f"| {row['system']} | {c} | {_cell(row['tok_per_s'], '.1f')} | "
            f"{_ratio_cell(row, 'vs_llamacpp_plain', by_key.get((LLAMA_BASELINE, c)))} | "
            f"{_ratio_cell(row, 'vs_serial', by_key.get((serial, c)))} | "
            f"{_cell(row['ttft_p50'])} | {_cell(row['ttft_p90'])} | {_cell(row['e2e_p50'])} | "
            f"{_cell(row['e2e_p90'])} | {row['failures']}/{row['requests']} | "
            f"{_cell(row['peak_rss_mb'], '.0f')} | {_identity_cell(row)} |")
    return "\n".join(lines)


def to_markdown(results: dict, title: str = "specdec bench --serve") -> str:
    config, env, summary = results["config"], results["environment"], results["summary"]
    serial = summary.get("serial_baseline")
    tasks = list(dict.fromkeys(p["task"] for p in config["prompts"]))
    lines = [
        f"# {title}",
        "",
        (f"- {env.get('cpu_model') or '?'} ({env.get('cpu_count')} CPUs); {config['threads']} threads for "
         f"every server; specdec {env.get('specdec')}, "
         f"llama-cpp-python {env.get('llama_cpp_python') or '–'}"),
        (f"- {config['num_prompts']} prompts ({', '.join(tasks)}), sent as streaming chat completions, "
         f"greedy, max {config['max_tokens']} tokens; concurrency "
         f"{', '.join(map(str, config['concurrency']))} (closed loop: C clients, each sending the next "
         "prompt when its last one ended)"),
        ("- each system at each concurrency on a fresh server, warmed up with one request, one server at a "
         f"time; context per stream {config['max_context_per_stream']} tokens; wall time "
         f"{results.get('wall_seconds', 0):.0f} s"),
        f"- command: `specdec {' '.join(env.get('argv') or [])}`",
        "",
    ]
    if not config["specdec_serve_parallel"]:
        lines += [("**`specdec serve` has no `--parallel` in this build**: `ours` and `ours_exact` ran one "
                   "request at a time (today's server), so `ours` is the one-at-a-time baseline here."), ""]
    if summary["failed_levels"]:
        lines += [(f"**Failed requests or servers in: {', '.join(summary['failed_levels'])}.** No ratio "
                   "is given for those levels."), ""]
    lines += [
        "## Per system and concurrency",
        "",
        serving_table(summary),
        "",
        "Systems: " + "; ".join(f"`{name}`: {what}" for name, what in config["systems"].items()) + ".",
        "",
        ("tok/s = completion tokens of all streams / the level's wall time (first request sent to last "
         "stream ended). TTFT = send to first non-empty content delta (queueing included); e2e = send to end "
         "of stream; p50/p90 over successful requests. x llama plain = tok/s over `llamacpp_plain`'s at the "
         f"same C; x one-at-a-time = over `{serial or 'ours_serial'}`'s at the same C (none where either "
         "level failed a request). Peak RSS = largest resident memory of the server's process tree while "
         f"the level ran. Identical = requests whose text equals `{REFERENCE}`'s for the same prompt "
         "(plain decoding, exact kernels, solo); `ours_exact` must be N/N."),
    ]
    if results.get("skipped_systems"):
        skipped = "; ".join(f"`{k}` ({v})" for k, v in results["skipped_systems"].items())
        lines += ["", f"Not run: {skipped}."]
    differing = [(r["system"], r["concurrency"], r["identity"]["differing"]) for r in summary["rows"]
                 if r.get("identity") and r["identity"]["differing"]]
    if differing:
        lines += ["", "Streams that differ from the reference:", ""]
        lines += [f"- {system}@{c}: {', '.join(keys[:12])}{' ...' if len(keys) > 12 else ''}"
                  for system, c, keys in differing]
    errors = [(lv["system"], lv["concurrency"], r)
              for lv in results["levels"] for r in lv["records"] if r["error"]]
    if errors:
        lines += ["", "Failed requests (first 20):", ""]
        lines += [f"- {s}@{c} {r['task']}/{r['id']}: {r['error']}" for s, c, r in errors[:20]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- plot


def plot_serving(results: dict, path: str | Path) -> Path | None:
    """serve.png: aggregate throughput and TTFT p50 against concurrency, one line per system (levels with
    failed requests left out); None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in results["summary"]["rows"] if r["status"] == "ok" and not r["failures"]]
    fig, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.4))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for system in systems:
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["concurrency"])
        solo = {"marker": "*", "markersize": 10, "linestyle": "none"}
        style = solo if system == REFERENCE else {"marker": "o"}
        xs = [r["concurrency"] for r in mine]
        label = "reference (plain, --exact, solo)" if system == REFERENCE else system
        throughput.plot(xs, [r["tok_per_s"] for r in mine], label=label, **style)
        ttft.plot(xs, [r["ttft_p50"] for r in mine], label=label, **style)
    levels = results["config"]["concurrency"]
    for axis in (throughput, ttft):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels)
        axis.set_xticklabels([str(c) for c in levels])
        axis.set_xlabel("concurrent streams (C)")
        axis.grid(alpha=0.3)
    throughput.set_ylabel("aggregate completion tokens/s")
    throughput.set_title("Throughput: all streams' tokens / wall time")
    ttft.set_ylabel("time to first token, p50 (s)")
    ttft.set_title("TTFT p50 (send to first content, queueing incl.)")
    if systems:
        throughput.legend(fontsize=8)
    config = results["config"]
    fig.suptitle(f"Serving bench: {config['num_prompts']} streaming chat requests per level, greedy, max "
                 f"{config['max_tokens']} tokens, {config['threads']} threads per server (levels with failed "
                 "requests left out)", fontsize=9)
    return save_figure(fig, path)


def write_serving_results(results: dict, out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """results.json, results.md and (with matplotlib) serve.png in out_dir; their paths."""
    return write_outputs(results, out_dir, to_markdown(results), plot_serving if plot else None, "serve.png")


__all__ = [
    "add_ratios", "identity", "percentile", "plot_serving", "ratio", "references", "serial_baseline",
    "serving_table", "summarise", "summarise_level", "to_markdown", "write_serving_results",
]
