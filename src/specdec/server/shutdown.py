"""Graceful shutdown for `specdec serve`: the first SIGTERM/SIGINT stops accepting connections and drains the
app (queued requests 503, the running one gets a grace period, then an error event), then uvicorn stops as
usual and the process exits with status 0; a second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger("specdec.server")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that runs `drain()` between the first stop signal and uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        # The signal is deliberately not recorded: uvicorn re-raises recorded signals after a clean stop, which
        # ends the process by that signal instead of with status 0.
        if self._draining or self._loop is None or self.should_exit:
            if self._draining or self.should_exit:
                self.force_exit = True  # a second signal: stop now
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        log.info("shutting down: no new connections; draining requests")
        for server in self.servers:
            server.close()  # stop accepting; open connections carry on
        try:
            await self._drain()
        except Exception:  # shutting down regardless
            log.exception("draining failed")
        finally:
            self.should_exit = True
