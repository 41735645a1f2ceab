"""One streamed /infill request, timed from just before it is sent: first text, last text, end; cancelled after a
given time as an editor cancels on the next keystroke. Works against specdec serve and llama-server alike."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

from specdec.bench.serving.client import parse_event


@dataclass
class InfillRecord:
    """What one request gave: its text, its times, the server's counts, and why it failed or was cut short."""

    system: str
    item: str  # the problem or trace step
    content: str = ""
    ttft: float | None = None  # seconds to the first non-empty text
    last_text: float | None = None  # seconds to the last non-empty text
    e2e: float | None = None
    tokens: int | None = None  # tokens_predicted of the final object
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # timings.cache_n: prompt tokens the slot already held
    stop_type: str | None = None
    truncated: bool | None = None
    cancelled: bool = False
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first over the time after the first text (None with fewer than 3 tokens)."""
        if self.tokens is None or self.tokens < 3 or self.ttft is None or self.last_text is None:
            return None
        span = self.last_text - self.ttft
        return (self.tokens - 1) / span if span > 0 else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out


def infill_body(prefix: str, suffix: str, n_predict: int, extra: dict | None = None) -> dict:
    """A greedy streamed /infill request with prompt reuse on (an editor's); the same body for every server."""
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": n_predict, "temperature": 0,
            "stream": True, "cache_prompt": True}
    body.update(extra or {})
    return body


async def stream_infill(client, url: str, body: dict, record: InfillRecord, timeout: float,
                        cancel_after: float | None = None) -> InfillRecord:
    """Send one streamed /infill request and fill `record` (never raises for a failed request). With
    `cancel_after`, the connection is closed that many seconds after sending, finished or not."""
    began = time.perf_counter()

    async def read() -> None:
        async with client.stream("POST", url + "/infill", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {detail.strip()[:300]}"
                return
            async for line in response.aiter_lines():
                payload = parse_event(line)
                if not isinstance(payload, dict):
                    continue
                if "error" in payload:
                    record.error = f"error event: {str(payload['error'])[:300]}"
                    return
                now = time.perf_counter() - began
                if payload.get("content"):
                    record.ttft = now if record.ttft is None else record.ttft
                    record.last_text = now
                    record.content += payload["content"]
                if payload.get("stop"):
                    timings = payload.get("timings") or {}
                    record.tokens = payload.get("tokens_predicted")
                    record.prompt_tokens = payload.get("tokens_evaluated")
                    record.cached_tokens = timings.get("cache_n")
                    record.stop_type, record.truncated = payload.get("stop_type"), payload.get("truncated")
                    record.extra = {"timings": timings}
                    return

    limit = min(timeout, cancel_after) if cancel_after is not None else timeout
    try:
        await asyncio.wait_for(read(), limit)
    except asyncio.TimeoutError:
        if cancel_after is not None and cancel_after <= timeout:
            record.cancelled = True
        else:
            record.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - a connection error is this request's failure
        record.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    record.e2e = time.perf_counter() - began
    if record.error is None and not record.cancelled and record.tokens is None:
        record.error = "the stream ended without its final object"
    return record
