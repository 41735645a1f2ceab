"""The serving bench's load generator: concurrent streaming OpenAI chat requests, and the server's memory.

A level is a closed loop: C client workers, each taking the next prompt (in the given order) as soon as
its previous request ended, so at most C requests are in flight and every server sees the same prompts in
the same order. Each request is a streaming `/v1/chat/completions` call (greedy, `max_tokens`), timed from
just before it is sent: TTFT to the first non-empty content delta, end-to-end to the end of the stream.
Completion tokens come from the usage chunk (`stream_options.include_usage`), else from llama-server's
`timings.predicted_n`. A request fails on an HTTP error, an error event, a stream that ends without
`[DONE]` or a finish reason, or an exception (connection, timeout); its record says which.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import psutil

from specdec.bench.datasets import BenchPrompt

WARMUP_TEXT = "Say hello in one short sentence."  # not a benchmark prompt: nothing of it is reused
RSS_INTERVAL = 0.2  # seconds between memory samples


@dataclass
class RequestRecord:
    """One streamed request: what was asked, when, how long, how much, what came back, and why it failed."""

    task: str
    id: str
    index: int  # the prompt's position in the level's order
    worker: int = -1
    start: float = 0.0  # seconds from the level's start to this request's send
    ttft: float | None = None  # seconds to the first non-empty content delta
    e2e: float | None = None  # seconds to the end of the stream
    completion_tokens: int | None = None
    tokens_source: str | None = None  # "usage" or "timings" (llama-server's predicted_n)
    prompt_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    status: int | None = None  # HTTP status
    error: str | None = None  # None: the request succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


def chat_body(text: str, max_tokens: int, extra: dict | None = None) -> dict:
    """The request: one user turn, streamed, greedy, with the usage chunk asked for."""
    body = {
        "messages": [{"role": "user", "content": text}], "stream": True, "temperature": 0,
        "max_tokens": max_tokens, "stream_options": {"include_usage": True},
    }
    body.update(extra or {})
    return body


def parse_event(line: str):
    """One SSE line -> its JSON payload, "[DONE]", or None (blank lines, comments, `event:` lines).

    llama-server reports some errors as an `error: {...}` line instead of a data event; that payload is
    returned as {"error": ...}."""
    line = line.strip()
    for prefix in ("data:", "error:"):
        if line.startswith(prefix):
            payload = line[len(prefix):].strip()
            if payload == "[DONE]":
                return payload
            try:
                value = json.loads(payload)
            except json.JSONDecodeError:
                return {"error": {"message": f"unparsable event: {payload[:200]}"}}
            if prefix == "error:" and not (isinstance(value, dict) and "error" in value):
                value = {"error": value}
            return value
    return None


def apply_event(record: RequestRecord, payload, began: float, now: float) -> bool:
    """Fold one event into the record; True when the stream is over ([DONE] or an error)."""
    if payload == "[DONE]":
        return True
    if not isinstance(payload, dict):
        return False
    if "error" in payload:
        error = payload["error"]
        message = error.get("message") if isinstance(error, dict) else error
        record.error = f"error event: {str(message)[:300]}"
        return True
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            if record.ttft is None:
                record.ttft = now - began
            record.text += content
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = payload.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        record.completion_tokens, record.tokens_source = int(usage["completion_tokens"]), "usage"
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = int(usage["prompt_tokens"])
    timings = payload.get("timings")
    counted = isinstance(timings, dict) and timings.get("predicted_n") is not None
    if counted and record.tokens_source != "usage":
        record.completion_tokens, record.tokens_source = int(timings["predicted_n"]), "timings"
        if timings.get("prompt_n") is not None:
            record.prompt_tokens = int(timings["prompt_n"])
    return False


async def stream_one(client, url: str, body: dict, record: RequestRecord, timeout: float) -> RequestRecord:
    """Send one streaming chat request and fill `record` (never raises for a failed request)."""
    began = time.perf_counter()
    done = False

    async def read() -> None:
        nonlocal done
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {detail.strip()[:300]}"
                return
            async for line in response.aiter_lines():
                if apply_event(record, parse_event(line), began, time.perf_counter()):
                    done = True
                    return

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - connection errors and the like are this request's failure
        record.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    record.e2e = time.perf_counter() - began
    if record.error is None and not done:
        record.error = "the stream ended without [DONE]"
    if record.error is None and record.finish_reason is None:
        record.error = "the stream ended without a finish reason"
    return record


async def _closed_loop(url: str, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int,
                       timeout: float, extra: dict | None) -> tuple[list[RequestRecord], float]:
    import httpx  # the bench extra (the serving CLI checked it is installed)

    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    client_timeout = httpx.Timeout(timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=client_timeout, limits=limits) as client:
        level_start = time.perf_counter()

        async def worker(number: int) -> None:
            while True:
                try:
                    index, prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                record = RequestRecord(prompt.task, prompt.id, index, worker=number,
                                       start=time.perf_counter() - level_start)
                body = chat_body(prompt.text, max_tokens, extra)
                records.append(await stream_one(client, url, body, record, timeout))

        await asyncio.gather(*(worker(n) for n in range(concurrency)))
        wall = time.perf_counter() - level_start
    records.sort(key=lambda r: r.index)
    return records, wall


def run_level(url: str, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int, *,
              timeout: float = 600.0, extra: dict | None = None) -> tuple[list[RequestRecord], float]:
    """Send every prompt with at most `concurrency` in flight; (records in prompt order, wall seconds from
    the first send to the end of the last stream)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_closed_loop(url, prompts, concurrency, max_tokens, timeout, extra))


def warm_up(url: str, max_tokens: int = 16, timeout: float = 600.0,
            extra: dict | None = None) -> RequestRecord:
    """One untimed request of a prompt that is not in the benchmark."""
    records, _ = run_level(url, [BenchPrompt("warmup", "warmup", WARMUP_TEXT, WARMUP_TEXT)], 1, max_tokens,
                           timeout=timeout, extra=extra)
    return records[0]


# --------------------------------------------------------------------------------------------- memory


def tree_rss(pid: int) -> int | None:
    """Resident bytes of a process and all its descendants (None once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return total


def vm_hwm(pid: int) -> int | None:
    """The process's peak resident bytes over its life (VmHWM in /proc/PID/status), None where unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class RssSampler:
    """Samples the resident memory of a process tree every `interval` seconds on a daemon thread.

    `window()` starts a new window; `window_peak` is the largest sample since then, `peak` the largest
    since the sampler started."""

    def __init__(self, pid: int, interval: float = RSS_INTERVAL):
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.window_peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        rss = tree_rss(self.pid)
        if rss is not None:
            with self._lock:
                self.peak = max(self.peak, rss)
                self.window_peak = max(self.window_peak, rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def window(self) -> None:
        with self._lock:
            self.window_peak = 0
        self._sample()

    def stop(self) -> None:
        self._sample()
        self._stop.set()
        self._thread.join(5)


def cpu_count() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


__all__ = [
    "RequestRecord", "RssSampler", "apply_event", "chat_body", "cpu_count", "parse_event", "run_level",
    "stream_one", "tree_rss", "vm_hwm", "warm_up",
]
