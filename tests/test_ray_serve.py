"""`specdec serve --replicas`: Ray Serve replicas of the engine behind one OpenAI endpoint (server/ray_serve.py).

The pure parts (affinity keys, rendezvous order, holding back a stream's opening, merged metrics, flag checks)
run without Ray. The rest starts its own local Ray instance (2 CPUs, no dashboard) with 2 engine replicas on
tiny GGUF files written here, loaded by each replica through the normal model-loading path, and stops it at
the end: OpenAI client chat and streaming through Ray's proxy, greedy output identical to `specdec serve`'s
app on the same pair, affinity, metrics, and a replica killed with SIGKILL mid-stream: its stream ends with a
clear error event, the request queued behind it is answered by the other replica, a stream on the other
replica is untouched, and Ray Serve starts a replacement that serves later requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from specdec.server import ray_affinity

pytest.importorskip("prometheus_client")  # the server extra; tests that need Ray skip without it one by one

from specdec.server.ray_metrics import ReplicaBoard, merged_exposition, summary, totals_of  # noqa: E402

# ------------------------------------------------------------------------------------- affinity (no Ray)


def test_affinity_key_prefers_the_session_header_then_openai_fields_then_the_conversation_opening():
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    later = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"},
                                             {"role": "user", "content": "more"}], "max_tokens": 9}
    body = json.dumps(chat).encode()
    key = ray_affinity.affinity_key({}, body)
    assert key.startswith("chat:") and key == ray_affinity.affinity_key({}, json.dumps(later).encode())
    other = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]}
    assert ray_affinity.affinity_key({}, json.dumps(other).encode()) != key
    assert ray_affinity.affinity_key({"x-session-id": "s1"}, body).startswith("session:")
    assert ray_affinity.affinity_key([(b"X-Session-ID", b"s1")], body) == ray_affinity.affinity_key(
        {"x-session-id": "s1"}, None)
    assert ray_affinity.affinity_key({}, json.dumps({**chat, "user": "u"}).encode()).startswith("user:")
    # prompt_cache_key names the conversation and narrows its cache partition, as on the replicas.
    keyed = ray_affinity.affinity_key({}, json.dumps({**chat, "user": "u", "prompt_cache_key": "p"}).encode())
    assert keyed.startswith("partitioned:") and keyed == ray_affinity.affinity_key(
        {}, json.dumps({**later, "prompt_cache_key": "p"}).encode())
    long_prompt = "x" * 300
    assert ray_affinity.affinity_key({}, json.dumps({"prompt": long_prompt}).encode()) == ray_affinity.affinity_key(
        {}, json.dumps({"prompt": long_prompt + " and more"}).encode())
    assert ray_affinity.affinity_key({}, json.dumps({"prompt": [[1, 2, 3]]}).encode()).startswith("tokens:")
    for unkeyed in (b"", b"{oops", b"[1]", json.dumps({"messages": [{"role": "system", "content": "s"}]}).encode()):
        assert ray_affinity.affinity_key({}, unkeyed) is None


def test_affinity_keys_are_taken_within_the_tenants_partition():
    """Another tenant sending the victim's opening (or session id) must not be routed by it: the same
    conversation under two tenants gets two unrelated keys, and within one tenant it keeps one key."""
    chat = json.dumps({"messages": [{"role": "user", "content": "Door PIN: 4831"}]}).encode()
    victim, attacker = (ray_affinity.affinity_key({}, chat, tenant) for tenant in ("alice", "mallory"))
    assert victim != attacker and victim == ray_affinity.affinity_key({}, chat, "alice")
    assert ray_affinity.affinity_key({}, chat, None) not in (victim, attacker)  # no keys: today's key
    session = {"x-session-id": "s1"}
    assert ray_affinity.affinity_key(session, None, "alice") != ray_affinity.affinity_key(session, None, "mallory")
    salted = json.dumps({"messages": [{"role": "user", "content": "Door PIN: 4831"}], "cache_salt": "x"}).encode()
    assert ray_affinity.affinity_key({}, salted, "alice") not in (victim, attacker)
    # Unrelated: across 300 openings the two tenants' first choices of replica agree about as often as chance.
    agree = 0
    for i in range(300):
        body = json.dumps({"messages": [{"role": "user", "content": f"opening {i}"}]}).encode()
        a, b = (ray_affinity.affinity_key({}, body, t) for t in ("alice", "mallory"))
        agree += ray_affinity.rank(a, ["r1", "r2"])[0] == ray_affinity.rank(b, ["r1", "r2"])[0]
    assert 110 < agree < 190


def test_rendezvous_order_is_stable_and_moves_only_the_keys_of_a_removed_replica():
    replicas = ["r1", "r2", "r3"]
    keys = [f"session:{i}" for i in range(300)]
    first = {key: ray_affinity.rank(key, replicas)[0] for key in keys}
    assert first == {key: ray_affinity.rank(key, list(reversed(replicas)))[0] for key in keys}
    assert all(60 < sum(1 for r in first.values() if r == replica) < 140 for replica in replicas)
    after = {key: ray_affinity.rank(key, ["r1", "r3"])[0] for key in keys}
    assert all(after[key] == first[key] for key in keys if first[key] != "r2")


def test_only_the_chat_streams_opening_role_delta_may_be_held_back():
    def ev(payload):
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    role = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    text = ev({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    assert ray_affinity.only_opening_events(role)
    assert not ray_affinity.only_opening_events(role + text)
    assert not ray_affinity.only_opening_events(role[:-1])  # not a whole event
    assert not ray_affinity.only_opening_events(ev({"error": {"message": "x"}}))
    assert not ray_affinity.only_opening_events(b"data: [DONE]\n\n")
    assert not ray_affinity.only_opening_events(ev({"choices": [], "usage": {}}))
    assert ray_affinity.is_event_stream([(b"content-type", b"text/event-stream; charset=utf-8")])
    assert not ray_affinity.is_event_stream([(b"content-type", b"application/json")])


# ------------------------------------------------------------------------------------- metrics (no Ray)


def _exposition(generated: int, accepted: int, proposed: int, drafts: int) -> str:
    from specdec.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.generation_tokens(generated)
    metrics._num_accepted_tokens.labels("m").inc(accepted)
    metrics._num_draft_tokens.labels("m").inc(proposed)
    metrics._num_drafts.labels("m").inc(drafts)
    return metrics.exposition()[0].decode()


def test_merged_metrics_label_each_replica_and_the_summary_adds_them_up():
    from prometheus_client.parser import text_string_to_metric_families

    a, b = _exposition(100, 30, 60, 20), _exposition(50, 10, 40, 10)
    text = merged_exposition({"A": a, "B": b}).decode()
    samples = {(s.name, s.labels.get("replica")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    assert samples[("specdec:generation_tokens_total", "A")] == 100
    assert samples[("specdec:generation_tokens_total", "B")] == 50
    assert text.count("# TYPE specdec:generation_tokens_total counter") == 1
    now = [0.0]
    board = ReplicaBoard(clock=lambda: now[0])
    board.report("A", {"pid": 1}, _exposition(0, 0, 0, 0))
    board.report("B", {"pid": 2}, b)
    now[0] = 2.0
    board.report("A", {"pid": 1}, a)
    view = summary(board.snapshot(), {"retried": 1})
    total = view["aggregate"]
    assert total["replicas"] == 2 and total["generation_tokens"] == 150
    assert total["acceptance_rate"] == pytest.approx(40 / 100) and total["mean_acceptance_length"] == pytest.approx(
        1 + 40 / 30, abs=1e-4)
    assert view["replicas"][0]["tokens_per_second_1m"] == pytest.approx(50.0) and view["ingress"] == {"retried": 1}
    assert totals_of(a)["num_drafts"] == 20
    now[0] = 10.0  # neither has reported for longer than STALE_SECONDS: both are gone
    assert board.snapshot() == {"replicas": []}


# ------------------------------------------------------------------------------------- flags (no Ray needed)


def _serve_args(*argv):
    from specdec.cli import main as cli

    return cli.build_parser().parse_args(["serve", *argv])


def test_ray_flags_are_checked_before_anything_starts():
    pytest.importorskip("fastapi")
    from specdec.cli.main import UserError
    from specdec.server.options import ray_requested

    assert not ray_requested(_serve_args("m.gguf"))
    assert ray_requested(_serve_args("m.gguf", "--replicas", "2"))
    assert ray_requested(_serve_args("m.gguf", "--max-replicas", "3"))
    with pytest.raises(UserError, match="--replicas"):
        ray_requested(_serve_args("m.gguf", "--ray-address", "auto"))
    from specdec.server.options import scaling_from_args

    scaling = scaling_from_args(args := _serve_args("m.gguf", "--replicas", "2", "--replica-cpus", "1"))
    assert (scaling.replicas, scaling.autoscaling, scaling.max_ongoing_requests, args.threads) == (2, False, 2, 1)
    scaling = scaling_from_args(_serve_args("m.gguf", "--min-replicas", "1", "--max-replicas", "4", "--parallel", "2"))
    assert scaling.autoscaling and scaling.target_ongoing_requests == 2 and scaling.max_ongoing_requests == 3
    for bad in (["--replicas", "0"], ["--min-replicas", "3", "--max-replicas", "2"],
                ["--replicas", "5", "--max-replicas", "2"], ["--replicas", "2", "--max-ongoing-requests", "1",
                                                             "--parallel", "2"],
                ["--replicas", "2", "--target-ongoing-requests", "0"]):
        with pytest.raises(UserError):
            scaling_from_args(_serve_args("m.gguf", *bad))


def test_the_serve_run_builder_takes_specdec_serve_flags():
    pytest.importorskip("ray")
    from specdec.server.ray_serve import ENGINE, app_builder, engine_options

    app = app_builder({"model": "m.gguf", "draft": "d.gguf", "threads": 1, "exact": True, "replicas": 3})
    assert app is not None
    from specdec.server.options import scaling_from_args

    options = engine_options(scaling_from_args(_serve_args("m.gguf", "--replicas", "3")), 10.0)
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["request_router_config"].request_router_class.endswith("AffinityRouter")
    auto = engine_options(scaling_from_args(_serve_args("m.gguf", "--max-replicas", "4")), 10.0)
    assert "num_replicas" not in auto and auto["autoscaling_config"].max_replicas == 4
    assert ENGINE == "SpecdecEngine"
    # Bounded: the ingress holds what the replicas may run plus --max-queue waiting (429 beyond).
    from specdec.server.ray_serve import in_flight_bound

    scaling = scaling_from_args(_serve_args("m.gguf", "--max-replicas", "4", "--parallel", "2"))
    assert in_flight_bound(scaling, 5) == 4 * 3 + 5


def test_run_asgi_relays_an_apps_response_and_cancels_it_when_the_caller_leaves():
    pytest.importorskip("ray")
    import asyncio

    from specdec.server.ray_serve import run_asgi

    ended = []

    async def app(scope, receive, send):
        assert scope["path"] == "/x" and (await receive())["body"] == b"in"
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"b")]})
        try:
            for piece in (b"1", b"2", b"3"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": scope["query_string"] != b""})
            await asyncio.sleep(30)
        finally:
            ended.append(True)

    request = {"method": "POST", "path": "/x", "headers": [], "body": b"in"}

    async def whole():
        return [m async for m in run_asgi(app, request)]

    messages = asyncio.run(whole())
    assert messages[0] == ("start", 201, [(b"a", b"b")]) and messages[1] == ("body", b"123", messages[1][2])
    assert b"".join(m[1] for m in messages[1:]) == b"123" and messages[-1][2] is False  # pieces sent meanwhile: one

    async def leave_early():
        stream = run_asgi(app, {**request, "query_string": b"more"})
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()  # the caller is gone: the app is cancelled
        return got

    ended.clear()
    assert asyncio.run(leave_early())[1] == ("body", b"123", True) and ended == [True]

    # An app that tells when its model work begins (from another thread, as the engine worker does): the
    # runner says so once, between the messages it was sent before and after.
    from specdec.server.dispatch import WORK_STARTED

    async def working_app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        hook = scope["state"][WORK_STARTED]
        await asyncio.to_thread(hook)
        await asyncio.to_thread(hook)
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"done", "more_body": False})

    async def collect(app_):
        return [m async for m in run_asgi(app_, request)]

    kinds = [m[0] for m in asyncio.run(collect(working_app))]
    assert kinds == ["start", "working", "body"]
    assert "working" not in [m[0] for m in asyncio.run(collect(app))]  # an app that never says: never


# ------------------------------------------------------------------------------------- a live Ray instance

MAX_CONTEXT = 16384
PROMPTS = ["Write a short poem about the sea.", "def fib(n):", "List three colours."]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("ray-gguf")
    return (write_tiny_gguf(root / "target.gguf", seed=0, layers=2, context=MAX_CONTEXT),
            write_tiny_gguf(root / "draft.gguf", seed=0, layers=1, context=MAX_CONTEXT, noise=0.3))


def _args_for(pair, port):
    target, draft = pair
    # Two slots per replica (not the llama.cpp default of 4) and a queue of 2: the tests fill both and queue a
    # request behind them, and send ten times what the ingress holds at once.
    return _serve_args(str(target), "--draft", str(draft), "--threads", "1", "--exact", "--parallel", "2",
                       "--max-queue", "2", "--max-context",
                       str(MAX_CONTEXT), "--port", str(port), "--api-key", "sekret", "--served-model-name", "tiny",
                       "--replicas", "2", "--replica-cpus", "0.5", "--log-level", "warning")


@pytest.fixture(scope="module")
def reference(pair):
    """`specdec serve`'s own app (create_app) on the same pair and flags: what every replica must answer."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from specdec.decoder import SpecDecoder
    from specdec.server import create_app
    from specdec.server.ray_serve import replica_app_parts

    ref, spec, names, limits, _hosts = replica_app_parts(_args_for(pair, 8000))
    app = create_app(SpecDecoder.load(ref, spec), served_model_name=names, api_key="sekret", limits=limits)
    with TestClient(app) as client:
        def chat(text, max_tokens=24, **extra):
            response = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sekret"}, json={
                "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens, **extra})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        yield chat


@pytest.fixture(scope="module")
def cluster(pair):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from specdec.server.options import scaling_from_args
    from specdec.server.ray_serve import APP_NAME, ENGINE, build_application

    began = time.monotonic()
    port = _free_port()
    args = _args_for(pair, port)
    scaling = scaling_from_args(args)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(args, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        handle = serve.get_deployment_handle(ENGINE, app_name=APP_NAME)
        yield {"url": f"http://127.0.0.1:{port}", "handle": handle, "serve": serve, "began": began}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    took = time.monotonic() - began
    # A bound on what the Ray tests add to the suite (usually 60-100 s; one start took 100 s alone on a VM
    # whose steal time was high), not a benchmark.
    assert took < 300, f"the Ray tests took {took:.0f} s"


def _replicas(handle, want: int = 2, timeout: float = 60.0, exclude=()) -> dict[str, dict]:
    """Engine replicas by id, from their own whoami, until `want` distinct live ones answered."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = handle.whoami.remote().result(timeout_s=30)
        if info["replica"] not in exclude:
            seen[info["replica"]] = info
        if len(seen) >= want:
            return seen
    raise AssertionError(f"only saw replicas {sorted(seen)}")


def _session_for(replica: str, replicas) -> str:
    """A session id whose first choice among `replicas` is `replica`."""
    for i in range(1000):
        session = f"s{i}"
        # The cluster has one key (--api-key): its tenant, "default", partitions the affinity keys.
        key = ray_affinity.affinity_key({"x-session-id": session}, None, "default")
        if ray_affinity.rank(key, replicas)[0] == replica:
            return session
    raise AssertionError("no session maps to that replica")


def _chat_body(text, max_tokens, stream, **extra):
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens,
            "stream": stream, **extra}


AUTH = {"Authorization": "Bearer sekret"}


def test_openai_client_chat_and_streaming_through_ray_match_specdec_serve(cluster, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="sekret", max_retries=0, timeout=60)
    for text in PROMPTS:
        expected = reference(text)
        assert expected
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                               temperature=0, max_tokens=24)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens >= 1 and reply.model == "tiny"
        streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                  temperature=0, max_tokens=24, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
    # The same rules as `specdec serve`: the API key, OpenAI-shaped errors, /health, /v1/models.
    import httpx

    with httpx.Client(base_url=cluster["url"], timeout=60) as http:
        refused = http.post("/v1/chat/completions", json=_chat_body("hi", 4, False))
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        bad = http.post("/v1/chat/completions", headers=AUTH, json={**_chat_body("hi", 4, False), "n": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
        assert http.get("/health").json() == {"status": "ok"}


def test_a_session_stays_on_its_replica_and_metrics_cover_every_replica(cluster):
    import httpx

    replicas = _replicas(cluster["handle"])
    ids = sorted(replicas)
    with httpx.Client(base_url=cluster["url"], timeout=60) as http:
        for replica in ids:
            session = _session_for(replica, ids)
            for turn in range(3):
                response = http.post("/v1/chat/completions", headers={**AUTH, "X-Session-ID": session},
                                     json=_chat_body(f"turn {turn}", 4, False))
                assert response.status_code == 200
                assert response.headers["x-specdec-replica"] == replica
        deadline = time.monotonic() + 20
        while True:  # each replica reports every second: wait for reports made after the requests above
            view = http.get("/replicas", headers=AUTH).json()
            reported = {r["replica"] for r in view["replicas"]} >= set(ids)
            if (reported and view["aggregate"]["generation_tokens"] >= 2 * 3) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {r["replica"] for r in view["replicas"]} >= set(ids)
        assert view["aggregate"]["generation_tokens"] >= 2 * 3
        assert {r["replica"]: r["pid"] for r in view["replicas"] if r["replica"] in ids} == {
            r: replicas[r]["pid"] for r in ids}
        text = http.get("/metrics", headers=AUTH).text
        for replica in ids:
            assert f'replica="{replica}"' in text
        assert "specdec:ray_replicas" in text and "specdec:ray_requests_retried_total" in text


def test_ten_times_what_the_ingress_holds_at_once_gets_429s_and_nothing_is_lost(cluster, reference):
    import asyncio

    import httpx

    from specdec.server.options import scaling_from_args
    from specdec.server.ray_serve import in_flight_bound

    bound = in_flight_bound(scaling_from_args(_args_for(("t", "d"), 0)), 2)
    body = _chat_body(PROMPTS[2], 8, False)

    async def burst():
        async with httpx.AsyncClient(base_url=cluster["url"], timeout=90,
                                     limits=httpx.Limits(max_connections=20 * bound)) as http:
            return await asyncio.gather(*[http.post("/v1/chat/completions", headers=AUTH, json=body)
                                          for _ in range(10 * bound)])

    responses = asyncio.run(burst())  # every one answered: an exception or a timeout fails the test
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= bound, sorted(codes)
    busy = [r for r in responses if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] for r in busy)
    expected = reference(PROMPTS[2], max_tokens=8)
    assert all(r.json()["choices"][0]["message"]["content"] == expected for r in responses if r.status_code == 200)
    # With keys set, the replicas' view and the metrics are a key holder's too.
    with httpx.Client(base_url=cluster["url"], timeout=30) as http:
        assert http.get("/replicas").status_code == 401 and http.get("/metrics").status_code == 401
        assert http.get("/replicas", headers=AUTH).status_code == 200


def _wait_for_replica_count(http, replica: str, field: str, at_least: int, failure: str) -> None:
    """Poll /replicas until `replica` reports at least `at_least` requests `running` or `waiting` (30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = {r["replica"]: r for r in http.get("/replicas", headers=AUTH).json()["replicas"]}
        if rows.get(replica, {}).get(field, 0) >= at_least:
            return
        time.sleep(0.2)
    raise AssertionError(failure)


def _read_events(response, events: list, first: threading.Event) -> None:
    for line in response.iter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload != "[DONE]" and events[-1].get("choices") and events[-1]["choices"][0]["delta"].get("content"):
                first.set()


def test_a_replica_killed_mid_stream_is_survived_and_replaced(cluster, reference):
    import httpx

    handle = cluster["handle"]
    replicas = _replicas(handle)
    ids = sorted(replicas)
    victim, survivor = ids[0], ids[1]
    doomed_session, safe_session = _session_for(victim, ids), _session_for(survivor, ids)
    long_body = _chat_body("Tell a very long story.", MAX_CONTEXT - 200, True, ignore_eos=True)
    safe_text = "Count slowly to twenty."
    with httpx.Client(base_url=cluster["url"], timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", headers={**AUTH, "X-Session-ID": doomed_session},
                         json=long_body) as doomed:
            assert doomed.status_code == 200 and doomed.headers["x-specdec-replica"] == victim
            doomed_events: list = []
            doomed_first = threading.Event()
            reader = threading.Thread(target=_read_events, args=(doomed, doomed_events, doomed_first), daemon=True)
            reader.start()
            assert doomed_first.wait(60), "the long stream sent no text"
            # A request queued on the victim behind the long stream: nothing of it sent when the victim dies.
            queued: dict = {}

            def send_queued():
                queued["response"] = http.post("/v1/chat/completions", headers={**AUTH, "X-Session-ID": doomed_session},
                                               json=_chat_body(PROMPTS[0], 24, False))

            # A long non-streamed request running beside it on the victim when it dies: it may be what killed
            # the replica, so it is not sent to another one.
            working: dict = {}

            def send_working():
                working["response"] = http.post("/v1/chat/completions",
                                                headers={**AUTH, "X-Session-ID": doomed_session},
                                                json={**long_body, "stream": False})

            worker = threading.Thread(target=send_working, daemon=True)
            worker.start()
            _wait_for_replica_count(http, victim, "running", 2, "the non-streamed request never ran on the victim")
            waiter = threading.Thread(target=send_queued, daemon=True)
            waiter.start()
            _wait_for_replica_count(http, victim, "waiting", 1, "the third request never queued on the victim")
            # A stream on the other replica, running when the victim dies.
            with http.stream("POST", "/v1/chat/completions", headers={**AUTH, "X-Session-ID": safe_session},
                             json=_chat_body(safe_text, 200, True)) as safe:
                assert safe.headers["x-specdec-replica"] == survivor
                safe_events: list = []
                safe_first = threading.Event()
                safe_reader = threading.Thread(target=_read_events, args=(safe, safe_events, safe_first), daemon=True)
                safe_reader.start()
                safe_first.wait(60)
                os.kill(replicas[victim]["pid"], signal.SIGKILL)
                reader.join(60)
                safe_reader.join(120)
            waiter.join(120)
            worker.join(120)
    # The stream on the dead replica: some text, then a clear error event and [DONE].
    assert not reader.is_alive() and doomed_events[-1] == "[DONE]"
    error = doomed_events[-2]["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error"
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
                   for e in doomed_events)
    # The request the victim was working on: a clear 500, tried once, counted by the ingress.
    failed = working["response"]
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "replica_failed", failed.text
    with httpx.Client(base_url=cluster["url"], timeout=60) as http:
        counters = http.get("/metrics", headers=AUTH).text
    assert "specdec:ray_requests_crashed_total 1.0" in counters, counters[-2000:]
    # The queued request: sent again to the survivor, answered in full and correctly.
    response = queued["response"]
    assert response.status_code == 200, response.text
    assert response.headers["x-specdec-attempts"] != "1" and response.headers["x-specdec-replica"] == survivor
    assert response.json()["choices"][0]["message"]["content"] == reference(PROMPTS[0])
    # The stream on the other replica: complete and identical to specdec serve's.
    assert safe_events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in safe_events)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in safe_events
                   if isinstance(e, dict) and e.get("choices"))
    assert text == reference(safe_text, max_tokens=200)
    # Ray Serve replaces the dead replica; requests keep succeeding meanwhile and after.
    fresh = _replicas(handle, want=1, timeout=90, exclude=set(ids))
    new_id = next(iter(fresh))
    assert fresh[new_id]["pid"] != replicas[victim]["pid"]
    with httpx.Client(base_url=cluster["url"], timeout=60) as http:
        for replica in (new_id, survivor):
            session = _session_for(replica, [new_id, survivor])
            response = http.post("/v1/chat/completions", headers={**AUTH, "X-Session-ID": session},
                                 json=_chat_body(PROMPTS[1], 24, False))
            assert response.status_code == 200
            assert response.json()["choices"][0]["message"]["content"] == reference(PROMPTS[1])
    assert time.monotonic() - cluster["began"] < 300
