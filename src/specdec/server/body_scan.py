"""Counts a JSON body's array items and object members without parsing it, a window at a time, so a body of
millions of tiny values is refused before any parser builds them and the event loop keeps answering meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

SCAN_WINDOW_BYTES = 1 << 18  # ~2 ms of work per window on the 2-vCPU EPYC: the loop answers others in between

_STRUCTURE = b",[{"


def structure_counts(body: bytes, window: int = SCAN_WINDOW_BYTES) -> Iterator[int]:
    """Yield, after each window of `body`, how many commas and opening brackets seen so far lie outside JSON
    strings.

    That number bounds the values a parser would build: every array item and object member but the first of
    its container follows a comma, and each container opens with a bracket. Strings are skipped (a long code
    prompt full of commas counts nothing), by their unescaped quotes: escaped backslashes and escaped quotes
    are removed first, and a window never ends inside a run of backslashes, so an escape is never cut in two.
    Invalid JSON gets some count and is refused by the parser afterwards."""
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    inside_string = False
    total = 0
    start, size = 0, len(body)
    while start < size:
        end = min(size, start + window)
        while end < size and body[end - 1] == 0x5C:  # a backslash: take the rest of its run and what it escapes
            end += 1
        chunk = body[start:end]
        if b"\\" in chunk:
            chunk = chunk.replace(b"\\\\", b"").replace(b'\\"', b"")
        pieces = chunk.split(b'"')
        outside = b"".join(pieces[1::2] if inside_string else pieces[0::2])
        total += len(outside) - len(outside.translate(None, _STRUCTURE))
        if len(pieces) % 2 == 0:  # an odd number of quotes: the window ends on the other side of one
            inside_string = not inside_string
        yield total
        start = end


def may_exceed(body: bytes, max_values: int) -> bool:
    """Whether `body` is long enough that its count could pass `max_values` (each counted byte is one byte)."""
    return len(body) > max_values


async def holds_more_values(body: bytes, max_values: int) -> bool:
    """Whether `body` holds more than `max_values` items and members; counted a window at a time, handing the
    event loop back between windows so that other requests are answered meanwhile."""
    if not may_exceed(body, max_values):
        return False
    for count in structure_counts(body):
        if count > max_values:
            return True
        await asyncio.sleep(0)
    return False


def too_many_values_message(max_values: int) -> str:
    return (f"the request body holds more than {max_values} JSON values (array items and object members); this "
            f"server parses at most {max_values}: send fewer messages, parts or token ids")
