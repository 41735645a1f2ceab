"""Server hardening against hostile or unlucky clients: body size limit, off-loop tokenizing, header and body
read deadlines, the queue limit, the Host check, and graceful shutdown (in process and by a real SIGTERM)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx
from fastapi.testclient import TestClient

from specdec.cli import main as cli
from specdec.server import create_app
from specdec.server.http_protocol import header_deadline_protocol
from specdec.server.limits import LOOPBACK_HOSTS, ServerLimits, host_check_list, host_name, is_loopback
from specdec.server.shutdown import GracefulServer
from test_server import LiveServer as Live
from test_server import SlowBackend, make_decoder, tiny_tokenizer

BODY = {"prompt": "w1 w2", "max_tokens": 4, "temperature": 0}
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def decoder(target_model, draft_model):
    return make_decoder(target_model, draft_model, tiny_tokenizer())


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, then read until the server closes the connection (socket.timeout if it never does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        if data:
            sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def parse_response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


def in_thread(fn):
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_until(condition, timeout=10.0, what="condition"):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_openai_error(body: dict, code: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, body


# --------------------------------------------------------------------------------------------- item 3


@pytest.mark.parametrize("route", ["completion", "chat"])
def test_health_answers_while_a_big_prompt_is_tokenized(target_model, draft_model, route):
    """A tokenizer that takes long (here: blocked until released) must not stall the event loop."""
    decoder = make_decoder(target_model, draft_model, tiny_tokenizer())
    entered, release = threading.Event(), threading.Event()
    name = "encode" if route == "completion" else "encode_chat"
    real = getattr(decoder, name)

    def slow(*args, **kwargs):
        entered.set()
        assert release.wait(20)
        return real(*args, **kwargs)

    setattr(decoder, name, slow)
    path, body = ("/v1/completions", BODY) if route == "completion" else (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 3})
    with Live(create_app(decoder, served_model_name="tiny")) as live:
        thread, result = in_thread(lambda: httpx.post(live.url + path, json=body, timeout=30))
        assert entered.wait(10)
        try:
            health = httpx.get(live.url + "/health", timeout=5)  # on the loop-blocking code this times out
        finally:
            release.set()
        thread.join(30)
    assert health.status_code == 200
    assert result["value"].status_code == 200, result


def test_request_body_size_limit(decoder):
    app = create_app(decoder, served_model_name="tiny", limits=ServerLimits(max_request_bytes=2048))
    with Live(app) as live:
        small = httpx.post(live.url + "/v1/completions", json=BODY, timeout=30)
        assert small.status_code == 200  # control: under the limit
        big = httpx.post(live.url + "/v1/completions", json={**BODY, "prompt": "w1 " * 1000}, timeout=30)
        assert big.status_code == 413
        assert_openai_error(big.json(), "request_too_large")
        # A huge Content-Length is refused from the headers alone, before any body byte is sent.
        status, error = parse_response(raw_exchange(live.port, (
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52000000\r\n\r\n")))
        assert status == 413
        assert_openai_error(error, "request_too_large")
        # Without a Content-Length (chunked), the body is counted as it streams in.
        chunk = b"x" * 1000
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
        status, error = parse_response(raw_exchange(live.port, (
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked)))
        assert status == 413
        assert_openai_error(error, "request_too_large")
        metrics = httpx.get(live.url + "/metrics").text
        assert re.search(r'specdec:request_errors_total\{[^}]*status="413"[^}]*\} 3\.0', metrics)


# --------------------------------------------------------------------------------------------- item 5


def test_partial_headers_and_missing_bodies_time_out(decoder):
    app = create_app(decoder, served_model_name="tiny", limits=ServerLimits(read_timeout=1.0))
    with Live(app, http=header_deadline_protocol(1.0)) as live:
        # raw_exchange's 10 s socket timeout bounds every wait below: a connection left open fails the test.
        status, error = parse_response(raw_exchange(live.port, b"POST /v1/completions HTTP/1.1\r\nHost: local"))
        assert status == 408
        assert_openai_error(error, "request_timeout")
        assert raw_exchange(live.port, b"") == b""  # connected and silent: closed
        status, error = parse_response(raw_exchange(live.port, (
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"prompt\": ")))
        assert status == 408
        assert_openai_error(error, "request_timeout")
        # A kept-alive connection: the first request is served, the next one's headers get a fresh deadline.
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            first = b""
            while b'"ok"' not in first:
                first += sock.recv(65536)
            assert first.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            rest = b""
            while chunk := sock.recv(65536):
                rest += chunk
        assert rest.startswith(b"HTTP/1.1 408")
        assert httpx.get(live.url + "/health").status_code == 200  # the server is fine


class GatedEngine:
    """Wraps the worker's BatchEngine; every step waits for the gate first (a worker busy for as long as we like)."""

    def __init__(self, batch, gate: threading.Event):
        self._batch = batch
        self._gate = gate

    def step(self):
        assert self._gate.wait(20)
        return self._batch.step()

    def __getattr__(self, name):
        return getattr(self._batch, name)


def test_queue_limit_answers_429_with_retry_after(decoder):
    app = create_app(decoder, served_model_name="tiny", limits=ServerLimits(max_queue=2))
    state = app.state.specdec
    gate = threading.Event()
    state.worker.batch = GatedEngine(state.worker.batch, gate)
    with Live(app) as live:
        calls = []
        try:
            calls.append(in_thread(lambda: httpx.post(live.url + "/v1/completions", json=BODY, timeout=30)))
            wait_until(lambda: state.worker.current is not None, what="the first request to run")
            for _ in range(2):
                calls.append(in_thread(lambda: httpx.post(live.url + "/v1/completions", json=BODY, timeout=30)))
            wait_until(lambda: state.worker.num_waiting == 2, what="two queued requests")
            full = httpx.post(live.url + "/v1/completions", json=BODY, timeout=5)  # unbounded queue: times out
            assert full.status_code == 429 and full.headers["Retry-After"].isdigit()
            assert_openai_error(full.json(), "queue_full")
            assert full.json()["error"]["type"] == "rate_limit_error"
        finally:
            gate.set()
        for thread, result in calls:
            thread.join(30)
            assert result["value"].status_code == 200, result
        assert httpx.post(live.url + "/v1/completions", json=BODY, timeout=30).status_code == 200  # room again


# --------------------------------------------------------------------------------------------- item 10


def test_host_names_and_when_the_check_is_on():
    assert host_name("LocalHost:8000") == "localhost" and host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("[::1]:9") == "[::1]" and host_name("::1") == "[::1]" and host_name("example.com.") == "example.com"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")
    assert host_check_list("127.0.0.1", None, None) == list(LOOPBACK_HOSTS)
    assert host_check_list("127.0.0.1", "key", None) is None  # a key already stops a foreign page
    assert host_check_list("0.0.0.0", None, None) is None
    assert host_check_list("127.0.0.1", None, ["my.box"]) == [*LOOPBACK_HOSTS, "my.box"]
    assert host_check_list("0.0.0.0", "key", ["my.box"]) == ["my.box"]
    assert host_check_list("127.0.0.1", None, ["*"]) is None


def test_host_check_refuses_foreign_host_headers(decoder):
    app = create_app(decoder, served_model_name="tiny", allowed_hosts=[*LOOPBACK_HOSTS, "my.box"])
    with TestClient(app) as client:
        for host in ("localhost:8000", "127.0.0.1", "[::1]:1234", "LOCALHOST", "my.box:80"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", "localhost.evil.example:8000", "127.0.0.1.nip.io", "testserver"):
            for path in ("/v1/models", "/health", "/docs", "/openapi.json"):
                response = client.get(path, headers={"Host": host})
                assert response.status_code == 400, (host, path)
                assert_openai_error(response.json(), "invalid_host")
        assert client.post("/v1/completions", json=BODY, headers={"Host": "evil.example"}).status_code == 400
    with TestClient(create_app(decoder, served_model_name="tiny")) as client:  # control: no list, no check
        assert client.get("/v1/models", headers={"Host": "evil.example"}).status_code == 200


# --------------------------------------------------------------------------------------------- item 4


@pytest.fixture()
def slow_decoder(target_model, draft_model):
    return make_decoder(target_model, draft_model, tiny_tokenizer(), backend_cls=SlowBackend)


def _stream_events(url: str, body: dict, first_event: threading.Event):
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                first_event.set()
    return events


@pytest.mark.parametrize("grace, finishes", [(30.0, True), (0.2, False)])
def test_graceful_drain(slow_decoder, grace, finishes):
    """Stop requested with a stream running and a request queued: the queued one gets 503 at once; the stream
    finishes if it can within the grace period, else it ends with an error event; either way with [DONE]."""
    app = create_app(slow_decoder, served_model_name="tiny")
    state = app.state.specdec
    gate = threading.Event()  # holds the running stream until the stop has been requested
    state.worker.batch = GatedEngine(state.worker.batch, gate)
    max_tokens = 6 if finishes else 200  # 200 tokens take seconds on SlowBackend
    stream_body = {"prompt": "w1 w2", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with Live(app, server_cls=GracefulServer, drain=lambda: state.drain(grace)) as live:
        try:
            streaming = in_thread(lambda: _stream_events(live.url, stream_body, threading.Event()))
            wait_until(lambda: state.worker.current is not None, what="the stream to run")
            queued = in_thread(lambda: httpx.post(live.url + "/v1/completions", json=BODY, timeout=30))
            wait_until(lambda: state.worker.num_waiting == 1, what="a queued request")
            live.server.handle_exit(signal.SIGTERM, None)
            queued[0].join(20)
            response = queued[1]["value"]
            assert response.status_code == 503
            assert_openai_error(response.json(), "server_shutting_down")
        finally:
            gate.set()
        streaming[0].join(30)
        live.thread.join(20)
        assert not live.thread.is_alive(), "the server did not stop"
    events = streaming[1]["value"]
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    if finishes:
        assert not errors and events[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert len(errors) == 1 and events[-2] is errors[0]
        assert_openai_error(errors[0], "server_shutting_down")


SERVE_SCRIPT = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from conftest import tiny_qwen2, tiny_tokenizer
from specdec.cli import main as cli
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.decoder import SpecDecoder

class Slow(TransformersBackend):
    def forward(self, tokens, cache, num_logits=1):
        time.sleep(0.05)
        return super().forward(tokens, cache, num_logits)

def load(cls, ref=None, spec=None):
    return SpecDecoder(Slow(tiny_qwen2(0, layers=1), tiny_tokenizer(), name="tiny", max_context=512), None, spec)

SpecDecoder.load = classmethod(load)
sys.exit(cli.main(sys.argv[2:]))
"""


def test_sigterm_ends_open_streams_cleanly_and_exits_0():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(TESTS_DIR), "serve", "org/tiny", "--drafter", "none",
         "--port", "0", "--shutdown-grace", "0.5", "--log-level", "info"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Uvicorn running on" in line for line in log) or proc.poll() is not None,
                   timeout=60, what="the server to listen")
        assert proc.poll() is None, "".join(log)
        url = re.search(r"Uvicorn running on (http://\S+)", "".join(log)).group(1)
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30, what="/health 200")
        # Item 10 through the CLI: bound to loopback without a key, a foreign Host is refused.
        foreign = httpx.get(url + "/v1/models", headers={"Host": "attacker.example"})
        assert foreign.status_code == 400 and foreign.json()["error"]["code"] == "invalid_host"

        body = {"prompt": "w5 w6", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        started = threading.Event()
        streaming = in_thread(lambda: _stream_events(url, body, started))
        assert started.wait(30), streaming[1]
        queued = in_thread(lambda: httpx.post(url + "/v1/completions", json=BODY, timeout=30))
        wait_until(lambda: re.search(r"^specdec:num_requests_waiting\{[^}]*\} 1\.0$",
                                     httpx.get(url + "/metrics").text, re.MULTILINE), what="a queued request")
        proc.send_signal(signal.SIGTERM)
        queued[0].join(30)
        assert queued[1]["value"].status_code == 503, queued[1]
        assert_openai_error(queued[1]["value"].json(), "server_shutting_down")
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.get(url + "/health", timeout=5)
        streaming[0].join(30)
        events = streaming[1]["value"]
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert_openai_error(events[-2], "server_shutting_down")
        assert proc.wait(30) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(5)


# --------------------------------------------------------------------------------------------- CLI flags


def test_serve_limit_flags(monkeypatch, capsys):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "org/t", "--drafter", "none"])
    assert (args.max_request_bytes, args.max_queue, args.read_timeout, args.shutdown_grace, args.allowed_hosts) == (
        8 * 1024 * 1024, 64, 30.0, 10.0, None)
    args = cli.build_parser().parse_args(["serve", "org/t", "--max-request-bytes", "100", "--max-queue", "3",
                                          "--read-timeout", "2.5", "--shutdown-grace", "0",
                                          "--allowed-hosts", "a.lan", "b.lan"])
    assert (args.max_request_bytes, args.max_queue, args.read_timeout, args.shutdown_grace, args.allowed_hosts) == (
        100, 3, 2.5, 0.0, ["a.lan", "b.lan"])
    for flag, value in (("--max-request-bytes", "0"), ("--max-queue", "-1"), ("--read-timeout", "0"),
                        ("--read-timeout", "inf"), ("--shutdown-grace", "-1"), ("--shutdown-grace", "nan")):
        assert cli.main(["serve", "org/t", "--drafter", "none", flag, value]) == 2, flag
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
