"""llama.cpp's llama-server as a bench peer, against a fake llama-server written in the test: requests, timings,
process lifetime, start-up failures, method parsing and skipping, and a bench run that includes the peers."""

from __future__ import annotations

import json
import os
import stat
import sys
import time

import pytest

from specdec.bench.llamacpp_peer import (
    LlamaServer,
    PeerConfig,
    PeerError,
    PeerPool,
    binaries_dir,
    missing_reason,
)
from specdec.bench.methods import MethodOptions, resolve_methods
from specdec.config import ConfigError, SamplingParams

FAKE_SERVER = r'''
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode = args[args.index("--spec-type") + 1] if "--spec-type" in args else "none"
behaviour = open(__file__ + ".behaviour").read().strip() if __import__("os").path.exists(__file__ + ".behaviour") else ""
if behaviour == "crash":
    print("error: failed to load model", flush=True)
    sys.exit(3)
if behaviour == "hang":
    time.sleep(600)
with open(__file__ + ".log", "a") as log:
    log.write(json.dumps(args) + "\n")

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req["n_predict"]
        tokens = [(req["prompt"][-1] + i + 1) % 250 for i in range(n)]
        drafted = {"none": 0, "draft-simple": 2 * n, "ngram-simple": n}[mode]
        self._send({"tokens": tokens, "content": "x" * n, "stop_type": "limit", "tokens_predicted": n,
                    "request": req, "timings": {"prompt_n": len(req["prompt"]), "prompt_ms": 5.0,
                    "predicted_n": n, "predicted_ms": 10.0, "draft_n": drafted, "draft_n_accepted": drafted // 2}})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture()
def fake_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def _gguf(tmp_path, name="target.gguf"):
    path = tmp_path / name
    path.write_bytes(b"GGUF")
    return path


def test_server_generates_from_token_ids_and_reports_timings(fake_bin, tmp_path):
    server = LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("spec", draft_max=5),
                         draft_gguf=_gguf(tmp_path, "draft.gguf"), threads=2, context=512)
    try:
        run = server.complete([7, 8, 9], SamplingParams(max_tokens=4))
    finally:
        server.close()
    assert run.tokens == [10, 11, 12, 13] and run.finish_reason == "length"
    assert run.stats.num_draft_tokens == 8 and run.stats.num_accepted_tokens == 4
    assert run.stats.prefill_seconds == pytest.approx(0.005)
    request = json.loads(json.dumps(run.settings))
    assert request["stop_type"] == "limit"
    args = json.loads((fake_bin / "llama-server.log").read_text().splitlines()[0])
    for flag, value in (("-t", "2"), ("-tb", "2"), ("-c", "512"), ("-np", "1"), ("--spec-type", "draft-simple"),
                        ("--spec-draft-n-max", "5"), ("-td", "2")):
        assert args[args.index(flag) + 1] == value
    assert server._process.poll() is not None  # stopped


def test_greedy_requests_are_greedy_and_sampled_ones_carry_the_seed(fake_bin, tmp_path):
    import urllib.request

    server = LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"), threads=1, context=256)
    captured = []
    real_urlopen = urllib.request.urlopen

    def spy(request, timeout=None):
        if hasattr(request, "data") and request.data:
            captured.append(json.loads(request.data))
        return real_urlopen(request, timeout=timeout)

    try:
        urllib.request.urlopen = spy
        server.complete([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        server.complete([1, 2], SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=11))
    finally:
        urllib.request.urlopen = real_urlopen
        server.close()
    greedy, sampled = captured
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1 and greedy["ignore_eos"] is True
    assert greedy["prompt"] == [1, 2] and greedy["cache_prompt"] is False and greedy["n_predict"] == 3
    assert sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9 and sampled["seed"] == 11


def test_a_server_that_dies_or_hangs_is_reported_and_killed(fake_bin, tmp_path):
    behaviour = fake_bin / "llama-server.behaviour"
    behaviour.write_text("crash")
    with pytest.raises(PeerError, match="exited with status 3.*failed to load model"):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"))
    behaviour.write_text("hang")
    began = time.monotonic()
    with pytest.raises(PeerError, match="did not become healthy"):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"), start_timeout=1.5)
    assert time.monotonic() - began < 30


def test_pool_starts_one_server_per_configuration_and_stops_them(fake_bin, tmp_path):
    pool = PeerPool(fake_bin, _gguf(tmp_path), _gguf(tmp_path, "draft.gguf"), threads=1, context=256)
    params = SamplingParams(max_tokens=2)
    pool.run(PeerConfig("plain"), [5], params)
    pool.run(PeerConfig("plain"), [6], params)
    pool.run(PeerConfig("ngram"), [7], params)
    servers = list(pool._servers.values())
    assert len(servers) == 2
    pool.close()
    assert all(s._process.poll() is not None for s in servers)


def test_binaries_and_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LLAMACPP_BIN", str(tmp_path))
    assert binaries_dir() == tmp_path
    assert binaries_dir("/elsewhere") == tmp_path.__class__("/elsewhere")
    assert "not a GGUF" in missing_reason(tmp_path, None)
    assert "llama-server not found" in missing_reason(tmp_path, tmp_path / "x.gguf")


def test_methods_are_skipped_without_binaries_and_refused_when_named():
    options = MethodOptions()
    methods, skipped = resolve_methods(None, options, has_draft_model=True, has_hf_model=False,
                                       llamacpp_missing="llama-server not found")
    assert "llamacpp_plain" in skipped and "llamacpp_spec" in skipped and "llamacpp_ngram" in skipped
    assert all(m.kind != "llamacpp" for m in methods)
    with pytest.raises(ConfigError, match="llamacpp_spec.*llama-server not found"):
        resolve_methods("plain,llamacpp_spec", options, has_draft_model=True, llamacpp_missing="llama-server not found")
    methods, _ = resolve_methods("llamacpp_spec_k6,llamacpp_ngram", options, has_draft_model=True)
    names = [m.name for m in methods]
    assert names[0] == "plain" and "llamacpp_plain" in names  # both baselines are added
    spec = next(m for m in methods if m.name == "llamacpp_spec_k6")
    assert spec.llamacpp_mode == "spec" and spec.llamacpp_draft_max == 6 and spec.baseline == "llamacpp_plain"


def test_bench_runs_the_peers_beside_our_engine(fake_bin, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from specdec.backends.llamacpp_backend import LlamaCppBackend
    from specdec.bench.datasets import BenchPrompt
    from specdec.bench.report import to_markdown
    from specdec.bench.runner import BenchConfig, run_bench
    from specdec.pipeline import SpecDecoder
    from tiny_gguf import write_tiny_gguf

    target = LlamaCppBackend(write_tiny_gguf(tmp_path / "t.gguf", seed=0), max_context=256, threads=1)
    draft = LlamaCppBackend(write_tiny_gguf(tmp_path / "d.gguf", seed=1, layers=1), max_context=256, threads=1,
                            batch_invariant=False)

    class Ids:  # prompts are token ids written as words
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    decoder = SpecDecoder(target, draft)
    decoder.tokenizer = Ids()
    methods, _ = resolve_methods("plain,spec_k2,llamacpp_spec,llamacpp_ngram", MethodOptions(), has_draft_model=True)
    prompts = [BenchPrompt("humaneval", "p0", "5 6 7 8", "5 6 7 8"), BenchPrompt("code_edit", "p1", "9 10", "9 10")]
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=6, ignore_eos=True), chat=False,
                         llamacpp_bin=str(fake_bin))
    results = run_bench(decoder, prompts, config, log=lambda message: None)
    overall = results["summary"]["overall"]
    assert set(overall) == {"plain", "spec_k2", "llamacpp_plain", "llamacpp_spec", "llamacpp_ngram"}
    assert overall["spec_k2"]["identical_to_plain"] is True
    assert overall["spec_k2"]["speedup_vs_llamacpp_plain"] is not None  # ours against llama.cpp's plain too
    assert overall["llamacpp_spec"]["acceptance_rate"] == pytest.approx(0.5)
    assert overall["llamacpp_spec"]["identical_to_llamacpp_plain"] is True  # the fake is deterministic
    assert overall["llamacpp_plain"]["identical_to_plain"] in (True, False)  # compared with ours, either way
    markdown = to_markdown(results)
    assert "vs llamacpp_plain" in markdown and "over llama.cpp's plain decoding" in markdown
    assert not [p for p in os.popen("ps -eo args").read().splitlines() if str(fake_bin) in p]  # servers stopped
