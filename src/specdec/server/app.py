"""The OpenAI-compatible FastAPI app: completions and chat (plain and SSE), models, health, Prometheus metrics.

`create_app(decoder)` serves an already-built SpecDecoder; `create_app(loader=...)` starts
answering at once (/health is 503) and loads the models on a background thread (/health 200 when
ready). Requests are validated on the event loop (text too long to fit the context is refused by its
length; the rest is tokenized on helper threads, so a huge prompt never stalls the loop), then queued
for the engine worker, which generates up to `limits.parallel` of them together. `ServerState.drain` is the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.server import sse
from specdec.server.dispatch import (
    JobStreamingResponse,
    check_fits,
    engine_error,
    submit,
    watch_disconnect,
)
from specdec.server.errors import APIError, bad_request, error_body, error_responses, unsupported
from specdec.server.infill import fim_prompt_ids, register_infill
from specdec.server.limits import HostCheckMiddleware, RequestBodyGuard, ServerLimits, queue_full
from specdec.server.logprob_reply import LogprobShaper
from specdec.server.metrics import ServerMetrics
from specdec.server.pacing import TokenPacer
from specdec.server.request_limits import check_prompt_chars, check_rendered_chars
from specdec.server.schemas import (
    GENERATION_200_DESCRIPTION,
    SSE_RESPONSE,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    ResponseContext,
    chat_messages,
    check_chat_options,
    check_completion_options,
    message_chars,
    sampling_params,
    usage,
)
from specdec.server.tenants import TenantKeys
from specdec.server.tools import ToolCallChunks, constrained_to_calls, reply_finish, tool_plan
from specdec.server.worker import EngineWorker, Job, ServerShuttingDown

log = logging.getLogger("specdec.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Prompts longer than this (characters; ~4k tokens of English) are tokenized on the long lane (ServerState.prepare).
SHORT_PROMPT_CHARS = 16384
DRAIN_POLL_SECONDS = 0.05
SHUTTING_DOWN = "the server is shutting down; retry later or on another instance"


class ServerState:
    """What the handlers share: served names, the decoder once loaded, its engine worker and metrics."""

    def __init__(self, names: Sequence[str], metrics: ServerMetrics,
                 on_load_error: Callable[[BaseException], None] | None = None, limits: ServerLimits | None = None):
        self.names = list(names)
        self.metrics = metrics
        self.on_load_error = on_load_error
        self.limits = limits or ServerLimits()
        self.draining = False
        self.preparing = 0  # requests being tokenized: they count against max_queue like queued ones
        self._prepare_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self.created = int(time.time())
        self.decoder = None
        self.engine = None
        self.worker: EngineWorker | None = None
        self.load_error: BaseException | None = None
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self, decoder) -> None:
        engine = decoder.batch_engine()
        if engine.drafter is not None:
            self.metrics.declare_positions(decoder.spec.num_speculative_tokens)
        self.decoder = decoder
        self.engine = engine
        engine.set_max_running(self.limits.parallel)
        self.worker = EngineWorker(engine, self.metrics)
        self._ready.set()

    def load(self, loader: Callable[[], Any]) -> None:
        try:
            began = time.perf_counter()
            self.set_ready(loader())
            log.info("models loaded in %.1f s; ready", time.perf_counter() - began)
        except BaseException as exc:  # noqa: BLE001 - reported by /health and the CLI
            self.load_error = exc
            log.error("model loading failed: %s", exc)
            if self.on_load_error is not None:
                self.on_load_error(exc)

    def require_ready(self) -> None:
        if self.draining:
            raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
        if self.load_error is not None:
            # The reason is in the server log (and the CLI's exit message), not in responses: it names paths.
            raise APIError(503, "the model failed to load; the server log says why")
        if not self.ready:
            raise APIError(503, "the model is still loading; retry when /health returns 200")

    def admit(self) -> None:
        """Refuse new work while shutting down (503) or when max_queue requests already wait (429)."""
        if self.draining:
            raise APIError(503, SHUTTING_DOWN, code="server_shutting_down")
        if self.worker.num_waiting + self.preparing >= self.limits.max_queue:
            raise queue_full(self.limits.max_queue)

    async def prepare(self, chars: int, fn: Callable[..., Any], *args) -> Any:
        """Admit a request, then run its CPU work (tokenizing, the chat template: in proportion to its `chars`,
        bounded by the context) on a helper thread, so the event loop keeps answering /health and writing
        streams meanwhile. Long prompts take turns on a lane of their own: however many of them come, a short
        one never waits behind them (the tokenizer releases the GIL, so the lanes run side by side)."""
        self.admit()
        lane = "long" if chars > SHORT_PROMPT_CHARS else "short"
        if lane not in self._prepare_pools:
            self._prepare_pools[lane] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"specdec-prepare-{lane}")
        self.preparing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pools[lane], fn, *args)
        finally:
            self.preparing -= 1

    async def drain(self, grace: float) -> None:
        """Graceful shutdown: refuse new requests, end queued ones (503) and give the running ones `grace`
        seconds; those still going end with a 503 error event. Handlers then write their last bytes."""
        self.draining = True
        worker = self.worker
        if worker is None:
            return
        error = ServerShuttingDown(SHUTTING_DOWN)
        worker.fail_waiting(error)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while not worker.idle and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        running = worker.running_jobs
        if running:
            log.warning("shutdown grace of %g s is over: ending %d running request(s)", grace, len(running))
            for job in running:
                job.cancel(error)
        deadline = loop.time() + 5.0  # the worker stops a cancelled job at its next engine step
        while not worker.idle and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)

    def close_prepare_pool(self) -> None:
        for pool in self._prepare_pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._prepare_pools.clear()

    def check_model(self, model: str | None) -> str:
        if not model:
            return self.names[0]
        if model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(self.names)}",
                           param="model", code="model_not_found")
        return model

    def specdec_stats(self, job: Job) -> dict[str, Any]:
        """Our extension field: this request's speculative statistics (not OpenAI's prediction fields)."""
        spec = self.decoder.spec
        out: dict[str, Any] = {
            "drafter": spec.drafter if self.engine.drafter is not None else "none",
            "num_speculative_tokens": spec.num_speculative_tokens if self.engine.drafter is not None else 0,
            "k_policy": spec.k_policy,
        }
        if job.stats is not None:
            out.update(job.stats.to_dict())
        out.update(job.timings())
        return out


KEYED_PATHS = ("/metrics", "/redoc", "/openapi.json")  # with /docs*: a key holder's, as /v1/* is


def needs_key(path: str) -> bool:
    """Whether a path needs the API key when keys are set: the API and what describes the server."""
    return path.startswith("/v1") or path.startswith("/docs") or path in KEYED_PATHS


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on /v1/* and on what describes the server (/metrics, /docs, /redoc,
    /openapi.json); /health stays open for load balancers. The key names the request's tenant (scope state
    "tenant"), which partitions every cache shared across requests."""

    def __init__(self, app, tenants: TenantKeys, metrics: ServerMetrics):
        self.app = app
        self.tenants = tenants
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        protected = scope["type"] == "http" and scope["method"] != "OPTIONS" and needs_key(scope.get("path", ""))
        headers = dict(scope.get("headers") or [])
        tenant = self.tenants.tenant_of_header(headers.get(b"authorization", b"")) if protected else None
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        if protected and tenant is None:
            self.metrics.request_error(401)
            body = error_body("Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                              "invalid_request_error", None, "invalid_api_key")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    decoder=None,
    *,
    loader: Callable[[], Any] | None = None,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    tenants: TenantKeys | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
    limits: ServerLimits | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> FastAPI:
    """Build the app around a SpecDecoder, or around a loader run in the background at startup.

    `allowed_hosts`: accepted Host header names (any port), None for no check; `specdec serve` sets it
    (see limits.host_check_list)."""
    if decoder is None and loader is None:
        raise ValueError("create_app needs a decoder or a loader")
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        names = [(decoder.target.name if decoder is not None else None) or "specdec"]
    metrics = ServerMetrics(names[0])
    state = ServerState(names, metrics, on_load_error, limits)
    if decoder is not None:
        state.set_ready(decoder)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.worker is not None and not state.worker.alive:  # the app is being served again
            state.worker = EngineWorker(state.engine, metrics)
        state.draining = False
        if not state.ready and loader is not None and state.load_error is None:
            threading.Thread(target=state.load, args=(loader,), name="specdec-loader", daemon=True).start()
        yield
        state.draining = True
        state.close_prepare_pool()
        if state.worker is not None:
            await asyncio.to_thread(state.worker.shutdown)

    app = FastAPI(title="specdec", description="OpenAI-compatible speculative decoding server", lifespan=lifespan)
    app.state.specdec = state
    # Outermost last: Host check, then the API key, then the body is read (so nothing unauthorized is read).
    app.add_middleware(RequestBodyGuard, max_bytes=state.limits.max_request_bytes,
                       read_timeout=state.limits.read_timeout, metrics=metrics,
                       max_values=state.limits.max_body_values)
    if tenants is None and api_key:
        tenants = TenantKeys.single(api_key)
    if tenants is not None:
        app.add_middleware(APIKeyMiddleware, tenants=tenants, metrics=metrics)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts, metrics=metrics)

    # ----------------------------------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        metrics.request_error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        error = _body_api_error(request, exc) or _validation_api_error(exc)
        metrics.request_error(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        metrics.request_error(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        metrics.request_error(500)
        return JSONResponse(error_body("internal server error (the server log has the details)", "server_error"), 500)

    # ----------------------------------------------------------------------------------------- routes
    # `responses` declares what each route really answers in /openapi.json: errors in OpenAI's shape
    # (400, never FastAPI's 422), SSE beside JSON for generation, Prometheus text for /metrics.

    @app.get("/health", responses={200: {"model": HealthStatus}, 503: {"model": HealthStatus,
                                                                       "description": "loading, failed or stopping"}})
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if state.ready:
            return JSONResponse({"status": "ok"})
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": "the model failed to load; the server log says why"},
                                status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition"}})
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    def model_card(name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": state.created, "owned_by": "specdec"}
        if state.ready:
            card["max_model_len"] = state.engine.target.max_context
        return card

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses()})
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.names]}

    @app.get("/v1/models/{model_id:path}", responses={200: {"model": ModelCard}, **error_responses(404)})
    async def model(model_id: str):
        return model_card(state.check_model(model_id))

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse, "content": SSE_RESPONSE,
                                                 "description": GENERATION_200_DESCRIPTION},
                                            **error_responses(400, 404)})
    async def completions(req: CompletionRequest, request: Request):
        state.require_ready()
        model = state.check_model(req.model)
        check_completion_options(req)
        params = sampling_params(req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        prompt = _single_prompt(req.prompt)
        if req.suffix is not None:  # OpenAI's insert form: fill in between the prompt and the suffix
            prompt_ids = await fim_prompt_ids(state, prompt, req.suffix, params)
        elif isinstance(prompt, str):
            # Refused by length first: a text that cannot fit would hold the tokenizer thread, and every
            # request queued behind it there, for as long as tokenizing it takes.
            check_prompt_chars(len(prompt), state.engine.target.max_context, "prompt")
            prompt_ids = await state.prepare(len(prompt), _encode_prompt, state, prompt)
        else:
            prompt_ids = prompt  # token ids: _check_fits refuses a list too long by its length alone
        check_fits(state, prompt_ids, params, "prompt")
        echo = None
        if req.echo:  # the prompt written back ahead of the completion, as the client sent it
            echo = (prompt if isinstance(prompt, str) else state.engine.decode(prompt_ids), list(prompt_ids))
        ctx = ResponseContext("completion", model, logprobs=_shaper(state, params, list_eos=bool(req.echo)),
                              echo=echo)
        return await _respond(state, ctx, prompt_ids, params, req, request)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse, "content": SSE_RESPONSE,
                                                      "description": GENERATION_200_DESCRIPTION},
                                                 **error_responses(400, 404)})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        state.require_ready()
        model = state.check_model(req.model)
        check_chat_options(req)
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, state.decoder.chat_template,
                         state.decoder.added_vocab)
        messages = chat_messages(req)
        template_tools = plan.template_tools if plan is not None else None
        text_chars = message_chars(messages) + (plan.template_tools_chars if plan is not None else 0)
        max_context = state.engine.target.max_context
        check_prompt_chars(text_chars, max_context, "messages")
        try:
            prompt_ids = await state.prepare(text_chars, state.decoder.encode_chat, messages,
                                             lambda text: check_rendered_chars(len(text), max_context), template_tools)
        except APIError:
            raise
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc), "messages") from exc
        except Exception as exc:  # a template error (jinja) on these messages
            raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from exc
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        room = max(1, state.engine.target.max_context - len(prompt_ids))
        params = constrained_to_calls(sampling_params(req, max_tokens, room, param), plan)
        check_fits(state, prompt_ids, params, "messages")
        ctx = ResponseContext("chat", model, plan, _shaper(state, params))
        return await _respond(state, ctx, prompt_ids, params, req, request)

    register_infill(app, state)
    return app


# --------------------------------------------------------------------------------------------- helpers


def _shaper(state: ServerState, params, list_eos: bool = False) -> LogprobShaper | None:
    if params.logprobs is None:
        return None
    return LogprobShaper(state.decoder.tokenizer, state.engine.target.eos_token_ids, list_eos)


def _single_prompt(prompt) -> str | list[int]:
    """The one prompt of a request (a text or token ids); a list of several (a batch) is refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request",
                           param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    return prompt


def _encode_prompt(state: ServerState, prompt: str) -> list[int]:
    try:
        return state.decoder.encode(prompt, chat=False)
    except ValueError as exc:
        raise bad_request(str(exc), "prompt") from exc


async def _respond(state: ServerState, ctx: ResponseContext, prompt_ids, params, req, request: Request):
    job = submit(state, prompt_ids, params, req, request)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    if req.stream:
        return JobStreamingResponse(_sse_stream(state, ctx, job, include_usage), job)
    return await _collect(state, ctx, job, request)


async def _collect(state: ServerState, ctx: ResponseContext, job: Job, request: Request) -> JSONResponse:
    texts: list[str] = []
    logprobs: list = []
    prompt_logprobs = None
    watcher = asyncio.create_task(watch_disconnect(request, job))
    try:
        async for output in job.outputs_until_done():
            if output.error is not None:
                raise engine_error(output.error)
            texts.append(output.text)
            logprobs += output.logprobs or []
            prompt_logprobs = output.prompt_logprobs if output.prompt_logprobs is not None else prompt_logprobs
    finally:
        watcher.cancel()
        job.cancel()
    finish = job.finish_reason if job.finish_reason in ("stop", "length") else None
    body = ctx.full("".join(texts), finish, _usage(job), state.specdec_stats(job), logprobs, prompt_logprobs)
    return JSONResponse(body)


def _usage(job: Job) -> dict[str, Any]:
    cached = job.stats.num_cached_prompt_tokens if job.stats is not None else 0
    return usage(len(job.prompt_ids), job.num_generated, cached)


async def _sse_stream(state: ServerState, ctx: ResponseContext, job: Job, include_usage: bool):
    """SSE events: text deltas as the engine accepts them (several tokens per event is normal), then the
    finish chunk carrying `specdec` stats, the usage chunk if asked for, and `data: [DONE]`. With
    --stream-tokens-per-event N the deltas come N tokens to an event instead (pacing.TokenPacer)."""
    pacer = None
    if state.limits.stream_tokens_per_event is not None:
        eos = frozenset() if job.params.ignore_eos else state.engine.target.eos_token_ids
        pacer = TokenPacer(state.limits.stream_tokens_per_event, state.engine.decode, job.params.stop, eos)
    calls = ToolCallChunks(ctx) if ctx.tools is not None else None
    pending: list = []  # log-probabilities of tokens whose text has not gone out yet
    echo_pending = ctx.echo is not None  # completions' echo: the prompt not yet sent
    try:
        if ctx.kind == "chat":
            yield sse.event(ctx.chunk("", role=True, include_usage=include_usage))
        async for output in job.outputs_until_done():
            if output.error is not None:
                error = engine_error(output.error)
                state.metrics.request_error(error.status)
                yield sse.event(error.body())
                continue
            if echo_pending:  # the prompt goes out first, with its scores (the first output has them)
                text, shaped = ctx.echoed(output.prompt_logprobs)
                chunk = ctx.chunk(text)
                chunk["choices"][0]["logprobs"] = shaped
                yield sse.event({**chunk, **({"usage": None} if include_usage else {})})
                echo_pending = False
            pending += output.logprobs or []  # sent with the next chunk that carries text
            for text in (pacer.feed(output) if pacer is not None else [output.text] if output.text else []):
                for chunk in (calls.feed(text) if calls is not None else [ctx.chunk(text)]):
                    if pending and ctx.logprobs is not None:
                        chunk["choices"][0]["logprobs"] = ctx.logprobs.shape(ctx.kind, pending)
                        pending = []
                    yield sse.event({**chunk, **({"usage": None} if include_usage else {})})
            if output.finish_reason is not None:  # the last output: the request's end, after its accounting
                stats = state.specdec_stats(job)
                if output.finish_reason in ("stop", "length"):
                    finish = output.finish_reason
                    if calls is not None:
                        for chunk in calls.finish():
                            yield sse.event({**chunk, **({"usage": None} if include_usage else {})})
                        finish = reply_finish(finish, calls.calls)
                    empty = "" if ctx.kind == "completion" else None
                    yield sse.event(ctx.chunk(empty, finish, include_usage=include_usage,
                                              specdec=stats, logprobs=pending or None))
                if include_usage:
                    yield sse.event(ctx.usage_chunk(_usage(job), stats))
        yield sse.DONE
    finally:
        job.cancel()


def _body_api_error(request: Request, exc: RequestValidationError) -> APIError | None:
    """The error for a body that is not there (400) or not sent as JSON (415), else None.

    FastAPI hands the model the raw bytes of a body whose Content-Type is missing or not JSON, and
    reports an empty body as a missing one; either way validation fails with a message about the
    body's shape that would send the client looking in the wrong place."""
    if isinstance(exc.body, (bytes, bytearray)):
        sent = request.headers.get("content-type")
        came = f"Content-Type {sent!r}" if sent else "no Content-Type"
        return APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json'; "
                             f"this one came with {came}", code="unsupported_media_type")
    if any(error.get("type") == "missing" and not _param_path(error) for error in exc.errors()):
        return bad_request("the request body is empty: send a JSON object, such as "
                           "{\"prompt\": \"...\"} or {\"messages\": [...]}")
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def _param_path(error: dict) -> list[str]:
    """The error's location as parameter names, without "body" and without the union members pydantic
    names along the way (`prompt.list[int].0` -> `prompt.0`)."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return [str(part) for part in loc
            if not (isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part))]


def _validation_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    # A union (prompt: string or token ids or ...) reports one error per member. The member the value
    # matched best gave the deepest error (`[5, true]`: prompt.1 is not an integer), and a broken
    # constraint beats a type mismatch (`[""]`: the string is too short, not "not an integer").
    field = _param_path(errors[0])[:1]
    first = max((error for error in errors if _param_path(error)[:1] == field),
                key=lambda e: (len(_param_path(e)), not str(e.get("type", "")).endswith("_type")))
    loc = _param_path(first)
    kind = first.get("type", "")
    param = ".".join(loc) or None
    if kind == "invalid_unicode":
        return bad_request(first.get("msg", "invalid Unicode text"), first.get("ctx", {}).get("param"))
    if kind == "unsupported":
        return unsupported(param or "body", first.get("msg", ""))
    if kind == "json_invalid":
        return bad_request(f"malformed JSON in the request body: {first.get('msg', '')}".rstrip(": "))
    if kind == "extra_forbidden":  # the unknown name itself, whatever characters it has
        raw = first.get("loc", ())
        param = ".".join(str(part) for part in (raw[1:] if list(raw[:1]) == ["body"] else raw))
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unsupported_parameter")
    if kind == "missing":
        return bad_request(f"'{param}' is a required property", param)
    if kind == "bad_value":  # our own validators' messages, complete as they are
        return bad_request(first.get("msg", "invalid value"), param)
    if kind == "too_long":
        ctx = first.get("ctx", {})
        return bad_request(f"'{param}' has {ctx.get('actual_length')} items; at most {ctx.get('max_length')} "
                           f"are allowed", param)
    if kind == "string_too_long":
        length = len(first["input"]) if isinstance(first.get("input"), str) else "too many"
        return bad_request(f"'{param}' is {length} characters long; at most {first.get('ctx', {}).get('max_length')} "
                           f"are allowed", param)
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object")
    return bad_request(f"invalid value for '{param}': {first.get('msg', 'invalid')}", param)
