"""Which replica a request should go to under `specdec serve --replicas`: its affinity key and the replicas'
order of preference for that key. Pure functions, no Ray: ray_serve.py's router and ingress use them.

A conversation should come back to the replica that served its earlier turns: that replica's KV cache still
holds the conversation's prefix (only the new turn is prefilled) and its suffix drafter has seen the
conversation's text. The key that names a conversation is, first found wins:

1. the `X-Session-ID` request header (any string the client chooses);
2. the body's `prompt_cache_key` (OpenAI's own field for keeping requests on the same prompt cache);
3. the body's `user` (one end user's requests together);
4. the conversation's opening: the system/developer messages and the first user message of a chat (they stay
   the same on every later turn), or the first PREFIX_CHARS characters of a completion's prompt (the first
   PREFIX_TOKENS token ids when the prompt is given as ids).

Requests with none of these (or a body that is not JSON) have no key and are load-balanced.

With API keys the key is taken within the request's cache partition: the tenant its API key names (found by
the ingress, never read from the body) and its `cache_salt` or `prompt_cache_key`, as the replicas partition
their caches. Another tenant sending the same opening or session id gets an unrelated key, so where a request
lands tells nothing about what other tenants sent.

The order of preference is rendezvous (highest random weight) hashing of the key with each replica's id: every
router computes the same order without sharing state, and when a replica dies or one is added only the keys
whose first choice it was move. The router tries the replicas in that order and takes the first with room
(max_ongoing_requests), so a key sticks to its replica until that replica is full, and then spills to its
second choice instead of waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SESSION_HEADER = "x-session-id"
PREFIX_CHARS = 256
PREFIX_TOKENS = 64
MAX_KEY_CHARS = 256


def _digest(kind: str, text: str) -> str:
    return kind + ":" + hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:24]


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined (anything else as JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return json.dumps(content, sort_keys=True, default=str)


def conversation_opening(messages: Sequence[Any]) -> str | None:
    """The system/developer messages before the first user message, and that user message: what every later
    turn of the same chat starts with. None when there is no user message."""
    opening = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        opening.append(f"{role}\x00{_text(message.get('content'))}")
        if role == "user":
            return "\x01".join(opening)[: PREFIX_CHARS * 4]
    return None


def affinity_key(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]], body: bytes | None,
                 tenant: str | None = None) -> str | None:
    """The request's affinity key (see the module docstring), or None to load-balance it; within `tenant`'s
    partition (and the body's cache salt) when there is one.

    `headers`: a mapping with lower-case names, or ASGI's list of (name, value) byte pairs."""
    if not isinstance(headers, Mapping):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    payload = None
    if body:
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            payload = None
    payload = payload if isinstance(payload, dict) else None
    key = _conversation_key(headers, payload)
    if key is None:
        return None
    salt = None
    if payload is not None:
        salt = payload.get("cache_salt") if payload.get("cache_salt") is not None else payload.get("prompt_cache_key")
    if tenant is None and salt is None:
        return key
    scope = json.dumps([tenant, salt if isinstance(salt, str) else None])
    return _digest("partitioned", f"{scope}\x00{key}")


def _conversation_key(headers: Mapping[str, str], payload: dict | None) -> str | None:
    session = (headers.get(SESSION_HEADER) or "").strip()
    if session:
        return _digest("session", session[:MAX_KEY_CHARS])
    if payload is None:
        return None
    for field in ("prompt_cache_key", "user"):
        value = payload.get(field)
        if isinstance(value, str) and value.strip():
            return _digest(field, value.strip()[:MAX_KEY_CHARS])
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        opening = conversation_opening(messages)
        return _digest("chat", opening) if opening is not None else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _digest("prompt", prompt[:PREFIX_CHARS])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:PREFIX_TOKENS]):
        return _digest("tokens", ",".join(str(t) for t in prompt[:PREFIX_TOKENS]))
    return None


def weight(key: str, replica: str) -> int:
    """Rendezvous weight of a replica for a key (stable across processes and runs: no Python hash())."""
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest(), "big")


def rank(key: str, replicas: Iterable[str]) -> list[str]:
    """The replicas in the key's order of preference (highest weight first)."""
    return sorted(replicas, key=lambda replica: weight(key, replica), reverse=True)


# ------------------------------------------------------------------------------------- holding back a response


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip().lower() == b"text/event-stream"
               for k, v in headers)


def only_opening_events(data: bytes) -> bool:
    """Whether these SSE bytes hold nothing but the chat stream's opening `{"role": "assistant"}` delta(s):
    events a client can be spared if the request has to start again on another replica. Anything else (text,
    a finish reason, an error, usage, `[DONE]`, or bytes that are not whole events) counts as sent."""
    if not data.endswith(b"\n\n"):
        return False
    for block in data.split(b"\n\n"):
        block = block.strip()
        if not block:
            continue
        if not block.startswith(b"data:"):
            return False
        try:
            payload = json.loads(block[len(b"data:"):])
        except ValueError:
            return False
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or "error" in payload:
            return False
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if delta.get("content") or set(delta) - {"role", "content"}:
            return False
    return True


__all__ = [
    "PREFIX_CHARS", "PREFIX_TOKENS", "SESSION_HEADER", "affinity_key", "conversation_opening", "is_event_stream",
    "only_opening_events", "rank", "weight",
]
