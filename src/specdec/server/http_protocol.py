"""uvicorn's h11 protocol with a deadline for request headers: a client that opens a connection, or starts the
next request on a kept-alive one, must send complete headers within `timeout` seconds or the connection is
closed (with an OpenAI-shaped 408 if part of a request came in). uvicorn itself waits for them forever."""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec.server.errors import error_body


def header_deadline_protocol(timeout: float) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""

    class HeaderDeadlineH11Protocol(H11Protocol):
        header_timeout = timeout

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_deadline: asyncio.TimerHandle | None = None
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()  # a fresh deadline for the next request on this connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            self._header_deadline = self.loop.call_later(self.header_timeout, self._header_deadline_passed,
                                                         self.cycle)

        def _header_deadline_passed(self, cycle_when_armed) -> None:
            self._header_deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is not cycle_when_armed or (self.cycle is not None and not self.cycle.response_complete):
                return  # a request's headers came in since (its body has its own deadline in the app)
            partial, _ = self.conn.trailing_data
            if partial:
                body = json.dumps(error_body(f"the request headers were not received within {self.header_timeout:g} s",
                                             "invalid_request_error", None, "request_timeout")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return HeaderDeadlineH11Protocol
