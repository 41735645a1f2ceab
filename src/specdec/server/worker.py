"""One engine serves one request at a time: a FIFO queue of jobs drained by a single worker thread.

The model, its KV caches and the drafter's caches are not thread-safe, so exactly one thread ever
touches them. HTTP handlers enqueue a Job and await its events on the event loop; the worker runs
the engine's stream for each job in arrival order and hands every Chunk back with
`loop.call_soon_threadsafe`, so the event loop never blocks on a forward pass. A job that is
cancelled (client gone) stops at the next engine step; closing the stream runs the engine's
`finally`, which leaves the caches consistent for the next job (holding the request's tokens, whose
common prefix with the next prompt that job does not prefill again: see SpeculativeEngine). On shutdown, queued jobs
are failed at once and the running one is ended with a `ServerShuttingDown` error event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import SamplingParams
from ..engine import Chunk
from ..metrics import SpecStats
from .metrics import ServerMetrics

log = logging.getLogger("specdec.server")


class ServerShuttingDown(RuntimeError):
    """Why a job was refused or ended early: the server is draining for shutdown (HTTP 503)."""


@dataclass
class Event:
    """What a job reports to its HTTP handler: kind 'chunk' (a Chunk), then one 'done' or 'error'."""

    kind: str
    chunk: Chunk | None = None
    error: BaseException | None = None


class Job:
    """One request's prompt, parameters, cancellation flag and results, shared by handler and worker."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.cancel_error: BaseException | None = None  # reported as an error event instead of a quiet abort
        self.arrived_at = time.perf_counter()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.num_generated = 0
        self.finish_reason: str | None = None  # stop, length, abort or error
        self.stats: SpecStats | None = None
        self.done = threading.Event()

    def cancel(self, error: BaseException | None = None) -> None:
        """Ask the worker to stop this job at its next step (or to skip it if it has not started); with an
        error, the job ends with that error event (the client is still there and should be told why)."""
        if error is not None and not self._cancelled.is_set():
            self.cancel_error = error
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel()

    async def events_until_done(self) -> AsyncIterator[Event]:
        while True:
            event = await self.events.get()
            yield event
            if event.kind in ("done", "error"):
                return

    def timings(self) -> dict[str, Any]:
        def span(a, b):
            return round(b - a, 4) if a is not None and b is not None else None

        return {
            "queue_seconds": span(self.arrived_at, self.started_at),
            "time_to_first_token_seconds": span(self.arrived_at, self.first_token_at),
            "e2e_seconds": span(self.arrived_at, self.finished_at),
        }


class EngineWorker:
    """Owns the engine; runs queued jobs first come, first served, one at a time, on its own thread."""

    def __init__(self, engine, metrics: ServerMetrics | None = None, name: str = "specdec-engine"):
        self.engine = engine
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self.current: Job | None = None
        self.jobs_started = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._waiting

    @property
    def idle(self) -> bool:
        """No job running and none queued (a job being handed from the queue counts as waiting)."""
        with self._lock:
            return self.current is None and self._waiting == 0

    def fail_waiting(self, error: BaseException) -> int:
        """End every queued job now with `error` (callable from any thread); returns how many."""
        failed = 0
        while True:
            with self._lock:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return failed
                if job is None:  # the stop sentinel stays for the worker
                    self._queue.put(None)
                    return failed
                self._waiting -= 1
            if self.metrics:
                self.metrics.waiting.dec()
            job.cancel(error)
            self._finish(job, "abort", None)
            job.emit(Event("error", error=error))
            job.done.set()
            failed += 1

    def submit(self, job: Job) -> None:
        with self._lock:
            self._waiting += 1
        if self.metrics:
            self.metrics.waiting.inc()
        self._queue.put(job)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop after the running job's next step; queued jobs are failed with ServerShuttingDown."""
        current = self.current
        if current is not None:
            current.cancel(ServerShuttingDown("the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._drain()
                return
            with self._lock:
                self._waiting -= 1
                self.current = job
            if self.metrics:
                self.metrics.waiting.dec()
            try:
                self._run(job)
            except BaseException:  # never let one request kill the worker
                log.exception("engine worker failed on a request")
            finally:
                with self._lock:
                    self.current = None
                job.done.set()

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish_reason = "abort"
                job.emit(Event("error", error=ServerShuttingDown("the server is shutting down")))
                job.done.set()

    def _run(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        self.jobs_started += 1
        metrics = self.metrics
        if metrics:
            metrics.request_queue_time.observe(job.started_at - job.arrived_at)
        if job.cancelled:  # the client left while waiting (or the server is stopping): do no work
            self._finish(job, "abort", None)
            job.emit(Event("error", error=job.cancel_error) if job.cancel_error else Event("done"))
            return
        if metrics:
            metrics.running.inc()
            metrics.prompt_tokens(len(job.prompt_ids))
        before_stats = getattr(self.engine, "last_stats", None)
        snapshot: dict = {}
        stream = None
        last_step = None
        error: BaseException | None = None
        try:
            stream = self.engine.stream(job.prompt_ids, job.params)
            for chunk in stream:
                now = time.perf_counter()
                if metrics:
                    if job.first_token_at is None:
                        metrics.time_to_first_token.observe(now - job.arrived_at)
                    else:
                        metrics.inter_token_latency.observe(now - last_step)
                    metrics.generation_tokens(len(chunk.tokens))
                    metrics.add_stats_delta(self.engine.last_stats, snapshot)
                if job.first_token_at is None:
                    job.first_token_at = now
                last_step = now
                job.num_generated += len(chunk.tokens)
                if chunk.finish_reason is not None:
                    job.finish_reason = chunk.finish_reason
                job.emit(Event("chunk", chunk=chunk))
                if job.cancelled:
                    break
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            error = exc
        finally:
            if stream is not None:
                stream.close()  # runs the engine's finally: caches trimmed, stats merged
            if metrics:
                metrics.running.dec()
        stats = self.engine.last_stats if getattr(self.engine, "last_stats", None) is not before_stats else None
        if metrics and stats is not None:
            metrics.add_stats_delta(stats, snapshot)
        if error is None and job.cancel_error is not None and job.finish_reason not in ("stop", "length"):
            error = job.cancel_error  # stopped from outside before its end: tell the client why
        if error is None:
            reason = job.finish_reason or "abort"
        else:
            reason = "abort" if error is job.cancel_error else "error"
        self._finish(job, reason, stats)
        job.emit(Event("error", error=error) if error is not None else Event("done"))

    def _finish(self, job: Job, reason: str, stats: SpecStats | None) -> None:
        job.finished_at = time.perf_counter()
        job.finish_reason = reason
        job.stats = stats
        if self.metrics:
            self.metrics.request_finished(reason)
            self.metrics.e2e_request_latency.observe(job.finished_at - job.arrived_at)
