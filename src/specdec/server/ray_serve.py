"""The Ray Serve application behind `specdec serve --replicas N` (and Ray's own `serve run` / `serve deploy`).

Three deployments, one application (APP_NAME), behind Ray Serve's HTTP proxy:

- `SpecdecEngine` (N replicas, or min..max with autoscaling on ongoing requests): each replica loads its own
  model pair in its constructor, with its own threads, and serves the FastAPI app `create_app` builds, with
  the same routes, streaming, errors, API key, Host and limit rules as `specdec serve`. Requests reach it
  as a plain HTTP request (method, path, headers, body) through `handle`, which runs them through that app
  in the replica's event loop and streams back the ASGI messages. `check_health` fails when the engine
  worker thread is dead, so Ray Serve replaces the replica; a replica whose process dies is replaced too.
- `SpecdecIngress` (one replica, no CPU reserved): what the proxy calls. With API keys it finds the request's
  tenant before reading its body (401 without a key); it answers 429 at once when as many requests are in
  flight as the replicas may run plus --max-queue; it reads the body (size and JSON-value caps), computes its
  affinity key within the tenant's partition (ray_affinity.py: a session header, OpenAI's `prompt_cache_key`
  or `user`, else the conversation's opening) and calls an engine replica. The engine deployment's request router
  (`AffinityRouter`, Ray Serve's RequestRouter API) orders the replicas by rendezvous hash of the key and
  takes the first with room, so a conversation returns to the replica that has its prefix cached. A
  response is held back until it has sent something a client can use (a JSON body in full; for a stream,
  more than the opening role delta): if the replica dies before that while the request only waited there, it
  is sent again to another replica (up to RETRIES times); if it dies while its engine was working on the
  request, the request is answered 500 (`replica_failed`) and not sent again, since it may be what killed the
  replica; if it dies after, the stream ends with an OpenAI-shaped error event
  (code `replica_failed`) and `data: [DONE]`. It also answers `GET /metrics` (every replica's `specdec:*`
  series with a `replica` label, and the ingress's own counters) and `GET /replicas` (the aggregate view), both
  behind the key when keys are set.
- `SpecdecMetrics` (one replica, no CPU): every engine replica reports its Prometheus exposition to it each
  REPORT_SECONDS; the ingress reads the latest of every live replica from it.

Build the application with `build_application(serve_args)` (the parsed `specdec serve` arguments) or, from a
`serve run` config file, `app_builder({...})` with `specdec serve` flags as keys (docs/scale.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response

from specdec.cli.flags import model_ref_from_args, spec_from_args
from specdec.decoder import SpecDecoder
from specdec.server import ray_affinity, sse
from specdec.server.app import create_app, needs_key
from specdec.server.body_scan import holds_more_values, too_many_values_message
from specdec.server.dispatch import WORK_STARTED
from specdec.server.errors import APIError, error_body
from specdec.server.limits import (
    DEFAULT_MAX_BODY_VALUES,
    QUEUE_FULL_RETRY_AFTER_SECONDS,
    host_check_list,
    host_name,
)
from specdec.server.options import (
    Scaling,
    limits_from_args,
    scaling_from_args,
    serve_parser,
    served_names,
    tenants_from_args,
)
from specdec.server.ray_metrics import ReplicaBoard, merged_exposition, summary

log = logging.getLogger("specdec.server.ray")

APP_NAME = "specdec"
ENGINE = "SpecdecEngine"
INGRESS = "SpecdecIngress"
METRICS = "SpecdecMetrics"
ROUTER_CLASS = "specdec.server.ray_serve:AffinityRouter"
RETRIES = 2  # further attempts of a request whose replica failed before it sent anything
RETRY_BACKOFF_SECONDS = (0.2, 1.0, 2.0)
REPORT_SECONDS = 1.0
HEALTH_CHECK_PERIOD_SECONDS = 5.0
HEALTH_CHECK_TIMEOUT_SECONDS = 30.0
INGRESS_MAX_ONGOING = 256  # requests in flight at the ingress when built without a bound (build_application sets one)
INGRESS_SPARE = 1024  # ongoing requests the ingress may hold beyond its bound: the ones it answers itself (429s)
REPLICA_HEADER = "x-specdec-replica"  # which engine replica answered (added by the ingress)
ATTEMPTS_HEADER = "x-specdec-attempts"  # how many replicas it took (1 unless a replica failed)

try:  # the exceptions a handle call raises when the replica behind it died or cannot be reached
    from ray.exceptions import ActorUnavailableError

    REPLICA_FAILURES: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
except ImportError:  # pragma: no cover - older Ray
    REPLICA_FAILURES = (RayActorError,)


# --------------------------------------------------------------------------------------------- the router


class AffinityRouter(RequestRouter):
    """Replica choice for the engine deployment: a request with an affinity key goes to the first replica with
    room in the key's rendezvous order (each replica its own rank, so the router falls through to the next
    only when one is full); a request without a key (and any other method call) goes to the less loaded of
    two random replicas, Ray Serve's default policy."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if pending_request is not None:  # every choice is in this one answer: back off before asking again
            pending_request.routing_context.should_backoff = True
        if key:
            by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
            return [[by_id[replica_id]] for replica_id in ray_affinity.rank(key, by_id)]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(list(candidate_replicas), 2)]


# --------------------------------------------------------------------------------------------- the engine


def serve_namespace(values: Mapping[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**{k: v for k, v in values.items() if k != "handler"})


def replica_app_parts(args: argparse.Namespace):
    """What `specdec serve` builds from its arguments: the model ref, spec, names, limits and Host list."""
    limits = limits_from_args(args)
    allowed_hosts = host_check_list(args.host, args.api_key or args.api_keys, args.allowed_hosts)
    ref = dataclasses.replace(model_ref_from_args(args), parallel=args.parallel)
    spec = spec_from_args(args, has_draft_model=ref.draft is not None)
    return ref, spec, served_names(args), limits, allowed_hosts


def _scope(request: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.get("http_version", "1.1"), "method": request["method"],
        "scheme": request.get("scheme", "http"), "path": request["path"],
        "raw_path": request.get("raw_path") or request["path"].encode("utf-8"),
        "query_string": request.get("query_string", b""), "root_path": "",
        "headers": [(bytes(k), bytes(v)) for k, v in request["headers"]],
        "client": tuple(request["client"]) if request.get("client") else None,
        "server": tuple(request["server"]) if request.get("server") else None,
        "state": {},
    }


async def run_asgi(app, request: Mapping[str, Any]) -> AsyncIterator[tuple]:
    """Run one HTTP request through an ASGI app, yielding ("start", status, headers) and then
    ("body", bytes, more_body) messages as the app sends them (body pieces sent meanwhile go out as one:
    each item costs a Ray hop or two), and ("working",) once, when the app begins model work on it (the
    app's WORK_STARTED hook). The request's body is received at once; when the caller stops listening
    (cancelled, or closes this generator) the app sees a disconnect and its task is cancelled."""
    sent: collections.deque = collections.deque()
    arrived = asyncio.Event()
    gone = asyncio.Event()
    working = asyncio.Event()  # set (from any thread) when the app begins model work on the request
    announced = False
    body_given = False
    loop = asyncio.get_running_loop()
    scope = _scope(request)
    scope["state"][WORK_STARTED] = lambda: loop.call_soon_threadsafe(working.set)

    async def receive():
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.get("body", b""), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        arrived.set()

    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            if not sent:
                if working.is_set() and not announced:  # after what was sent before it, in order
                    announced = True
                    yield ("working",)
                    continue
                if task.done():
                    task.result()  # the app ended without a complete response: re-raise its error
                    return
                arrived.clear()
                waiters = {asyncio.ensure_future(arrived.wait())}
                if not announced:
                    waiters.add(asyncio.ensure_future(working.wait()))
                await asyncio.wait({*waiters, task}, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
                continue
            message = sent.popleft()
            if message["type"] == "http.response.start":
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                yield ("start", message["status"], headers)
            elif message["type"] == "http.response.body":
                body, more = message.get("body", b""), message.get("more_body", False)
                while more and sent and sent[0]["type"] == "http.response.body":
                    following = sent.popleft()
                    body += following.get("body", b"")
                    more = following.get("more_body", False)
                yield ("body", body, more)
                if not more:
                    return
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@serve.deployment(name=ENGINE, health_check_period_s=HEALTH_CHECK_PERIOD_SECONDS,
                  health_check_timeout_s=HEALTH_CHECK_TIMEOUT_SECONDS)
class SpecdecEngine:
    """One replica of the speculative engine: its own model pair, threads, queue and create_app app."""

    async def __init__(self, serve_args: Mapping[str, Any], metrics=None):
        args = serve_namespace(serve_args)
        ref, spec, names, limits, allowed_hosts = replica_app_parts(args)
        logging.basicConfig(level=str(getattr(args, "log_level", "info")).upper(),
                            format="%(levelname)s: %(name)s: %(message)s")
        self.shutdown_grace = float(args.shutdown_grace)
        began = time.perf_counter()
        # Loaded before the constructor returns: Ray Serve sends no request to a replica still loading.
        decoder = await asyncio.to_thread(SpecDecoder.load, ref, spec)
        self.app = create_app(decoder, served_model_name=names, tenants=tenants_from_args(args), limits=limits,
                              allowed_hosts=allowed_hosts)
        self.state = self.app.state.specdec
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.info = {"pid": os.getpid(), "node": socket.gethostname(), "started_at": time.time(),
                     "load_seconds": round(time.perf_counter() - began, 2), "threads": ref.threads,
                     "parallel": limits.parallel, "model": names[0]}
        log.info("replica %s (pid %d) ready: %s loaded in %.1f s", self.replica_id, os.getpid(), ref.target,
                 self.info["load_seconds"])
        self._metrics = metrics
        self._reporter = asyncio.ensure_future(self._report_loop()) if metrics is not None else None

    async def handle(self, request: dict, affinity: str | None = None) -> AsyncIterator[tuple]:
        """One HTTP request through this replica's app (`affinity` is read by the router, not here). The
        first message names this replica: ("replica", id)."""
        yield ("replica", self.replica_id)
        async for message in run_asgi(self.app, request):
            yield message

    def whoami(self) -> dict:
        return {"replica": self.replica_id, **self.info}

    def metrics_text(self) -> str:
        return self.state.metrics.exposition()[0].decode("utf-8")

    def check_health(self) -> None:
        """Ray Serve calls this every few seconds; an exception marks the replica unhealthy and it is replaced."""
        state = self.state
        if state.load_error is not None:
            raise RuntimeError(f"the model failed to load: {state.load_error}")
        if state.worker is None or not state.worker.alive:
            raise RuntimeError("the engine worker thread is not running")

    async def _report_loop(self) -> None:
        while True:
            try:
                worker = self.state.worker
                info = {**self.info, "running": len(worker.running_jobs) if worker else 0,
                        "waiting": worker.num_waiting if worker else 0}
                await self._metrics.report.remote(self.replica_id, info, self.metrics_text())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the collector restarting must not stop the replica
                log.debug("metrics report failed: %s", exc)
            await asyncio.sleep(REPORT_SECONDS)

    async def __del__(self):
        """Ray Serve's graceful shutdown: refuse new requests, let running ones finish within the grace, stop."""
        if self._reporter is not None:
            self._reporter.cancel()
        try:
            await self.state.drain(self.shutdown_grace)
        finally:
            await self._lifespan.__aexit__(None, None, None)
        if self._metrics is not None:  # the collector may be going away too: do not wait for it
            try:
                await asyncio.wait_for(self._metrics.forget.remote(self.replica_id), 1.0)
            except Exception:  # noqa: BLE001 - it drops a replica that stops reporting anyway
                pass


# --------------------------------------------------------------------------------------------- metrics


@serve.deployment(name=METRICS, num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})  # a report per replica per second: not worth a line
class SpecdecMetrics:
    """The latest metrics report of every live engine replica."""

    def __init__(self):
        self.board = ReplicaBoard()

    def report(self, replica: str, info: dict, exposition: str) -> None:
        self.board.report(replica, info, exposition)

    def forget(self, replica: str) -> None:
        self.board.forget(replica)

    def snapshot(self) -> dict:
        return self.board.snapshot()


# --------------------------------------------------------------------------------------------- the ingress


class _Forwarded(Response):
    """A response the ingress writes itself, as ASGI messages (Ray Serve sends a returned Response by calling
    it as an ASGI app)."""

    def __init__(self, run):
        super().__init__()
        self._run = run

    async def __call__(self, scope, receive, send):
        await self._run(send)


class IngressCounters:
    """The ingress's own counts, exported on /metrics beside the replicas' series."""

    def __init__(self):
        self.values = {"retried": 0, "crashed": 0, "failed_streams": 0, "failed_bodies": 0, "unavailable": 0,
                       "busy": 0}

    def families(self):
        docs = {
            "retried": "Requests sent again to another replica because theirs failed before working on them.",
            "crashed": "Requests whose replica failed while working on them, answered 500 and not sent again.",
            "busy": "Requests answered 429: as many as the ingress holds were in flight, or the queue was full.",
            "failed_streams": "Streams ended with a replica_failed error event: their replica died mid-stream.",
            "failed_bodies": "Non-streamed responses cut short: their replica died while sending the body.",
            "unavailable": "Requests answered 503: no replica could take them within the retries.",
        }
        for name, value in self.values.items():
            family = CounterMetricFamily(f"specdec:ray_requests_{name}", docs[name])
            family.add_metric([], value)
            yield family


@serve.deployment(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=INGRESS_MAX_ONGOING)
class SpecdecIngress:
    """Checks each request's key and size before reading it, bounds how many are in flight (429 beyond), picks
    its affinity key within its tenant's partition, forwards it to an engine replica and relays the response."""

    def __init__(self, engine, metrics, serve_args: Mapping[str, Any], max_in_flight: int = INGRESS_MAX_ONGOING):
        args = serve_namespace(serve_args)
        self.engine = engine
        self.metrics = metrics
        self.max_request_bytes = int(args.max_request_bytes)
        self.read_timeout = float(args.read_timeout)
        self.max_in_flight = int(max_in_flight)
        self.in_flight = 0
        self.tenants = tenants_from_args(args)
        allowed = host_check_list(args.host, args.api_key or args.api_keys, args.allowed_hosts)
        self.allowed_hosts = None if allowed is None else {host_name(h) for h in allowed}
        self.counters = IngressCounters()

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        refused = self._host_refusal(request)
        if refused is not None:
            return refused
        tenant = None
        if self.tenants is not None and method != "OPTIONS" and _is_keyed(path):
            tenant = self.tenants.tenant_of_header(request.headers.get("authorization", "").encode("latin-1"))
            if tenant is None:  # refused before a byte of the body is read
                return _error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                              "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if path in ("/metrics", "/replicas") and method == "GET":
            return await (self._metrics() if path == "/metrics" else self._replicas())
        if self.in_flight >= self.max_in_flight:
            self.counters.values["busy"] += 1
            return _busy(f"the server is busy: {self.max_in_flight} requests are already in flight; retry later")
        declared = request.headers.get("content-length", "")
        if declared.strip().isdigit() and int(declared) > self.max_request_bytes:
            return _too_large(self.max_request_bytes)
        self.in_flight += 1
        handed_over = False
        try:
            try:
                body = await asyncio.wait_for(self._read(request), self.read_timeout)
            except asyncio.TimeoutError:
                return _error(408, f"the request body was not received within {self.read_timeout:g} s",
                              "request_timeout")
            if body is None:
                return _too_large(self.max_request_bytes)
            if await holds_more_values(body, DEFAULT_MAX_BODY_VALUES):
                return _error(413, too_many_values_message(DEFAULT_MAX_BODY_VALUES), "too_many_json_values")
            scope = request.scope
            forwarded = {
                "method": method, "path": scope.get("path", path), "raw_path": scope.get("raw_path"),
                "query_string": scope.get("query_string", b""), "headers": list(scope.get("headers", [])),
                "scheme": scope.get("scheme", "http"), "http_version": scope.get("http_version", "1.1"),
                "client": scope.get("client"), "server": scope.get("server"), "body": body,
            }
            key = ray_affinity.affinity_key(forwarded["headers"], body, tenant)
            handed_over = True
            return _Forwarded(lambda send: self._forward(forwarded, key, tenant, send))
        finally:
            if not handed_over:
                self.in_flight -= 1

    async def _read(self, request: Request) -> bytes | None:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            parts.append(chunk)
        return b"".join(parts)

    def _host_refusal(self, request: Request) -> Response | None:
        if self.allowed_hosts is None:
            return None
        name = host_name(request.headers.get("host", ""))
        if name in self.allowed_hosts:
            return None
        return _error(400, f"Host {name or '(none)'!r} is not allowed; this server answers "
                           f"{', '.join(sorted(self.allowed_hosts))} (see --allowed-hosts)", "invalid_host")

    async def _forward(self, request: dict, key: str | None, tenant: str | None, send) -> None:
        """Send the request to a replica; relay its response once it has sent something a client can use.
        A replica that fails before the request's model work began: sent to another one (RETRIES times). One
        that fails while working on it: not sent again, since the request may be what made it fail."""
        try:
            attempt = 0
            while True:
                attempt += 1
                outcome = await self._attempt(request, key, send, attempt)
                if outcome == "done":
                    return
                if outcome == "busy":
                    self.counters.values["busy"] += 1
                    await _send_busy(send, "every engine replica is busy and the queue in front of them is full "
                                           "(--max-queue); retry later")
                    return
                if outcome == "crashed":
                    self.counters.values["crashed"] += 1
                    log.error("a replica failed while working on a request; not retried: %s %s, %d body bytes "
                              "(sha256 %s), tenant %s, attempt %d", request["method"], request["path"],
                              len(request["body"]), hashlib.sha256(request["body"]).hexdigest()[:16], tenant, attempt)
                    await _send_json(send, 500, error_body(
                        "the replica working on this request failed before answering; it was not sent to another "
                        "replica, in case this request is what made it fail (the server log has the details)",
                        "server_error", None, "replica_failed"))
                    return
                if attempt > RETRIES:
                    self.counters.values["unavailable"] += 1
                    await _send_json(send, 503, error_body(
                        f"no replica could serve this request ({attempt} tried, each failed before answering); "
                        "retry later", "server_error", None, "replica_unavailable"))
                    return
                self.counters.values["retried"] += 1
                log.warning("replica failed before working on the request; sending it again (attempt %d)", attempt + 1)
                await asyncio.sleep(RETRY_BACKOFF_SECONDS[min(attempt - 1, len(RETRY_BACKOFF_SECONDS) - 1)])
        finally:
            self.in_flight -= 1

    async def _attempt(self, request: dict, key: str | None, send, attempt: int) -> str:
        """One replica's try: "done" (answered, or failed after sending), "retry" (failed before its work on the
        request began), "crashed" (failed while working on it, before sending), "busy" (the queue is full)."""
        replica = "unknown"
        held: list[tuple] = []  # start and body messages not yet sent to the client
        committed = False
        event_stream = False
        finished = False
        working = False
        stream = None
        try:
            stream = self.engine.options(stream=True).handle.remote(request, affinity=key)
            async for message in stream:
                kind = message[0]
                if kind == "replica":
                    replica = message[1]
                    continue
                if kind == "working":
                    working = True
                    continue
                if committed:
                    await send(_asgi(message))
                    finished = kind == "body" and not message[2]
                    continue
                if kind == "start":
                    event_stream = ray_affinity.is_event_stream(message[2])
                    held.append(("start", message[1], [*message[2], (REPLICA_HEADER.encode(), replica.encode()),
                                                       (ATTEMPTS_HEADER.encode(), str(attempt).encode())]))
                    continue
                held.append(message)
                last = not message[2]
                if last or not event_stream or not ray_affinity.only_opening_events(
                        b"".join(m[1] for m in held if m[0] == "body")):
                    if not event_stream and not last:
                        continue  # a JSON body in several pieces: held until whole
                    for item in held:
                        await send(_asgi(item))
                    held.clear()
                    committed = True
                    finished = last
            if not committed:  # the app ended its response with the opening events only
                for item in held:
                    await send(_asgi(item))
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "done"
        except BackPressureError:  # Ray's own queue bound, where a deployment sets one (build_application does not)
            return "busy"

        except REPLICA_FAILURES as exc:
            if not committed:
                log.warning("replica %s failed before answering (%s): %s", replica,
                            "while working on the request" if working else "before working on it", type(exc).__name__)
                return "crashed" if working else "retry"
            log.warning("replica %s failed mid-response: %s", replica, type(exc).__name__)
            if event_stream:
                self.counters.values["failed_streams"] += 1
                error = error_body(f"the replica serving this request failed ({type(exc).__name__}); the "
                                   "response is incomplete: send the request again", "server_error", None,
                                   "replica_failed")
                await send({"type": "http.response.body", "body": sse.event(error) + sse.DONE, "more_body": False})
            else:
                self.counters.values["failed_bodies"] += 1
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return "done"
        finally:
            if stream is not None:
                stream.cancel()

    async def _metrics(self) -> Response:
        snapshot = await self.metrics.snapshot.remote()
        replicas = {entry["replica"]: entry["exposition"] for entry in snapshot["replicas"]}
        live = GaugeMetricFamily("specdec:ray_replicas", "Engine replicas reporting metrics.")
        live.add_metric([], len(replicas))
        body = merged_exposition(replicas, [live, *self.counters.families()])
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def _replicas(self) -> Response:
        snapshot = await self.metrics.snapshot.remote()
        return Response(json.dumps(summary(snapshot, self.counters.values), indent=1), media_type="application/json")


def _asgi(message: tuple) -> dict:
    if message[0] == "start":
        return {"type": "http.response.start", "status": message[1], "headers": message[2]}
    return {"type": "http.response.body", "body": message[1], "more_body": message[2]}


def _is_keyed(path: str) -> bool:
    """What needs a key when keys are set: what `specdec serve` keys (app.needs_key), and the replicas' view."""
    return needs_key(path) or path == "/replicas"


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(APIError(status, message, code=code).body()), status_code=status,
                    media_type="application/json", headers=headers)


def _too_large(limit: int) -> Response:
    return _error(413, f"the request body is larger than the server's limit of {limit} bytes (--max-request-bytes)",
                  "request_too_large")


def _busy(message: str) -> Response:
    return _error(429, message, "queue_full", {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_SECONDS)})


async def _send_busy(send, message: str) -> None:
    await _send_json(send, 429, APIError(429, message, code="queue_full").body(),
                     [(b"retry-after", str(QUEUE_FULL_RETRY_AFTER_SECONDS).encode())])


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


# --------------------------------------------------------------------------------------------- building


def most_replicas(scaling: Scaling) -> int:
    if scaling.autoscaling:
        low = scaling.min_replicas if scaling.min_replicas is not None else 1
        return scaling.max_replicas if scaling.max_replicas is not None else max(low, scaling.replicas or 1)
    return scaling.replicas or 1


def in_flight_bound(scaling: Scaling, max_queue: int) -> int:
    """Requests the ingress holds at once: what every replica may run (max_ongoing_requests each, at most
    replicas) and --max-queue waiting in front of them; more are answered 429 at once, unread."""
    return most_replicas(scaling) * scaling.max_ongoing_requests + max_queue


def engine_options(scaling: Scaling, shutdown_grace: float) -> dict[str, Any]:
    # No max_queued_requests: the ingress bounds the queue itself (in_flight_bound), answering 429 in OpenAI's
    # shape. Ray's own bound rejected requests of a burst that had room (its count includes requests still being
    # assigned, ray/serve/_private/router.py) and answered them 503 in plain text.
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": scaling.replica_cpus},
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "graceful_shutdown_timeout_s": shutdown_grace + 10.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_CLASS),
    }
    if scaling.autoscaling:
        low = scaling.min_replicas if scaling.min_replicas is not None else 1
        high = most_replicas(scaling)
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, initial_replicas=min(max(scaling.replicas or low, low), high),
            target_ongoing_requests=scaling.target_ongoing_requests)
    else:
        options["num_replicas"] = scaling.replicas
    return options


def build_application(serve_args: argparse.Namespace | Mapping[str, Any], scaling: Scaling):
    """The application: ingress, engine replicas with the affinity router, metrics collector."""
    values = dict(vars(serve_args) if isinstance(serve_args, argparse.Namespace) else serve_args)
    values.pop("handler", None)
    metrics = SpecdecMetrics.bind()
    max_queue = int(values["max_queue"])
    engine = SpecdecEngine.options(**engine_options(scaling, float(values["shutdown_grace"]))).bind(values, metrics)
    bound = in_flight_bound(scaling, max_queue)
    # Room above the bound for what the ingress answers itself (429s, /metrics, /replicas, /health), so that
    # Ray's proxy never queues requests in front of it.
    ingress = SpecdecIngress.options(max_ongoing_requests=bound + INGRESS_SPARE)
    return ingress.bind(engine, metrics, values, bound)


def app_builder(args: Mapping[str, Any]):
    """For Ray's `serve run` / `serve deploy` (import_path: specdec.server.ray_serve:app_builder): `args` are
    `specdec serve` flags without their dashes (`model`, `draft`, `threads`, `exact: true`, `replicas`,
    `min_replicas`, ...), checked by the same parser."""
    argv = []
    for name, value in dict(args).items():
        if name == "model":
            argv.insert(0, str(value))
            continue
        flag = "--" + str(name).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    parsed = serve_parser().parse_args(argv)
    return build_application(parsed, scaling_from_args(parsed))


__all__ = [
    "APP_NAME", "AffinityRouter", "Scaling", "SpecdecEngine", "SpecdecIngress", "SpecdecMetrics", "app_builder",
    "build_application", "engine_options", "run_asgi",
]
