"""Guards in front of the app: the server's limits, a Host allow-list against DNS rebinding, and a size limit
and read deadline for request bodies; each refusal is an OpenAI-shaped error that never reaches a handler."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from specdec.server.body_scan import holds_more_values, too_many_values_message
from specdec.server.errors import APIError
from specdec.server.metrics import ServerMetrics

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64
# Array items and object members one body may hold. The largest request the server can serve holds a prompt of
# token ids up to the context, or 2048 messages; a body of millions of one-character values would cost seconds
# and gigabytes to parse and validate before any other limit applied, so it is refused, counted unparsed.
DEFAULT_MAX_BODY_VALUES = 1 << 18
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_SHUTDOWN_GRACE = 10.0
QUEUE_FULL_RETRY_AFTER_SECONDS = 5
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass(frozen=True)
class ServerLimits:
    """How much one client may ask of the server: body size and values, queued requests, seconds to send a
    request; how many requests generate together, and how streamed tokens are grouped into events."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    read_timeout: float = DEFAULT_READ_TIMEOUT
    parallel: int = 1  # requests generated together (llama-server's -np, vLLM's --max-num-seqs)
    max_body_values: int = DEFAULT_MAX_BODY_VALUES
    # Streamed deltas regrouped N tokens to an event (pacing.TokenPacer), None: as the engine accepts them.
    stream_tokens_per_event: int | None = None

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {self.max_request_bytes}")
        if self.max_body_values < 1:
            raise ValueError(f"max_body_values must be at least 1, got {self.max_body_values}")
        if self.stream_tokens_per_event is not None and self.stream_tokens_per_event < 1:
            raise ValueError(f"stream_tokens_per_event must be at least 1, got {self.stream_tokens_per_event}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {self.max_queue}")
        if not 0 < self.read_timeout < float("inf"):
            raise ValueError(f"read_timeout must be positive, got {self.read_timeout}")


class RetryLater(APIError):
    """An APIError that tells the client when to come back (the `Retry-After` header)."""

    def __init__(self, status: int, message: str, retry_after: int, code: str | None = None):
        super().__init__(status, message, code=code)
        self.headers = {"Retry-After": str(retry_after)}


def queue_full(max_queue: int) -> RetryLater:
    return RetryLater(429, f"the server is busy: {max_queue} requests are already waiting; retry later",
                      QUEUE_FULL_RETRY_AFTER_SECONDS, code="queue_full")


# --------------------------------------------------------------------------------------------- Host check


def is_loopback(bind_host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    host = bind_host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host part of a Host header or an --allowed-hosts entry, lowercased, port dropped, IPv6 bracketed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    if value.count(":") > 1:  # a bare IPv6 address, as people write it in --allowed-hosts
        return f"[{value}]"
    return value.partition(":")[0].rstrip(".")


def host_check_list(bind_host: str, api_key: str | None, extra: Iterable[str] | None) -> list[str] | None:
    """The Host allow-list for `specdec serve`, or None for no check. Without an API key on a loopback bind a
    web page could reach the server through DNS rebinding, so only local names (and `extra`) are accepted;
    `extra` given explicitly turns the check on for any bind; `*` in it turns it off."""
    extra = list(extra or [])
    if "*" in extra:
        return None
    if extra:
        return [*LOOPBACK_HOSTS, *extra] if is_loopback(bind_host) else extra
    if api_key is None and is_loopback(bind_host):
        return list(LOOPBACK_HOSTS)
    return None


class HostCheckMiddleware:
    """Refuse (400, code `invalid_host`) requests whose Host header is not in the allow-list."""

    def __init__(self, app, allowed_hosts: Iterable[str], metrics: ServerMetrics):
        self.app = app
        self.allowed = {host_name(h) for h in allowed_hosts}
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":  # the app has no websocket routes
            raw = dict(scope.get("headers") or []).get(b"host")
            name = host_name(raw.decode("latin-1")) if raw else ""
            if name not in self.allowed:
                self.metrics.request_error(400)
                message = (f"Host {name or '(none)'!r} is not allowed; this server answers "
                           f"{', '.join(sorted(self.allowed))} (see --allowed-hosts)")
                await _send_error(scope, receive, send, 400, message, "invalid_host")
                return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------- bodies


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class RequestBodyGuard:
    """Read each request body in full before the app sees it: over `max_bytes` (by Content-Length or as it
    streams in) is 413, not all there within `read_timeout` seconds is 408, more than `max_values` JSON items
    and members (counted unparsed, body_scan) is 413. The app then gets the body from memory, so a slow or
    oversized upload never ties up a handler, and its parser never builds millions of values."""

    def __init__(self, app, max_bytes: int, read_timeout: float, metrics: ServerMetrics,
                 max_values: int = DEFAULT_MAX_BODY_VALUES):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout
        self.max_values = max_values
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)
            return
        except asyncio.TimeoutError:
            self.metrics.request_error(408)
            await _send_error(scope, receive, send, 408,
                              f"the request body was not received within {self.read_timeout:g} s", "request_timeout")
            return
        except _ClientGone:
            return
        if await holds_more_values(body, self.max_values):
            self.metrics.request_error(413)
            await _send_error(scope, receive, send, 413, too_many_values_message(self.max_values),
                              "too_many_json_values")
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as usual

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, scope, receive, send) -> None:
        self.metrics.request_error(413)
        await _send_error(scope, receive, send, 413,
                          f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                          f"(--max-request-bytes)", "request_too_large")


async def _send_error(scope, receive, send, status: int, message: str, code: str) -> None:
    # The rest of the request is not read, so the connection cannot carry another one.
    response = JSONResponse(APIError(status, message, code=code).body(), status_code=status,
                            headers={"Connection": "close"})
    await response(scope, receive, send)
