"""The tools bench's summary (BFCL accuracy per set, identity with plain decoding, latency and decode speed; the
structured-output set's validity, forced share and speed) with paired ratios and 95% intervals, and its markdown."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdec.bench.serving.report import percentile
from specdec.bench.side_by_side import interval, median, number, ratio_text, write_results
from specdec.core.intervals import binomial_interval

PEERS = ("reference", "llamacpp_plain", "llamacpp_ngram")


def _by(records: Sequence[dict], system: str, set_name: str) -> dict[str, dict]:
    return {r["item"]: r for r in records if r["system"] == system and r.get("set") == set_name}


def system_row(rows: dict[str, dict], verdict: str) -> dict:
    done = [r for r in rows.values() if r.get("error") is None]
    right = sum(bool(r.get(verdict)) for r in done)
    low, high = binomial_interval(right, len(rows)) if rows else (None, None)
    tokens = sum(r["tokens"] or 0 for r in done)
    forced = [r["forced_tokens"] for r in done if r.get("forced_tokens") is not None]
    return {"problems": len(rows), "errors": len(rows) - len(done), verdict: right, f"{verdict}_low": low,
            f"{verdict}_high": high, "e2e_p50": percentile([r["e2e"] for r in done], 50),
            "decode_tok_s_median": median(r["decode_tokens_per_second"] for r in done),
            "tokens_median": median(r["tokens"] for r in done),
            "forced_share": sum(forced) / tokens if forced and tokens else None}


def paired(ours: dict[str, dict], peer: dict[str, dict], verdict: str) -> dict:
    common = [k for k in ours if k in peer and ours[k].get("error") is None and peer[k].get("error") is None]
    decode = [ours[k]["decode_tokens_per_second"] / peer[k]["decode_tokens_per_second"] for k in common
              if ours[k]["decode_tokens_per_second"] and peer[k]["decode_tokens_per_second"]]
    e2e = [peer[k]["e2e"] / ours[k]["e2e"] for k in common if ours[k]["e2e"] and peer[k]["e2e"]]
    return {"problems": len(common), "decode_speedup": interval(decode), "decode_pairs": len(decode),
            "e2e_speedup": interval(e2e),
            "same_verdict": sum(bool(ours[k].get(verdict)) == bool(peer[k].get(verdict)) for k in common),
            "same_text": sum(ours[k]["content"] == peer[k]["content"] and ours[k]["calls"] == peer[k]["calls"]
                             for k in common),
            "verdict_differs": [k for k in common if bool(ours[k].get(verdict)) != bool(peer[k].get(verdict))]}


def summarise(results: dict) -> dict:
    records = results["records"]
    systems = list(dict.fromkeys(r["system"] for r in records))
    summary: dict = {"sets": {}}
    for set_name in sorted({r.get("set") for r in records if r.get("set")}):
        verdict = "valid" if set_name == "structured" else "right"
        rows = {s: _by(records, s, set_name) for s in systems}
        if set_name != "structured":
            # A reply that may be a call is held until it is whole (ours streams it at the end), so its first and
            # last deltas say nothing about decoding: only end-to-end figures compare there.
            rows = {s: {k: {**r, "decode_tokens_per_second": None} for k, r in by.items()} for s, by in rows.items()}
        entry = {"verdict": verdict, "systems": {s: system_row(rows[s], verdict) for s in systems}}
        if "ours" in rows:
            entry["ours_vs"] = {peer: paired(rows["ours"], rows[peer], verdict) for peer in PEERS if peer in rows}
        summary["sets"][set_name] = entry
    return summary


def to_markdown(results: dict) -> str:
    lines = ["# specdec bench --tools", ""]
    for set_name, entry in results["summary"]["sets"].items():
        verdict = entry["verdict"]
        title = "structured output (each function's parameters as response_format)" if set_name == "structured" \
            else f"BFCL {set_name}"
        lines += [f"## {title}", "", f"| system | problems | {verdict} | 95% interval | e2e p50 s | decode tok/s | "
                  "tokens (median) | forced share |", "|---|---|---|---|---|---|---|---|"]
        for system, row in entry["systems"].items():
            lines.append(f"| {system} | {row['problems']} | {row[verdict]} | [{number(row[verdict + '_low'])}, "
                         f"{number(row[verdict + '_high'])}] | {number(row['e2e_p50'])} | {number(row['decode_tok_s_median'], '.1f')} "
                         f"| {number(row['tokens_median'], '.0f')} | {number(row['forced_share'])} |")
        for peer, found in entry.get("ours_vs", {}).items():
            lines.append(f"\nours vs {peer} ({found['problems']} problems): decode speed {ratio_text(found['decode_speedup'])} "
                         f"({found['decode_pairs']} pairs), end-to-end speed {ratio_text(found['e2e_speedup'])}, same verdict "
                         f"{found['same_verdict']}/{found['problems']}, same output {found['same_text']}/{found['problems']}")
        lines.append("")
    return "\n".join(lines)


def write_tools_results(results: dict, out_dir: str | Path) -> dict[str, Path]:
    return write_results(results, out_dir, to_markdown(results))
