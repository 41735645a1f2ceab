"""One engine thread serves the queued requests, up to `parallel` of them together (continuous batching), first come first served.

The model, its KV caches and the drafter's caches are not thread-safe, so exactly one thread ever
touches them. HTTP handlers enqueue a Job and await its outputs on the event loop; the worker admits
queued jobs into the batch engine's free sequence slots (engine/scheduler.BatchEngine) in arrival order,
runs one step for all running sequences at a time, and hands every sequence's StepOutput back unchanged
with `loop.call_soon_threadsafe`, so the event loop never blocks on a forward pass. A job's last output
(finish_reason set: stop, length, abort or error) is handed over once the job's accounting is done. A job that is cancelled
(client gone) leaves at the next step boundary, where its slot's cache is consistent (it keeps the
request's tokens, whose common prefix with a later prompt is not prefilled again). On shutdown, queued
jobs are failed at once and the running ones are ended with a `ServerShuttingDown` error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from specdec.config import SamplingParams
from specdec.core.stats import SpecStats
from specdec.engine.output import StepOutput
from specdec.engine.scheduler import BatchEngine
from specdec.server.metrics import ServerMetrics

log = logging.getLogger("specdec.server")


class ServerShuttingDown(RuntimeError):
    """Why a job was refused or ended early: the server is draining for shutdown (HTTP 503)."""


class Job:
    """One request's prompt, parameters, cancellation flag and results, shared by handler and worker."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop | None = None,
                 partition: object = None, on_start: Callable[[], None] | None = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.partition = partition  # the cache partition (tenant, salt): see BatchEngine.add
        self.on_start = on_start  # called on the worker thread as the job enters the engine (thread-safe callee)
        self.loop = loop or asyncio.get_running_loop()
        self.outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.cancel_error: BaseException | None = None  # reported as the job's error instead of a quiet abort
        self.arrived_at = time.perf_counter()
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.last_step_at: float | None = None
        self.finished_at: float | None = None
        self.num_generated = 0
        self.finish_reason: str | None = None  # stop, length, abort or error
        self.stats: SpecStats | None = None
        self.done = threading.Event()

    def cancel(self, error: BaseException | None = None) -> None:
        """Ask the worker to stop this job at its next step (or to skip it if it has not started); with an
        error, the job ends with that error (the client is still there and should be told why)."""
        if error is not None and not self._cancelled.is_set():
            self.cancel_error = error
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, output: StepOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, output)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel()

    def end(self, reason: str, error: BaseException | None = None, last: StepOutput | None = None) -> None:
        """Hand over the job's last output (the engine's, or an empty one) with its end, and mark it done."""
        last = last or StepOutput(None, [], [])
        last.finish_reason, last.error, last.stats = reason, error, self.stats
        self.emit(last)
        self.done.set()

    async def outputs_until_done(self) -> AsyncIterator[StepOutput]:
        """The job's outputs as the worker hands them over, the last one with its finish_reason."""
        while True:
            output = await self.outputs.get()
            yield output
            if output.finish_reason is not None:
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
    """Owns the engine; admits queued jobs first come, first served while it has a free sequence slot, and runs
    them together, one BatchEngine step at a time, on its own thread (continuous batching; `parallel` = the
    engine's max_running, 1 = one request at a time)."""

    def __init__(self, batch: BatchEngine, metrics: ServerMetrics | None = None, name: str = "specdec-engine"):
        self.batch = batch
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._running: dict[int, tuple[Job, object, dict]] = {}  # request id -> (job, sequence, stats snapshot)
        self._stopping = False
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
    def running_jobs(self) -> list[Job]:
        with self._lock:
            return [job for job, _, _ in self._running.values()]

    @property
    def current(self) -> Job | None:
        """The oldest running job (None when none runs)."""
        jobs = self.running_jobs
        return jobs[0] if jobs else None

    @property
    def idle(self) -> bool:
        """No job running and none queued (a job being handed from the queue counts as waiting)."""
        with self._lock:
            return not self._running and self._waiting == 0

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
            job.end("abort", error)
            failed += 1

    def submit(self, job: Job) -> None:
        with self._lock:
            self._waiting += 1
        if self.metrics:
            self.metrics.waiting.inc()
        self._queue.put(job)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop after the running jobs' next step; queued jobs are failed with ServerShuttingDown."""
        for job in self.running_jobs:
            job.cancel(ServerShuttingDown("the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the worker thread --------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            try:
                if not self._admit():
                    break
                self._drop_cancelled()
                if self._running:
                    self._step()
            except BaseException:  # never let one request kill the worker
                log.exception("engine worker failed")
                self._fail_running(RuntimeError("the engine failed; see the server log"))
                time.sleep(0.1)  # a fault outside any request (admission itself) must not spin this thread
        for job in self.running_jobs:  # stopping: the running jobs end with the shutdown error
            job.cancel(ServerShuttingDown("the server is shutting down"))
        self._drop_cancelled()
        self._drain()

    def _admit(self) -> bool:
        """Move queued jobs into free slots (waiting for one when nothing runs); False once told to stop."""
        while not self._stopping and self.batch.has_room:
            try:
                job = self._queue.get(block=not self._running)
            except queue.Empty:
                return True
            if job is None:
                self._stopping = True
                return False
            with self._lock:
                self._waiting -= 1
            if self.metrics:
                self.metrics.waiting.dec()
            self._start(job)
        return not self._stopping

    def _start(self, job: Job) -> None:
        job.started_at = time.perf_counter()
        self.jobs_started += 1
        metrics = self.metrics
        if metrics:
            metrics.request_queue_time.observe(job.started_at - job.arrived_at)
        if job.cancelled:  # the client left while waiting (or the server is stopping): do no work
            self._finish(job, "abort", None)
            job.end("abort", job.cancel_error)
            return
        if job.on_start is not None:
            job.on_start()
        try:
            sequence = self.batch.add(job.prompt_ids, job.params, tag=job, partition=job.partition)
        except Exception as exc:  # noqa: BLE001 - a request the engine refused: reported to its client
            self._finish(job, "error", None)
            job.end("error", exc)
            return
        with self._lock:
            self._running[sequence.request_id] = (job, sequence, {})
        if metrics:
            metrics.running.inc()
            metrics.prompt_tokens(len(job.prompt_ids))

    def _drop_cancelled(self) -> None:
        """Cancelled jobs leave at this step boundary: their slots are free for the next step."""
        for request_id, (job, sequence, snapshot) in list(self._running.items()):
            if job.cancelled:
                self.batch.abort(sequence)
                self._end(request_id, None)

    def _step(self) -> None:
        metrics = self.metrics
        outputs = self.batch.step()
        if metrics:
            metrics.pass_rows.observe(self.batch.last_pass_rows)
        now = time.perf_counter()
        for output in outputs:
            request_id = output.request_id
            entry = self._running.get(request_id)
            if entry is None:
                continue
            job, sequence, snapshot = entry
            if output.error is not None:
                self._end(request_id, output.error, output)
                continue
            if output.tokens or output.finish_reason:
                if metrics:
                    if job.first_token_at is None:
                        metrics.time_to_first_token.observe(now - job.arrived_at)
                    else:
                        metrics.inter_token_latency.observe(now - job.last_step_at)
                    metrics.generation_tokens(len(output.tokens))
                    metrics.add_stats_delta(sequence.stats, snapshot)
                if job.first_token_at is None:
                    job.first_token_at = now
                job.last_step_at = now
                job.num_generated += len(output.tokens)
                if output.finish_reason is not None:
                    job.finish_reason = output.finish_reason
            if output.finish_reason is not None:
                self._end(request_id, None, output)  # hands this last output over after the job's accounting
            else:
                job.emit(output)

    def _end(self, request_id: int, error: BaseException | None, last: StepOutput | None = None) -> None:
        """A job's sequence has left the engine: account for it, then hand over its last output (the engine's
        `last`, or an empty one) with how it ended (its finish reason, or the error that ended it)."""
        with self._lock:
            job, sequence, snapshot = self._running.pop(request_id)
        metrics = self.metrics
        if metrics:
            metrics.running.dec()
            metrics.add_stats_delta(sequence.stats, snapshot)
        if error is None and job.cancel_error is not None and job.finish_reason not in ("stop", "length"):
            error = job.cancel_error  # stopped from outside before its end: tell the client why
        if error is None:
            reason = job.finish_reason or "abort"
        else:
            reason = "abort" if error is job.cancel_error else "error"
        self._finish(job, reason, sequence.stats)
        job.end(reason, error, last)

    def _fail_running(self, error: BaseException) -> None:
        for request_id, (job, sequence, _) in list(self._running.items()):
            try:
                self.batch.abort(sequence)
            except Exception:  # noqa: BLE001 - already failing; the job must still be told
                log.exception("could not end a sequence")
            self._end(request_id, error)

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.finish_reason = "abort"
                job.end("abort", ServerShuttingDown("the server is shutting down"))

    def _finish(self, job: Job, reason: str, stats: SpecStats | None) -> None:
        job.finished_at = time.perf_counter()
        job.finish_reason = reason
        job.stats = stats
        if self.metrics:
            self.metrics.request_finished(reason)
            self.metrics.e2e_request_latency.observe(job.finished_at - job.arrived_at)
