"""llama.cpp's llama-server as a bench peer, against a fake llama-server written in the test.

Requests, timings, process lifetime, start-up failures, method parsing and skipping, GGUF lookup, and a
bench run with the peers; no llama.cpp binary is needed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import install_fake_llama_server
from markov_backend import MarkovBackend
from specdec.bench import llamacpp_peer
from specdec.bench.llamacpp_peer import (
    LlamaServer,
    PeerConfig,
    PeerError,
    PeerPool,
    binaries_dir,
    gguf_files,
    missing_reason,
    server_flags,
)
from specdec.bench.method.methods import MethodOptions, resolve_methods
from specdec.config import ConfigError, SamplingParams

# The fake reads its behaviour from a file beside it: "" (serve), "crash", "hang" (never listens),
# "loading" (/health answers 503 forever), "old" (--help without --spec-type and the optional flags),
# "notokens" (/completion without token ids). It logs its argv and pid there too.
FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

here = __file__


def current():
    return open(here + ".behaviour").read().strip() if os.path.exists(here + ".behaviour") else ""


behaviour = current()
args = sys.argv[1:]
if args == ["--help"]:
    flags = "-m, --model FNAME\n-t, --threads N\n--port PORT\n-lv, --verbosity, --log-verbosity N\n"
    if behaviour != "old":
        flags += "--ui, --webui, --no-ui, --no-webui\n--spec-type none,draft-simple,ngram-simple\n"
    print(flags)
    sys.exit(0)
with open(here + ".pids", "a") as log:
    log.write(f"{os.getpid()}\n")
with open(here + ".log", "a") as log:
    log.write(json.dumps(args) + "\n")
port = int(args[args.index("--port") + 1])
mode = args[args.index("--spec-type") + 1] if "--spec-type" in args else "none"
if behaviour == "crash":
    print("error: failed to load model", flush=True)
    sys.exit(3)
if behaviour == "hang":
    time.sleep(600)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body, status=200):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if behaviour == "loading":
            self._send({"error": {"code": 503, "message": "Loading model"}}, 503)
        else:
            self._send({"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(here + ".requests", "a") as log:
            log.write(json.dumps(req) + "\n")
        n = req["n_predict"]
        tokens = [(req["prompt"][-1] + i + 1) % 250 for i in range(n)]
        drafted = {"none": 0, "draft-simple": 2 * n, "ngram-simple": n}[mode]
        timings = {"prompt_n": len(req["prompt"]), "prompt_ms": 5.0, "prompt_per_second": 600.0,
                   "predicted_n": n, "predicted_ms": 10.0, "predicted_per_second": 100.0 * n}
        if drafted:  # like llama-server: the draft counts only appear once something was drafted
            timings.update(draft_n=drafted, draft_n_accepted=drafted // 2)
        body = {"content": "x" * n, "stop_type": "limit", "tokens_predicted": n, "timings": timings}
        if current() != "notokens":
            body["tokens"] = tokens if req.get("return_tokens") else []
        self._send(body)

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture()
def fake_bin(tmp_path):
    folder = install_fake_llama_server(tmp_path, FAKE_SERVER)
    server_flags.cache_clear()
    yield folder
    for pid in _pids(folder):  # never leave a fake behind, even when a test fails
        if _alive(pid):
            os.kill(pid, 9)


def _behave(folder: Path, behaviour: str) -> None:
    (folder / "llama-server.behaviour").write_text(behaviour)
    server_flags.cache_clear()


def _pids(folder: Path) -> list[int]:
    log = folder / "llama-server.pids"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it has exited, it only was not reaped (by whoever is not us).
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _args(folder: Path, index: int = 0) -> list[str]:
    return json.loads((folder / "llama-server.log").read_text().splitlines()[index])


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
    assert run.stats.acceptance_rate == pytest.approx(0.5)
    assert run.stats.prefill_seconds == pytest.approx(0.005) and run.stats.num_prompt_tokens == 3
    assert run.settings["stop_type"] == "limit" and run.settings["timings"]["predicted_per_second"] == 400.0
    args = _args(fake_bin)
    for flag, value in (("-t", "2"), ("-tb", "2"), ("-td", "2"), ("-tbd", "2"), ("-c", "512"), ("-np", "1"),
                        ("--host", "127.0.0.1"), ("--spec-type", "draft-simple"), ("--spec-draft-n-max", "5"),
                        ("--log-verbosity", "2")):
        assert args[args.index(flag) + 1] == value
    assert args[args.index("-md") + 1].endswith("draft.gguf") and "--no-webui" in args
    assert "--cache-ram" not in args  # this fake's --help does not list it: optional flags only when listed
    assert not server.running and not _alive(server.pid)


def test_plain_and_ngram_configurations_and_default_draft_length(fake_bin, tmp_path):
    pool = PeerPool(fake_bin, _gguf(tmp_path), _gguf(tmp_path, "draft.gguf"), threads=1, context=256)
    params = SamplingParams(max_tokens=2)
    try:
        plain = pool.run(PeerConfig("plain"), [5], params)
        ngram = pool.run(PeerConfig("ngram"), [7], params)
        pool.run(PeerConfig("spec"), [7], params)
    finally:
        pool.close()
    assert plain.stats.num_draft_tokens == 0 and ngram.stats.num_draft_tokens == 2
    plain_args, ngram_args, spec_args = (_args(fake_bin, i) for i in range(3))
    assert "--spec-type" not in plain_args and "-md" not in plain_args and "-td" not in plain_args
    assert ngram_args[ngram_args.index("--spec-type") + 1] == "ngram-simple" and "-md" not in ngram_args
    assert "--spec-draft-n-max" not in spec_args  # llama.cpp's own default draft length


def test_greedy_requests_are_greedy_and_sampled_ones_spell_out_every_sampler(fake_bin, tmp_path):
    server = LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"), threads=1, context=256)
    try:
        server.complete([1, 2], SamplingParams(max_tokens=3))
        server.complete([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        server.complete([1, 2], SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=11))
    finally:
        server.close()
    requests = (fake_bin / "llama-server.requests").read_text().splitlines()
    greedy, no_eos, sampled = (json.loads(line) for line in requests)
    assert greedy["prompt"] == [1, 2] and greedy["n_predict"] == 3
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1
    assert greedy["cache_prompt"] is False and greedy["return_tokens"] is True and greedy["stream"] is False
    assert "ignore_eos" not in greedy and no_eos["ignore_eos"] is True  # stops at the model's EOS by default
    assert sampled["temperature"] == 0.7 and sampled["top_p"] == 0.9 and sampled["seed"] == 11
    assert sampled["top_k"] == 0 and sampled["min_p"] == 0.0  # not llama-server's defaults (40, 0.05)


def test_a_server_that_dies_is_reported_with_its_log(fake_bin, tmp_path):
    _behave(fake_bin, "crash")
    with pytest.raises(PeerError, match="exited with status 3.*failed to load model"):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"))


@pytest.mark.parametrize("behaviour", ["hang", "loading"])
def test_a_server_that_never_becomes_healthy_times_out_and_is_killed(fake_bin, tmp_path, behaviour):
    _behave(fake_bin, behaviour)
    began = time.monotonic()
    with pytest.raises(PeerError, match=r"did not become healthy within 2s"):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"), start_timeout=1.5)
    assert time.monotonic() - began < 30
    (pid,) = _pids(fake_bin)
    assert not _alive(pid)


def test_an_interrupt_while_starting_stops_the_server(fake_bin, tmp_path, monkeypatch):
    _behave(fake_bin, "loading")
    def interrupt_once_it_runs(seconds):  # Ctrl-C between two /health polls of a loading server
        time.sleep(seconds)
        if _pids(fake_bin):
            raise KeyboardInterrupt

    clock = SimpleNamespace(monotonic=time.monotonic, perf_counter=time.perf_counter, sleep=interrupt_once_it_runs)
    monkeypatch.setattr(llamacpp_peer, "time", clock)
    with pytest.raises(KeyboardInterrupt):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"), start_timeout=60)
    (pid,) = _pids(fake_bin)
    assert not _alive(pid)


def test_a_build_without_speculation_or_token_ids_is_refused_clearly(fake_bin, tmp_path):
    _behave(fake_bin, "old")
    with pytest.raises(PeerError, match="no --spec-type option"):
        LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("ngram"))
    assert not _pids(fake_bin)  # refused before anything was started
    server = LlamaServer(fake_bin, _gguf(tmp_path), PeerConfig("plain"))
    try:
        assert "--no-webui" not in server.command and "--log-verbosity" in server.command
        _behave(fake_bin, "notokens")
        with pytest.raises(PeerError, match="no token ids"):
            server.complete([1], SamplingParams(max_tokens=2))
    finally:
        server.close()


def test_pool_starts_one_server_per_configuration_and_stops_them(fake_bin, tmp_path):
    pool = PeerPool(fake_bin, _gguf(tmp_path), _gguf(tmp_path, "draft.gguf"), threads=1, context=256)
    params = SamplingParams(max_tokens=2)
    pool.run(PeerConfig("plain"), [5], params)
    pool.run(PeerConfig("plain"), [6], params)
    pool.run(PeerConfig("ngram"), [7], params)
    servers = list(pool._servers.values())
    assert len(servers) == 2 and len(_pids(fake_bin)) == 2
    pool.close()
    pool.close()  # twice is harmless
    assert not any(s.running for s in servers) and not any(_alive(p) for p in _pids(fake_bin))


def test_binaries_and_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LLAMACPP_BIN", str(tmp_path))
    assert binaries_dir() == tmp_path
    assert binaries_dir("/elsewhere") == Path("/elsewhere")
    monkeypatch.delenv("SPECDEC_LLAMACPP_BIN")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    assert binaries_dir().parent.parent == tmp_path / "cache" and binaries_dir().name == "bin"
    assert binaries_dir().parent.name.startswith("llama.cpp-")
    assert "not a GGUF" in missing_reason(tmp_path, None)
    assert "llama-server not found" in missing_reason(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "llama-server").write_text("not executable")
    assert "llama-server not found" in missing_reason(tmp_path, tmp_path / "x.gguf")


def test_gguf_files_come_from_the_backends_else_from_the_model_references(tmp_path, monkeypatch):
    llama = SimpleNamespace(target=SimpleNamespace(gguf_path="/m/t.gguf"),
                            draft=SimpleNamespace(gguf_path="/m/d.gguf"))
    assert gguf_files(llama, "ignored", "ignored") == (Path("/m/t.gguf"), Path("/m/d.gguf"))
    torch_pair = SimpleNamespace(target=MarkovBackend(torch.zeros(4, 4)), draft=MarkovBackend(torch.zeros(4, 4)))
    target = _gguf(tmp_path)
    assert gguf_files(torch_pair) == (None, None)  # no references: nothing to resolve
    assert gguf_files(torch_pair, str(target), "org/name") == (target.resolve(), None)
    assert gguf_files(SimpleNamespace(target=torch_pair.target, draft=None), str(target), str(target))[1] is None
    assert gguf_files(torch_pair, str(tmp_path / "missing.gguf"), None) == (None, None)

    import specdec.bench.llamacpp_peer
    import specdec.loading.models

    asked = []

    def packaged(reference):
        asked.append(reference)
        return specdec.loading.models.ResolvedModel(str(tmp_path), f"{reference}.gguf")

    monkeypatch.setattr(specdec.bench.llamacpp_peer, "resolve", packaged)
    assert gguf_files(torch_pair, "default", "default") == (tmp_path / "default-target.gguf",
                                                            tmp_path / "default-draft.gguf")
    assert asked == ["default-target", "default-draft"]


def test_methods_are_skipped_without_binaries_and_refused_when_named():
    options = MethodOptions()
    methods, skipped = resolve_methods(None, options, has_draft_model=True, has_hf_model=False,
                                       llamacpp_missing="llama-server not found")
    assert "llamacpp_plain" in skipped and "llamacpp_spec" in skipped and "llamacpp_ngram" in skipped
    assert all(m.kind != "llamacpp" for m in methods) and "plain" in [m.name for m in methods]
    with pytest.raises(ConfigError, match="'llamacpp_spec' cannot run: not built"):
        resolve_methods("plain,llamacpp_spec", options, has_draft_model=True, llamacpp_missing="not built")
    with pytest.raises(ConfigError, match="'llamacpp_plain' cannot run: not built"):
        resolve_methods("plain,llamacpp_plain", options, has_draft_model=True, llamacpp_missing="not built")
    methods, skipped = resolve_methods(None, options, has_draft_model=True, has_hf_model=False,
                                       llamacpp_draft_missing="the draft is not a GGUF file")
    assert skipped == {"llamacpp_spec": "the draft is not a GGUF file", **{k: v for k, v in skipped.items()
                                                                            if not k.startswith("llamacpp")}}
    assert {"llamacpp_plain", "llamacpp_ngram"} <= {m.name for m in methods}
    methods, _ = resolve_methods("llamacpp_spec_k6,llamacpp_ngram", options, has_draft_model=True)
    names = [m.name for m in methods]
    assert names[0] == "plain" and "llamacpp_plain" in names  # both baselines are added
    spec = next(m for m in methods if m.name == "llamacpp_spec_k6")
    assert spec.llamacpp_mode == "spec" and spec.llamacpp_draft_max == 6 and spec.baseline == "llamacpp_plain"
    default_spec = next(m for m in resolve_methods("llamacpp_spec", options)[0] if m.name == "llamacpp_spec")
    assert default_spec.llamacpp_draft_max is None  # llama.cpp's default draft length
    with pytest.raises(ConfigError, match="k must be in"):
        resolve_methods("llamacpp_spec_k0", options)


def _torch_decoder_with_gguf_paths(tmp_path):
    """The bench's tiny torch pair, labelled with GGUF paths the way a llama.cpp backend labels itself."""
    from specdec.backends.pytorch.backend import TransformersBackend
    from specdec.decoder import SpecDecoder
    from test_bench import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target = TransformersBackend(tiny_model(0, 2), tokenizer, name="tiny-target", max_context=1024)
    draft = TransformersBackend(tiny_model(1, 1), tokenizer, name="tiny-draft", max_context=1024)
    target.gguf_path, draft.gguf_path = _gguf(tmp_path), _gguf(tmp_path, "draft.gguf")
    return SpecDecoder(target, draft)


def test_cli_errors_from_the_peer_are_one_line_config_errors(fake_bin, tmp_path, capsys):
    from specdec.bench.cli import run_bench_command
    from specdec.cli.main import build_parser

    decoder = _torch_decoder_with_gguf_paths(tmp_path)
    base = ["bench", "--limit", "1", "--tasks", "code_edit", "--max-tokens", "3", "--no-warmup", "--no-plot",
            "--out", str(tmp_path / "res")]
    empty = tmp_path / "empty"
    empty.mkdir()
    args = build_parser().parse_args([*base, "--methods", "plain,llamacpp_ngram", "--llamacpp-bin",
                                      str(empty)])
    with pytest.raises(ConfigError, match="'llamacpp_ngram' cannot run: llama-server not found in"):
        run_bench_command(args, decoder=decoder, log=lambda message: None)
    _behave(fake_bin, "crash")
    args = build_parser().parse_args([*base, "--methods", "plain,llamacpp_plain", "--llamacpp-bin",
                                      str(fake_bin)])
    with pytest.raises(ConfigError, match="llama.cpp peer: llama-server exited with status 3") as info:
        run_bench_command(args, decoder=decoder, log=lambda message: None)
    assert "\n" not in str(info.value)
    assert not any(_alive(p) for p in _pids(fake_bin))


def test_bench_runs_the_peers_beside_our_engine(fake_bin, tmp_path):
    pytest.importorskip("llama_cpp")
    from specdec.backends.llamacpp.backend import LlamaCppBackend
    from specdec.bench.datasets import BenchPrompt
    from specdec.bench.method.render import to_markdown
    from specdec.bench.method.runner import BenchConfig, run_bench
    from specdec.decoder import SpecDecoder
    from tiny_gguf import write_tiny_gguf

    target = LlamaCppBackend(write_tiny_gguf(tmp_path / "t.gguf", seed=0), max_context=256, threads=1)
    draft = LlamaCppBackend(write_tiny_gguf(tmp_path / "d.gguf", seed=1, layers=1), max_context=256,
                            threads=1, batch_invariant=False)

    class Ids:  # prompts are token ids written as words
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    decoder = SpecDecoder(target, draft)
    decoder.tokenizer = Ids()
    methods, _ = resolve_methods("plain,spec_k2,llamacpp_spec,llamacpp_ngram", MethodOptions(),
                                 has_draft_model=True)
    prompts = [BenchPrompt("humaneval", "p0", "5 6 7 8", "5 6 7 8"),
               BenchPrompt("code_edit", "p1", "9 10", "9 10")]
    config = BenchConfig(methods=methods, params=SamplingParams(max_tokens=6, ignore_eos=True), chat=False,
                         llamacpp_bin=str(fake_bin))
    results = run_bench(decoder, prompts, config, log=lambda message: None)
    args = _args(fake_bin)
    assert args[args.index("-m") + 1] == str(tmp_path / "t.gguf")  # the backends' own files
    assert args[args.index("-c") + 1] == "256" and args[args.index("-t") + 1] == "1"
    overall = results["summary"]["overall"]
    assert set(overall) == {"plain", "spec_k2", "llamacpp_plain", "llamacpp_spec", "llamacpp_ngram"}
    assert overall["spec_k2"]["identical_to_plain"] is True
    assert overall["spec_k2"]["speedup_vs_llamacpp_plain"] is not None  # ours against llama.cpp's plain too
    assert overall["spec_k2"].get("identical_to_llamacpp_plain") is None  # ours are held to plain only
    assert overall["llamacpp_spec"]["acceptance_rate"] == pytest.approx(0.5)
    assert overall["llamacpp_spec"]["mean_acceptance_length"] is None  # llama-server reports no draft count
    assert overall["llamacpp_spec"]["speedup"] and overall["llamacpp_spec"]["speedup_vs_llamacpp_plain"]
    assert overall["llamacpp_spec"]["identical_to_llamacpp_plain"] is True  # the fake is deterministic
    assert overall["llamacpp_plain"]["identical_to_plain"] in (True, False)  # compared with ours, either way
    run = next(r for r in results["runs"] if r["method"] == "llamacpp_spec")
    assert run["llamacpp_settings"]["timings"]["draft_n"] == 12
    markdown = to_markdown(results)
    assert "vs llamacpp_plain" in markdown and "over llama.cpp's plain decoding" in markdown
    assert "draft_n_accepted / draft_n" in markdown
    pids = _pids(fake_bin)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)  # one server per configuration, all stopped
