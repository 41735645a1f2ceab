"""Server-sent events framing: one `data: {json}\n\n` event per chunk, and the `data: [DONE]` terminator."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: Any) -> bytes:
    """Frame one JSON payload as an SSE data event (compact JSON never contains a raw newline)."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def parse(lines: Iterable[str]) -> Iterator[Any]:
    """Decode a stream of SSE lines back into payloads (JSON objects, or the string "[DONE]")."""
    for line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        yield payload if payload == "[DONE]" else json.loads(payload)
