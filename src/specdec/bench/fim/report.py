"""The FIM bench's summary (pass@1, exact match, latency, decode speed; identity with plain decoding; paired ratios
against llama-server with 95% intervals; the editor trace) and its markdown."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdec.bench.serving.report import percentile
from specdec.bench.side_by_side import interval, median, number, ratio_text, write_results

PEERS = ("llamacpp_plain", "llamacpp_ngram")


def _by(records: Sequence[dict], system: str, set_name: str) -> dict[str, dict]:
    return {r["item"]: r for r in records if r["system"] == system and r.get("set") == set_name}


def system_row(rows: dict[str, dict]) -> dict:
    done = [r for r in rows.values() if r.get("error") is None]
    e2e = [r["e2e"] for r in done]
    return {"problems": len(rows), "errors": len(rows) - len(done), "passed": sum(bool(r.get("passed")) for r in done),
            "exact_match": sum(bool(r.get("exact_match")) for r in done), "e2e_p50": percentile(e2e, 50),
            "e2e_p90": percentile(e2e, 90), "ttft_p50": percentile([r["ttft"] for r in done if r["ttft"]], 50),
            "decode_tok_s_median": median(r["decode_tokens_per_second"] for r in done),
            "tokens_mean": median(r["tokens"] for r in done)}


def paired(ours: dict[str, dict], peer: dict[str, dict]) -> dict:
    """Per problem both answered: decode speed ours/peer, end-to-end speed peer/ours (>1: ours faster), with
    their geometric means and 95% t-intervals, and the ratio of median end-to-end latencies ours/peer."""
    common = [k for k in ours if k in peer and ours[k].get("error") is None and peer[k].get("error") is None]
    decode = [ours[k]["decode_tokens_per_second"] / peer[k]["decode_tokens_per_second"] for k in common
              if ours[k]["decode_tokens_per_second"] and peer[k]["decode_tokens_per_second"]]
    e2e = [peer[k]["e2e"] / ours[k]["e2e"] for k in common if ours[k]["e2e"] and peer[k]["e2e"]]
    ours_median, peer_median = median(ours[k]["e2e"] for k in common), median(peer[k]["e2e"] for k in common)
    return {"problems": len(common), "decode_speedup": interval(decode), "decode_pairs": len(decode),
            "e2e_speedup": interval(e2e),
            "e2e_median_ratio": ours_median / peer_median if ours_median and peer_median else None,
            "pass_difference": sum(bool(ours[k].get("passed")) for k in common)
            - sum(bool(peer[k].get("passed")) for k in common)}


def identity(rows: dict[str, dict], reference: dict[str, dict]) -> dict:
    common = [k for k in rows if k in reference and rows[k].get("error") is None
              and reference[k].get("error") is None]
    return {"problems": len(common),
            "same_verdict": sum(rows[k].get("passed") == reference[k].get("passed") for k in common),
            "same_text": sum(rows[k]["content"] == reference[k]["content"] for k in common),
            "verdict_differs": [k for k in common if rows[k].get("passed") != reference[k].get("passed")]}


def trace_summary(trace: dict | None) -> dict | None:
    if not trace:
        return None
    out: dict = {"systems": {}}
    for label in sorted({r["system"] for r in trace["records"]}):
        records = [r for r in trace["records"] if r["system"] == label]
        done = [r for r in records if not r["cancelled"] and r["error"] is None]
        out["systems"][label] = {
            "requests": len(records), "completed": len(done), "cancelled": sum(r["cancelled"] for r in records),
            "errors": sum(r["error"] is not None for r in records), "e2e_p50": percentile([r["e2e"] for r in done], 50),
            "e2e_p90": percentile([r["e2e"] for r in done], 90),
            "cached_fraction_mean": median(r["cached_tokens"] / r["prompt_tokens"] for r in done
                                            if r["prompt_tokens"] and r["cached_tokens"] is not None)}
    systems = out["systems"]

    def ratio(a: str, b: str) -> float | None:
        x, y = systems.get(a, {}).get("e2e_p50"), systems.get(b, {}).get("e2e_p50")
        return x / y if x and y else None

    out["ours_vs_cold_median"] = ratio("ours", "ours_cold")
    out["ours_vs_llamacpp_plain_median"] = ratio("ours", "llamacpp_plain")
    out["ours_vs_llamacpp_ngram_median"] = ratio("ours", "llamacpp_ngram")
    out["rss_before"], out["rss_after"] = trace["rss_before"], trace["rss_after"]
    out["ours_running_after"] = trace["ours_running_after"]
    return out


def summarise(results: dict) -> dict:
    records = results["records"]
    systems = list(dict.fromkeys(r["system"] for r in records))
    summary: dict = {"sets": {}}
    for set_name in sorted({r.get("set") for r in records if r.get("set")}):
        rows = {s: _by(records, s, set_name) for s in systems}
        entry = {"systems": {s: system_row(rows[s]) for s in systems}}
        if "reference" in rows:
            entry["identity"] = {s: identity(rows[s], rows["reference"]) for s in ("ours", "ours_exact") if s in rows}
        if "ours" in rows:
            entry["ours_vs"] = {peer: paired(rows["ours"], rows[peer]) for peer in PEERS if peer in rows}
        summary["sets"][set_name] = entry
    summary["trace"] = trace_summary(results.get("trace"))
    return summary


def to_markdown(results: dict) -> str:
    summary = results["summary"]
    lines = ["# specdec bench --fim", ""]
    for set_name, entry in summary["sets"].items():
        lines += [f"## {set_name}-line infilling", "",
                  "| system | problems | pass@1 | exact | e2e p50 s | e2e p90 s | first text p50 s | decode tok/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for system, row in entry["systems"].items():
            lines.append(f"| {system} | {row['problems']} | {row['passed']} | {row['exact_match']} | "
                         f"{number(row['e2e_p50'])} | {number(row['e2e_p90'])} | {number(row['ttft_p50'])} | "
                         f"{number(row['decode_tok_s_median'], '.1f')} |")
        for system, same in entry.get("identity", {}).items():
            lines.append(f"\n{system} vs plain decoding: same pass/fail {same['same_verdict']}/{same['problems']}, "
                         f"same text {same['same_text']}/{same['problems']}")
        for peer, found in entry.get("ours_vs", {}).items():
            lines.append(f"\nours vs {peer} ({found['problems']} problems): decode speed {ratio_text(found['decode_speedup'])}"
                         f" ({found['decode_pairs']} pairs), end-to-end speed {ratio_text(found['e2e_speedup'])}, median "
                         f"latency ratio {number(found['e2e_median_ratio'])}, pass@1 difference {found['pass_difference']:+d}")
        lines.append("")
    trace = summary.get("trace")
    if trace:
        lines += ["## editor trace", "", "| system | requests | completed | cancelled | e2e p50 s | e2e p90 s | "
                  "prompt cached (median) |", "|---|---|---|---|---|---|---|"]
        for system, row in trace["systems"].items():
            lines.append(f"| {system} | {row['requests']} | {row['completed']} | {row['cancelled']} | "
                         f"{number(row['e2e_p50'])} | {number(row['e2e_p90'])} | {number(row['cached_fraction_mean'])} |")
        lines += ["", f"median latency ours / ours cold: {number(trace['ours_vs_cold_median'])}; ours / llamacpp_plain: "
                  f"{number(trace['ours_vs_llamacpp_plain_median'])}; ours / llamacpp_ngram: "
                  f"{number(trace['ours_vs_llamacpp_ngram_median'])}",
                  f"our server: RSS {number((trace['rss_before'].get('ours') or 0) / 2**20, '.0f')} MiB before the trace, "
                  f"{number((trace['rss_after'].get('ours') or 0) / 2**20, '.0f')} MiB after; requests running after: "
                  f"{trace['ours_running_after']}", ""]
    return "\n".join(lines)


def write_fim_results(results: dict, out_dir: str | Path) -> dict[str, Path]:
    return write_results(results, out_dir, to_markdown(results))
