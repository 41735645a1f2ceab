"""`specdec bench --serve`: percentiles, aggregation, ratios, identity and SSE parsing on synthetic
records; the server command lines; and one run of our server on a tiny GGUF at concurrency 1 and 2
(llama-server replaced by a fake that streams like it)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import install_fake_llama_server
from specdec.bench.llamacpp_peer import server_flags
from specdec.bench.serving import run as serving
from specdec.bench.serving.client import RequestRecord, apply_event, chat_body, parse_event
from specdec.bench.serving.report import (
    add_ratios,
    identity,
    percentile,
    serial_baseline,
    serving_table,
    summarise,
    summarise_level,
    to_markdown,
)
from specdec.bench.serving.run import (
    REFERENCE,
    ServeOptions,
    level_plan,
    llama_command,
    our_command,
    parse_concurrency,
    parse_systems,
    skip_reasons,
)
from specdec.cli import main as cli
from specdec.config import ConfigError

TESTS_DIR = Path(__file__).parent


def record(task="t", id="1", text="abc", ttft=0.1, e2e=1.0, tokens=10, error=None, index=0) -> dict:
    return {"task": task, "id": id, "index": index, "text": text, "ttft": ttft, "e2e": e2e,
            "completion_tokens": tokens, "error": error}


def level(system, concurrency, records, wall=2.0, status="ok", **extra) -> dict:
    return {"system": system, "concurrency": concurrency, "records": records, "wall_seconds": wall,
            "status": status, **extra}


# --------------------------------------------------------------------------------------------- pure functions


def test_percentile_interpolates_linearly_like_numpy():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None and percentile([None, None], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_identity_counts_successful_equal_texts_and_sets_apart_prompts_without_reference():
    reference = {("t", "1"): "same", ("t", "2"): "same", ("t", "3"): "same"}
    records = [record(id="1", text="same"), record(id="2", text="other"),
               record(id="3", text="same", error="HTTP 500: boom"), record(id="4", text="x")]
    assert identity(records, reference) == {"identical": 1, "requests": 4, "without_reference": 1,
                                            "differing": ["t/2", "t/3"]}


def test_level_aggregate_counts_successful_requests_only():
    reference = {("t", str(i)): "abc" for i in range(4)}
    records = [record(id="0", ttft=0.1, e2e=1.0, tokens=10), record(id="1", ttft=0.3, e2e=2.0, tokens=20),
               record(id="2", ttft=0.2, e2e=3.0, tokens=30),
               record(id="3", ttft=None, e2e=0.5, tokens=None, text="", error="timed out after 1 s")]
    row = summarise_level(level("ours", 2, records, wall=4.0, peak_rss_bytes=300 * 2**20), reference)
    assert row["requests"] == 4 and row["failures"] == 1
    assert row["completion_tokens"] == 60 and row["tok_per_s"] == 15.0
    assert row["ttft_p50"] == pytest.approx(0.2) and row["ttft_p90"] == pytest.approx(0.28)
    assert row["e2e_p50"] == 2.0 and row["e2e_p90"] == pytest.approx(2.8)
    assert row["peak_rss_mb"] == 300.0
    assert row["identity"]["identical"] == 3 and row["identity"]["requests"] == 4
    # A successful request without a token count: no throughput rather than a wrong one.
    records[0]["completion_tokens"] = None
    assert summarise_level(level("ours", 2, records), reference)["tok_per_s"] is None
    # A server that did not start: its row says so, with no numbers.
    dead = level("llamacpp_plain", 2, [], status="failed_to_start", error="exited")
    dead = summarise_level(dead, reference)
    assert dead["status"] == "failed_to_start" and "tok_per_s" not in dead


def test_ratios_against_llama_plain_and_the_one_at_a_time_server_need_clean_levels():
    rows = [
        {"system": "ours", "concurrency": 2, "status": "ok", "failures": 0, "tok_per_s": 30.0},
        {"system": "ours_serial", "concurrency": 2, "status": "ok", "failures": 0, "tok_per_s": 20.0},
        {"system": "llamacpp_plain", "concurrency": 2, "status": "ok", "failures": 0, "tok_per_s": 25.0},
        {"system": "ours_exact", "concurrency": 2, "status": "ok", "failures": 1, "tok_per_s": 40.0},
        {"system": "ours", "concurrency": 4, "status": "ok", "failures": 0, "tok_per_s": 35.0},
        {"system": "ours_serial", "concurrency": 4, "status": "failed_to_start", "failures": 0},
    ]
    add_ratios(rows, "ours_serial")
    assert rows[0]["vs_serial"] == 1.5 and rows[0]["vs_llamacpp_plain"] == 1.2
    assert rows[1]["vs_serial"] is None and rows[1]["vs_llamacpp_plain"] == 0.8  # itself: no ratio
    assert rows[2]["vs_llamacpp_plain"] is None and rows[2]["vs_serial"] == 1.25
    assert rows[3]["vs_serial"] is None and rows[3]["vs_llamacpp_plain"] is None  # it failed a request
    assert rows[4]["vs_serial"] is None and rows[4]["vs_llamacpp_plain"] is None  # no clean baseline
    assert serial_baseline(["ours", "ours_serial"], parallel=True) == "ours_serial"
    assert serial_baseline(["ours", "ours_serial"], parallel=False) == "ours"
    assert serial_baseline(["llamacpp_plain"], parallel=True) is None


def _synthetic_results(parallel=True) -> dict:
    texts = {str(i): f"answer {i}" for i in range(3)}
    good = [record(id=i, text=t, index=int(i)) for i, t in texts.items()]
    levels = [level(REFERENCE, 1, good, wall=3.0)]
    for c in (1, 2):
        levels.append(level("ours", c, good, wall=3.0 / c))
        levels.append(level("ours_serial", c, good, wall=3.0))
    failed = record(id="2", error="HTTP 500: boom", text="", index=2)
    levels.append(level("ours_exact", 2, [*good[:2], failed]))
    levels.append(level("llamacpp_plain", 2, [], status="failed_to_start", error="exited with status 3"))
    results = {
        "config": {"systems": {REFERENCE: "r", "ours": "o", "ours_serial": "s", "ours_exact": "e",
                               "llamacpp_plain": "l"},
                   "concurrency": [1, 2], "threads": 2, "max_context_per_stream": 2048, "max_tokens": 128,
                   "num_prompts": 3, "prompts": [{"task": "t", "id": i} for i in texts],
                   "specdec_serve_parallel": parallel},
        "environment": {"cpu_model": "Test CPU", "cpu_count": 2, "argv": ["bench", "--serve"]},
        "skipped_systems": {"llamacpp_ngram": "no --spec-type"}, "levels": levels, "wall_seconds": 10.0,
    }
    results["summary"] = summarise(results)
    return results


def test_summary_table_and_markdown_report_failures_instead_of_ratios():
    results = _synthetic_results()
    summary = results["summary"]
    by_key = {(r["system"], r["concurrency"]): r for r in summary["rows"]}
    assert summary["serial_baseline"] == "ours_serial" and summary["reference_prompts"] == 3
    assert by_key[("ours", 2)]["vs_serial"] == 2.0
    assert by_key[("ours_exact", 2)]["identity"]["identical"] == 2
    assert summary["failed_levels"] == ["ours_exact@2", "llamacpp_plain@2"]
    table = serving_table(summary)
    assert "| ours | 2 | 20.0 | n/a (no baseline) | 2.00x |" in table
    assert "| ours_serial | 2 | 10.0 | n/a (no baseline) | baseline |" in table
    assert "| ours_exact | 2 | 10.0 | n/a (no baseline) | n/a (failures) |" in table and "| 1/3 |" in table
    assert "| ours | 1 | 10.0 | – | 1.00x |" in table and "| 2/3 |" in table
    assert "| llamacpp_plain | 2 | failed to start: exited with status 3 |" in table
    assert "| reference | 1 |" in table and "(the reference)" in table
    assert all(line.count("|") == 13 for line in table.splitlines())  # 12 columns on every row
    text = to_markdown(results)
    assert "Failed requests or servers in: ours_exact@2, llamacpp_plain@2" in text
    assert "`llamacpp_ngram` (no --spec-type)" in text and "t/2: HTTP 500: boom" in text
    assert "has no `--parallel`" not in text
    assert "has no `--parallel`" in to_markdown(_synthetic_results(parallel=False))


def test_sse_events_fill_the_record():
    assert parse_event("") is None and parse_event(": keep-alive") is None and parse_event("event: x") is None
    assert parse_event("data: [DONE]") == "[DONE]"
    error = {"code": 500, "message": "boom"}
    assert parse_event(f"error: {json.dumps(error)}") == {"error": error}
    assert "unparsable" in parse_event("data: {nope")["error"]["message"]
    rec = RequestRecord("t", "1", 0)
    began = 10.0
    assert not apply_event(rec, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, began, 10.5)
    assert rec.ttft is None  # an empty delta is not the first token
    apply_event(rec, {"choices": [{"delta": {"content": "Hel"}}]}, began, 11.0)
    apply_event(rec, {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}, began, 12.0)
    # llama-server: token counts from timings when there is no usage chunk ...
    apply_event(rec, {"choices": [], "timings": {"predicted_n": 3, "prompt_n": 9}}, began, 12.0)
    assert (rec.text, rec.ttft, rec.finish_reason, rec.completion_tokens, rec.tokens_source) == (
        "Hello", 1.0, "stop", 3, "timings")
    # ... and usage wins over timings whichever comes first.
    apply_event(rec, {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 8}}, began, 12.0)
    apply_event(rec, {"choices": [], "timings": {"predicted_n": 3}}, began, 12.0)
    assert (rec.completion_tokens, rec.tokens_source, rec.prompt_tokens) == (2, "usage", 8)
    assert apply_event(rec, "[DONE]", began, 12.0) and rec.ok
    assert apply_event(rec, {"error": {"message": "shutting down"}}, began, 12.0)
    assert not rec.ok and "shutting down" in rec.error
    body = chat_body("hi", 128)
    assert body["stream"] and body["temperature"] == 0 and body["max_tokens"] == 128
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_levels_run_the_reference_first_then_each_level_with_the_system_order_rotated():
    systems = ["ours", "ours_serial", "llamacpp_plain"]
    assert level_plan(systems, (1, 2, 4, 8)) == [
        (REFERENCE, 1),
        ("ours", 1), ("ours_serial", 1), ("llamacpp_plain", 1),
        ("ours_serial", 2), ("llamacpp_plain", 2), ("ours", 2),
        ("llamacpp_plain", 4), ("ours", 4), ("ours_serial", 4),
        ("ours", 8), ("ours_serial", 8), ("llamacpp_plain", 8),
    ]
    assert level_plan([], (1, 4)) == [(REFERENCE, 1)]


def test_flag_parsing():
    assert parse_concurrency("1,2,4,8") == (1, 2, 4, 8) and parse_concurrency("4, 4,2") == (4, 2)
    for bad in ("", "0", "1,x", "-1"):
        with pytest.raises(ConfigError):
            parse_concurrency(bad)
    assert parse_systems(None) == tuple(serving.SYSTEMS)
    assert parse_systems("ours,llamacpp_plain,ours") == ("ours", "llamacpp_plain")
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        parse_systems("ours,nope")


def test_bench_serve_refuses_the_method_bench_flags(capsys):
    for extra in (["--methods", "plain"], ["--turns", "2"], ["--exact"], ["--temperature", "0.7"],
                  ["--threads", "1,2"], ["--concurrency", "0"], ["--systems", "vllm"]):
        assert cli.main(["bench", "--serve", "--tasks", "humaneval", "--limit", "1", *extra]) == 2, extra
    assert "does not apply to --serve" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- commands


def _options(tmp_path, **kw) -> ServeOptions:
    base = {"model_args": ["m.gguf"], "threads": 2, "max_context": 2048, "max_tokens": 128,
            "concurrency": (1, 2, 4), "systems": tuple(serving.SYSTEMS), "target_gguf": tmp_path / "m.gguf",
            "llamacpp_bin": tmp_path / "bin"}
    base.update(kw)
    return ServeOptions(**base)


def test_our_server_commands_with_and_without_parallel(tmp_path):
    options = _options(tmp_path)
    ref = our_command(options, REFERENCE, 1, 9000, parallel=True)
    assert ref[:5] == [sys.executable, "-m", "specdec.cli.main", "serve", "m.gguf"]
    assert ref[-3:] == ["--drafter", "none", "--exact"] and "--parallel" not in ref
    assert ref[ref.index("--threads") + 1] == "2" and ref[ref.index("--max-context") + 1] == "2048"
    ours = our_command(options, "ours", 4, 9000, parallel=True)
    assert ours[-2:] == ["--parallel", "4"] and "--exact" not in ours
    assert our_command(options, "ours_serial", 4, 9000, parallel=True)[-2:] == ["--parallel", "1"]
    exact = our_command(options, "ours_exact", 4, 9000, parallel=True)
    assert "--exact" in exact and exact[-2:] == ["--parallel", "4"]
    assert "--parallel" not in our_command(options, "ours", 4, 9000, parallel=False)
    reasons = skip_reasons(_options(tmp_path, systems=("ours", "ours_serial")), parallel=False)
    assert list(reasons) == ["ours_serial"] and "no --parallel" in reasons["ours_serial"]
    assert skip_reasons(_options(tmp_path, systems=("ours", "ours_serial")), parallel=True) == {}


FAKE_LLAMA_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
if args == ["--help"]:
    spec = "" if os.path.exists(__file__ + ".old") else "--spec-type none,ngram-simple\n"
    print("-m, --model FNAME\n-np, --parallel N\n--no-webui\n" + spec)
    sys.exit(0)
if args == ["--version"]:
    print("version: 0 (fake)")
    sys.exit(0)
with open(__file__ + ".log", "a") as log:
    log.write(json.dumps(args) + "\n")
port = int(args[args.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        data = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        words = req["messages"][0]["content"].split()[: req["max_tokens"]]
        for word in words:
            chunk = {"choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.002)
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                "timings": {"predicted_n": len(words), "prompt_n": 5}}
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture()
def fake_llama_bin(tmp_path):
    folder = install_fake_llama_server(tmp_path, FAKE_LLAMA_SERVER)
    server_flags.cache_clear()
    yield folder
    server_flags.cache_clear()


def test_llama_server_gets_c_slots_each_with_our_context(tmp_path, fake_llama_bin):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    options = _options(tmp_path, llamacpp_bin=fake_llama_bin)
    plain = llama_command(options, "llamacpp_plain", 4, 9000)
    assert plain[0] == str(fake_llama_bin / "llama-server")
    assert plain[plain.index("-np") + 1] == "4" and plain[plain.index("-c") + 1] == str(4 * 2048)
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("-tb") + 1] == "2"
    assert "--no-webui" in plain and "--spec-type" not in plain
    assert llama_command(options, "llamacpp_ngram", 4, 9000)[-2:] == ["--spec-type", "ngram-simple"]
    assert skip_reasons(options, parallel=True) == {}
    (fake_llama_bin / "llama-server.old").write_text("")
    server_flags.cache_clear()
    assert "no --spec-type" in skip_reasons(options, parallel=True)["llamacpp_ngram"]
    missing = skip_reasons(_options(tmp_path, llamacpp_bin=tmp_path / "nowhere"), parallel=True)
    assert set(missing) == {"llamacpp_plain", "llamacpp_ngram"} and "not found" in missing["llamacpp_plain"]


# --------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    sys.path.insert(0, str(TESTS_DIR))
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("serving") / "tiny.gguf", seed=0, layers=2, context=4096)


def test_serving_bench_end_to_end_on_a_tiny_gguf(tmp_path, tiny_gguf, fake_llama_bin, capsys, monkeypatch):
    chat = tmp_path / "chat.jsonl"  # Spec-Bench's format: turns and category
    chat.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["Write two lines about the sea.", "Shorter."]},
        {"question_id": 2, "category": "qa", "turns": ["What is the capital of France?"]},
    ]) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--serve", str(tiny_gguf), "--tasks", "humaneval", "--limit", "1", "--prompts",
            str(chat), "--concurrency", "1,2", "--systems", "ours,ours_exact,llamacpp_plain",
            "--threads", "1", "--max-tokens", "12", "--max-context", "2048",
            "--llamacpp-bin", str(fake_llama_bin), "--request-timeout", "30", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["specdec", *argv])  # what the environment records as the command line
    began = time.monotonic()
    code = cli.main(argv)
    took = time.monotonic() - began
    assert code == 0, capsys.readouterr().err
    assert took < 60, f"the serving bench took {took:.0f} s"
    results = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()
    assert (out / "serve.png").stat().st_size > 0
    levels = {(lv["system"], lv["concurrency"]): lv for lv in results["levels"]}
    assert set(levels) == {(REFERENCE, 1), ("ours", 1), ("ours", 2), ("ours_exact", 1), ("ours_exact", 2),
                           ("llamacpp_plain", 1), ("llamacpp_plain", 2)}
    assert [(p["task"], p["id"]) for p in results["config"]["prompts"]] == [
        ("humaneval", "HumanEval/0"), ("writing", "1"), ("qa", "2")]
    for lv in levels.values():
        assert lv["status"] == "ok", lv.get("error")
        assert len(lv["records"]) == 3 and all(r["error"] is None for r in lv["records"]), lv["records"]
        assert all(r["ttft"] is not None and r["e2e"] >= r["ttft"] for r in lv["records"])
        assert lv["peak_rss_bytes"] > 0
    llama = levels[("llamacpp_plain", 2)]
    assert "-np" in llama["command"] and llama["command"][llama["command"].index("-np") + 1] == "2"
    assert all(r["tokens_source"] == "timings" for r in llama["records"])
    assert all(r["tokens_source"] == "usage" and 0 < r["completion_tokens"] <= 12
               for r in levels[("ours", 2)]["records"])
    rows = {(r["system"], r["concurrency"]): r for r in results["summary"]["rows"]}
    assert results["summary"]["failed_levels"] == []
    for c in (1, 2):  # the exact server streams exactly what plain decoding gives, at any concurrency
        assert rows[("ours_exact", c)]["identity"]["identical"] == 3
        assert rows[("ours", c)]["identity"]["requests"] == 3
        assert rows[("ours", c)]["vs_llamacpp_plain"] is not None
        assert rows[("ours", c)]["tok_per_s"] > 0 and rows[("ours", c)]["ttft_p50"] > 0
    assert "| ours_exact | 2 |" in markdown and "3/3 |" in markdown
    assert results["environment"]["threads"] == 1 and results["environment"]["cpu_flags"]
    assert results["environment"]["argv"] == argv
    assert isinstance(results["config"]["specdec_serve_parallel"], bool)
    if results["config"]["specdec_serve_parallel"]:
        assert levels[("ours", 2)]["command"][-2:] == ["--parallel", "2"]
    else:
        assert "--parallel" not in levels[("ours", 2)]["command"]
        assert "has no `--parallel`" in markdown
