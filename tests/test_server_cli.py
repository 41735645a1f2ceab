"""Server lifecycle and plumbing: background loading and /health, API keys, the FIFO worker, `specdec serve`."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from specdec.cli import main as cli  # noqa: E402
from specdec.config import SamplingParams  # noqa: E402
from specdec.core.stats import SpecStats  # noqa: E402
from specdec.decoder import SpecDecoder  # noqa: E402
from specdec.engine.output import StepOutput  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.loading.models import ModelLoadError  # noqa: E402
from specdec.server import create_app  # noqa: E402
from specdec.server.limits import ServerLimits  # noqa: E402
from specdec.server.tenants import TenantKeys, key_digest  # noqa: E402
from specdec.server.worker import EngineWorker, Job  # noqa: E402
from test_server import make_decoder, tiny_tokenizer  # noqa: E402

BODY = {"prompt": "w1 w2", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def decoder(target_model, draft_model):
    return make_decoder(target_model, draft_model, tiny_tokenizer())


def _wait_healthy(client, timeout=10.0):
    deadline = time.time() + timeout
    while client.get("/health").status_code != 200:
        assert time.time() < deadline, "server never became ready"
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------- loading


def test_health_is_503_while_loading_then_200(decoder):
    release = threading.Event()

    def loader():
        assert release.wait(10)
        return decoder

    app = create_app(loader=loader, served_model_name="tiny")
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        early = client.post("/v1/completions", json=BODY)
        assert early.status_code == 503 and early.json()["error"]["type"] == "server_error"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"  # names are known before loading
        release.set()
        _wait_healthy(client)
        out = client.post("/v1/completions", json=BODY)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1


def test_failed_load_is_reported_by_health():
    errors = []

    def loader():
        raise ModelLoadError("no such model: /nowhere")

    app = create_app(loader=loader, served_model_name="tiny", on_load_error=errors.append)
    with TestClient(app) as client:
        deadline = time.time() + 5
        while not errors and time.time() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        # The reason goes to the log and the CLI, not to clients (it names paths on the server).
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "/nowhere" not in health.text
        response = client.post("/v1/completions", json=BODY)
        assert response.status_code == 503 and "failed to load" in response.json()["error"]["message"]
        assert "/nowhere" not in response.text
    assert isinstance(errors[0], ModelLoadError)


def test_create_app_needs_a_decoder_or_loader():
    with pytest.raises(ValueError):
        create_app()


# --------------------------------------------------------------------------------------------- api key


def test_api_key_is_enforced_on_v1_only(decoder):
    app = create_app(decoder, served_model_name="tiny", api_key="sekret")
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions")):
                response = getattr(client, method)(path, headers=headers, **({"json": BODY} if method == "post" else {}))
                assert response.status_code == 401, (path, headers)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
        # A bad body without a key is an auth failure first.
        assert client.post("/v1/completions", content=b"{oops").status_code == 401
        good = {"Authorization": "Bearer sekret"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "bearer  sekret"}).status_code == 200
        assert client.post("/v1/completions", headers=good, json=BODY).status_code == 200
        assert client.get("/health").status_code == 200  # open: load balancers probe it
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):  # what describes the server: a key's
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers=good).status_code == 200, path
    with TestClient(app) as client:  # served again after a shutdown: a fresh worker takes over
        assert client.post("/v1/completions", headers=good, json=BODY).status_code == 200


def _cached(response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_share_cached_prefixes_and_a_salt_narrows_within_one(decoder, tmp_path):
    """Two keys, two tenants: the attacker's copy of the victim's prompt finds nothing cached, the victim's own
    repeat does (the negative control: the cache is on); cache_salt narrows within a tenant, never widens."""
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\nvictim {key_digest('k-victim').hex()}\nattacker sha256:{key_digest('k-att').hex()}\n")
    app = create_app(decoder, served_model_name="tiny", tenants=TenantKeys.from_file(keys),
                     limits=ServerLimits(parallel=4))  # a slot each: one partition never evicts another here
    body = {**BODY, "prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "max_tokens": 2, "temperature": 0}
    victim, attacker = {"Authorization": "Bearer k-victim"}, {"Authorization": "Bearer k-att"}
    with TestClient(app) as client:
        assert client.post("/v1/completions", headers={"Authorization": "Bearer nobody"}, json=body).status_code == 401
        first = client.post("/v1/completions", headers=victim, json=body)
        assert first.status_code == 200
        assert _cached(client.post("/v1/completions", headers=attacker, json=body)) == 0
        assert _cached(client.post("/v1/completions", headers=attacker, json={**body, "cache_salt": "x"})) == 0
        assert _cached(client.post("/v1/completions", headers=victim, json=body)) > 0
        assert _cached(client.post("/v1/completions", headers=victim, json={**body, "cache_salt": "s"})) == 0
        assert _cached(client.post("/v1/completions", headers=victim, json={**body, "cache_salt": "s"})) > 0
        again = client.post("/v1/completions", headers=victim, json=body)
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_a_bad_keys_file_is_a_one_line_config_error(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text("victim not-a-digest\n")
    with pytest.raises(ConfigError, match="keys:1: expected 'TENANT SHA256HEX'"):
        TenantKeys.from_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        TenantKeys.from_file(tmp_path / "missing")


# --------------------------------------------------------------------------------------------- worker


@dataclasses.dataclass
class FakeSequence:
    request_id: int
    prompt: list
    params: SamplingParams
    stats: SpecStats
    finish_reason: str | None = None
    emitted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RecordingEngine:
    """A stand-in BatchEngine: records the order requests start and how many ran together, one token per step;
    a step waits for the gate while the request with prompt [0] runs."""

    def __init__(self, gate: threading.Event, parallel: int = 1):
        self.gate = gate
        self.max_running = parallel
        self.running: list[FakeSequence] = []
        self.order: list[int] = []
        self.max_active = 0
        self.last_pass_rows = 0
        self._ids = itertools.count()

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.max_running

    def add(self, prompt, params, tag=None, partition=None):
        sequence = FakeSequence(next(self._ids), list(prompt), params, SpecStats(num_prompt_tokens=len(prompt)))
        self.order.append(prompt[0])
        self.running.append(sequence)
        self.max_active = max(self.max_active, len(self.running))
        return sequence

    def step(self):
        if any(s.prompt[0] == 0 for s in self.running):
            assert self.gate.wait(10)
        time.sleep(0.001)
        outputs = []
        for sequence in list(self.running):
            sequence.emitted += 1
            sequence.stats.num_generated_tokens += 1
            finish = "length" if sequence.emitted == sequence.params.max_tokens else None
            if finish:
                sequence.finish_reason = finish
                self.running.remove(sequence)
            outputs.append(StepOutput(sequence.request_id, [5], [False], f" t{sequence.prompt[0]}", finish,
                                      stats=sequence.stats))
        self.last_pass_rows = len(outputs)
        return outputs

    def abort(self, sequence):
        if sequence in self.running:
            self.running.remove(sequence)
        sequence.finish_reason = sequence.finish_reason or "abort"


def test_worker_serves_one_job_at_a_time_first_come_first_served():
    gate = threading.Event()
    engine = RecordingEngine(gate)
    worker = EngineWorker(engine)

    async def main():
        params = SamplingParams(max_tokens=3)
        jobs = [Job([i], params) for i in range(8)]
        for job in jobs:
            worker.submit(job)
        jobs[5].cancel()  # the client left while queued: never started
        await asyncio.sleep(0.05)
        assert worker.num_waiting == 7 and engine.order == [0]
        gate.set()
        results = []
        for job in jobs:
            texts = [output.text async for output in job.outputs_until_done()]
            results.append(("".join(texts), job.finish_reason))
        return results

    results = asyncio.run(main())
    worker.shutdown()
    assert engine.order == [0, 1, 2, 3, 4, 6, 7]
    assert engine.max_active == 1
    assert results[5] == ("", "abort")
    assert all(results[i] == (f" t{i}" * 3, "length") for i in range(8) if i != 5)


# --------------------------------------------------------------------------------------------- CLI


def test_serve_subcommand_is_registered_with_vllm_style_flags(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "org/target", "--draft", "org/draft", "-k", "3"])
    assert args.command == "serve" and args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key is None and args.served_model_name is None and args.k == 3
    assert callable(args.handler)
    args = parser.parse_args(["serve", "--port", "9001", "--host", "0.0.0.0", "--api-key", "k",
                              "--served-model-name", "a", "b", "-md", "d"])
    assert (args.port, args.host, args.api_key, args.served_model_name, args.draft) == (9001, "0.0.0.0", "k",
                                                                                      ["a", "b"], "d")
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert cli.build_parser().parse_args(["serve"]).api_key == "from-env"


def test_serve_without_a_draft_model_serves_with_the_suffix_drafter():
    from specdec.cli.flags import model_ref_from_args, spec_from_args

    args = cli.build_parser().parse_args(["serve", "some/model", "--port", "0"])
    ref = model_ref_from_args(args)
    assert ref.draft is None and spec_from_args(args, has_draft_model=False).drafter == "suffix"


@pytest.fixture()
def captured_servers(monkeypatch):
    servers = []
    original = uvicorn.Server.__init__

    def init(self, config):
        original(self, config)
        servers.append(self)

    monkeypatch.setattr(uvicorn.Server, "__init__", init)
    return servers


def _run_cli_in_thread(argv):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", cli.main(argv)), daemon=True)
    thread.start()
    return thread, result


def _wait_started(servers, thread, timeout=20.0):
    deadline = time.time() + timeout
    while not (servers and servers[0].started):
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{servers[0].servers[0].sockets[0].getsockname()[1]}"


def test_specdec_serve_loads_in_background_and_serves_the_openai_client(monkeypatch, captured_servers, decoder):
    release = threading.Event()
    seen = {}

    def fake_load(cls, ref=None, spec=None):
        seen["ref"], seen["spec"] = ref, spec
        assert release.wait(10)
        return SpecDecoder(decoder.target, decoder.draft, spec)

    monkeypatch.setattr(SpecDecoder, "load", classmethod(fake_load))
    thread, result = _run_cli_in_thread(["serve", "org/target", "--draft", "org/draft", "-k", "3", "--port", "0",
                                         "--api-key", "sekret", "--served-model-name", "tiny", "tiny-alias",
                                         "--log-level", "warning"])
    url = _wait_started(captured_servers, thread)
    try:
        assert httpx.get(url + "/health").status_code == 503
        release.set()
        _wait_healthy(httpx.Client(base_url=url))
        assert seen["ref"].target == "org/target" and seen["ref"].draft == "org/draft"
        assert seen["spec"].num_speculative_tokens == 3 and seen["spec"].drafter == "draft_model"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        out = client.chat.completions.create(model="tiny-alias", messages=[{"role": "user", "content": "w1"}],
                                             max_tokens=5, temperature=0)
        assert out.model == "tiny-alias" and out.model_extra["specdec"]["num_speculative_tokens"] == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        captured_servers[0].should_exit = True
        thread.join(10)
    assert result["rc"] == 0


def test_specdec_serve_exits_with_the_load_error(monkeypatch, captured_servers, capsys):
    def failing_load(cls, ref=None, spec=None):
        raise ModelLoadError("cannot find model 'org/missing'")

    monkeypatch.setattr(SpecDecoder, "load", classmethod(failing_load))
    thread, result = _run_cli_in_thread(["serve", "org/missing", "--draft", "org/draft", "--port", "0",
                                         "--log-level", "critical"])
    thread.join(20)
    assert not thread.is_alive()
    assert result["rc"] == 2
    assert "cannot find model 'org/missing'" in capsys.readouterr().err


def test_worker_runs_up_to_parallel_jobs_together_first_come_first_served():
    """--parallel 3: three jobs generate together, the rest wait in arrival order and start as slots free up."""
    gate = threading.Event()
    gate.set()
    engine = RecordingEngine(gate, parallel=3)
    worker = EngineWorker(engine)

    async def main():
        jobs = [Job([i + 1], SamplingParams(max_tokens=3 + i % 4)) for i in range(8)]
        for job in jobs:
            worker.submit(job)
        results = []
        for job in jobs:
            texts = [output.text async for output in job.outputs_until_done()]
            results.append(("".join(texts), job.finish_reason))
        return jobs, results

    jobs, results = asyncio.run(main())
    worker.shutdown()
    assert engine.order == list(range(1, 9)) and engine.max_active == 3
    for i, (text, reason) in enumerate(results):
        assert text == f" t{i + 1}" * (3 + i % 4) and reason == "length"
    assert all(job.first_token_at is not None for job in jobs)


# --------------------------------------------------------------------------------------------- --parallel default


def _serve(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def test_parallel_defaults_to_llama_servers_slot_count_on_llamacpp_and_one_on_torch(tmp_path, monkeypatch):
    from specdec.loading import models
    from specdec.server.options import AUTO_PARALLEL, limits_from_args, resolved_parallel

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")  # resolve() only needs the file to exist; nothing is loaded
    monkeypatch.setattr(models, "_require_llama_cpp", lambda: None)  # llama.cpp available
    args = _serve(str(gguf))
    assert args.parallel is None and AUTO_PARALLEL == 4
    assert limits_from_args(args).parallel == AUTO_PARALLEL and args.parallel == AUTO_PARALLEL
    assert resolved_parallel(_serve(str(gguf), "--backend", "torch")) == 1
    assert resolved_parallel(_serve(str(gguf), "--device", "cuda")) == 1
    assert resolved_parallel(_serve(str(gguf), "--parallel", "2")) == 2  # given: kept as given
    assert resolved_parallel(_serve(str(tmp_path / "missing.gguf"))) == 1  # the load will say what is wrong

    def unavailable():
        raise models.ModelLoadError("no llama-cpp-python")

    monkeypatch.setattr(models, "_require_llama_cpp", unavailable)
    assert resolved_parallel(_serve(str(gguf))) == 1  # a GGUF that falls back to torch


def test_the_parallel_default_does_not_assemble_the_packaged_model_before_the_server_listens(monkeypatch):
    """The packaged default is a GGUF file: deciding the slot count never assembles it (the background load does,
    while /health says loading)."""
    from specdec.loading import models
    from specdec.server.options import AUTO_PARALLEL, resolved_parallel

    monkeypatch.setattr(models, "_require_llama_cpp", lambda: None)
    monkeypatch.setattr(models, "assemble_packaged", lambda name: pytest.fail("assembled before listening"))
    assert resolved_parallel(_serve()) == AUTO_PARALLEL
    assert resolved_parallel(_serve("--backend", "torch")) == 1


def test_parallel_below_one_is_refused_before_the_model_is_looked_at(monkeypatch):
    from specdec.server import options as server_options

    monkeypatch.setattr(server_options, "resolved_parallel", lambda args: pytest.fail("resolved before the checks"))
    with pytest.raises(cli.UserError, match="--parallel must be at least 1"):
        server_options.limits_from_args(_serve("m.gguf", "--parallel", "0"))
