"""From a checked request to a running Job and back, for every generation route: the context check, the cache
partition, submission, disconnects, SSE responses that cancel their job, and engine errors as HTTP errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.backends.kvcache import ContextOverflowError
from specdec.config import SamplingParams
from specdec.grammar.errors import GrammarError
from specdec.server import sse
from specdec.server.errors import APIError, bad_request
from specdec.server.worker import Job, ServerShuttingDown

log = logging.getLogger("specdec.server")
# `state` below is the app's ServerState (server/app.py imports this module, so it is not imported here).

DISCONNECT_POLL_SECONDS = 0.2

# A runner of the app (the Ray replica, ray_serve.run_asgi) may put a thread-safe zero-argument callable under this
# key of the ASGI scope's state: it is called when the request's job enters the engine (prefill begins), so the
# runner knows whether a crash came while the engine was working on the request or while it only waited.
WORK_STARTED = "specdec.work_started"


def work_started_hook(request: Request) -> Callable[[], None] | None:
    return request.scope.get("state", {}).get(WORK_STARTED)


class JobStreamingResponse(StreamingResponse):
    """An SSE response that cancels its job however the response ends (finished, failed, client gone)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def check_fits(state: Any, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
    """Refuse before queueing anything that the engine would refuse (context overflow, bad token ids)."""
    try:
        state.engine.check_request(prompt_ids, params)
    except ContextOverflowError as exc:
        raise APIError(400, f"{exc}; shorten the prompt or lower max_tokens", param=param,
                       code="context_length_exceeded") from exc
    except GrammarError as exc:
        if params.lark_grammar is not None:  # only a tool-call grammar is Lark: a tool's parameter schema failed
            raise APIError(400, f"a tool's parameters: {exc}", param="tools", code="invalid_tool_parameters") from exc
        raise APIError(400, str(exc), param="response_format", code="invalid_json_schema") from exc
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc


def engine_error(exc: BaseException | None) -> APIError:
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    log.error("generation failed", exc_info=exc)  # the detail goes to the log, not to a client
    return APIError(500, "generation failed (an internal error; the server log has the details)")


def cache_partition(request: Request, req) -> object:
    """Who may share this request's cross-request caches: the tenant its API key names (never a request field),
    narrowed by its `cache_salt` or `prompt_cache_key`; None (everything shared) with no keys and no salt."""
    tenant = getattr(request.state, "tenant", None)
    salt = req.cache_salt if req.cache_salt is not None else req.prompt_cache_key
    if salt is None:
        return tenant
    return (tenant, salt)


def submit(state: Any, prompt_ids: list[int], params: SamplingParams, req, request: Request) -> Job:
    """Queue a job for the engine in the request's cache partition (after the last admission check: the queue
    may have filled, or shutdown begun, while the request was being tokenized)."""
    job = Job(prompt_ids, params, partition=cache_partition(request, req), on_start=work_started_hook(request))
    state.admit()
    state.worker.submit(job)
    return job


async def watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job as soon as its client is gone (the worker then frees its slot at the next step)."""
    while not job.done.is_set():
        if await request.is_disconnected():
            job.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
