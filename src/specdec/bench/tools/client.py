"""One streamed chat request, timed from just before it is sent (first content or call delta, last one, end), its
calls gathered from the deltas as an OpenAI client gathers them. Works against specdec serve and llama-server."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from specdec.bench.serving.client import parse_event


@dataclass
class ChatRecord:
    system: str
    item: str
    kind: str  # "tools" or "structured"
    content: str = ""
    calls: list = field(default_factory=list)  # [{"name", "arguments" (text)}] in index order
    finish_reason: str | None = None
    ttft: float | None = None
    last_delta: float | None = None
    e2e: float | None = None
    tokens: int | None = None
    prompt_tokens: int | None = None
    forced_tokens: int | None = None  # ours: tokens the grammar forced
    error: str | None = None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first over the time from the first delta to the last (None with fewer than 3)."""
        if self.tokens is None or self.tokens < 3 or self.ttft is None or self.last_delta is None:
            return None
        span = self.last_delta - self.ttft
        return (self.tokens - 1) / span if span > 0 else None

    def parsed_calls(self) -> list[dict] | None:
        """The calls with their arguments parsed (None if any call's arguments are not JSON)."""
        try:
            return [{"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")} for c in self.calls]
        except ValueError:
            return None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["decode_tokens_per_second"] = self.decode_tokens_per_second
        return out


async def stream_chat(client, url: str, body: dict, record: ChatRecord, timeout: float) -> ChatRecord:
    """Send one streamed chat request (usage asked for) and fill `record`; never raises for a failed request."""
    began = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    calls: dict[int, dict] = {}

    async def read() -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
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
                for choice in payload.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        record.ttft = now if record.ttft is None else record.ttft
                        record.last_delta = now
                    record.content += delta.get("content") or ""
                    for part in delta.get("tool_calls") or []:
                        call = calls.setdefault(part.get("index", 0), {"name": "", "arguments": ""})
                        function = part.get("function") or {}
                        call["name"] += function.get("name") or ""
                        call["arguments"] += function.get("arguments") or ""
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                usage = payload.get("usage")
                if usage:
                    record.tokens, record.prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
                specdec = payload.get("specdec")
                if isinstance(specdec, dict) and "num_forced_tokens" in specdec:
                    record.forced_tokens = specdec["num_forced_tokens"]

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - a connection error is this request's failure
        record.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    record.e2e = time.perf_counter() - began
    record.calls = [calls[i] for i in sorted(calls)]
    if record.error is None and record.tokens is None:
        record.error = "the stream ended without its usage"
    return record
