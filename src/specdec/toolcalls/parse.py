"""A model's output -> OpenAI content and tool calls, as the text streams in: a call is returned only once it is
whole and names a known tool with JSON-object arguments; anything else (a malformed or unfinished call) stays
content, so a client never receives a broken call. The same parser serves a whole reply and a stream."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from specdec.toolcalls.formats import ToolCallFormat


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's id, the function's name, its arguments as the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(body: str, fmt: ToolCallFormat, names: Collection[str]) -> ToolCall | None:
    """The call written between a format's tags, or None when it is not one (not JSON, an unknown tool, arguments
    that are no JSON object). Arguments sent as a JSON string holding an object are read as that object."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _call_of(value, fmt, names)


def _call_of(value, fmt: ToolCallFormat, names: Collection[str]) -> ToolCall | None:
    """read_call's rule on a decoded JSON value: an object naming a known tool, with JSON-object arguments."""
    if not isinstance(value, dict):
        return None
    name, arguments = value.get(fmt.name_key), value.get(fmt.arguments_key, {})
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


JSON_STARTS = ("```", "{", "[")  # how a reply that is only a JSON call (bare or fenced) begins
_FENCED = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\s*```", re.DOTALL)


def whole_json_calls(text: str, fmt: ToolCallFormat, names: Collection[str]) -> list[ToolCall] | None:
    """A reply that is nothing but a call or a list of calls as JSON ({"name", "arguments"}, bare or in one ```json
    fence, as Qwen2.5-Coder often answers instead of its template's tags), or None when it is anything else."""
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _all_calls(value if isinstance(value, list) else [value], fmt, names)


def _all_calls(items: list, fmt: ToolCallFormat, names: Collection[str]) -> list[ToolCall] | None:
    """Each decoded item as a call, its arguments under either family's key ("arguments", or Llama 3's
    "parameters"); None when there are none or any one is not a call (then none is returned)."""
    calls = []
    for item in items:
        if isinstance(item, dict) and fmt.arguments_key not in item:
            key = next((k for k in ("arguments", "parameters") if k in item), None)
            if key is not None:
                item = {**item, fmt.arguments_key: item[key]}
        call = _call_of(item, fmt, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def array_calls(body: str, fmt: ToolCallFormat, names: Collection[str]) -> list[ToolCall] | None:
    """The calls of a format that writes them as one JSON array after its tag (Mistral), or None when the body is
    not such an array of well-formed calls."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _all_calls(value, fmt, names) if isinstance(value, list) else None


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters begin `tag` (they are held back until the next text decides)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Feed text as it comes; each feed returns what is now certain, in order: content strings and ToolCalls.

    Text that may begin a call's opening tag is held until it is decided; whitespace around calls is dropped. A
    reply that opens as JSON (`{`, `[` or a ``` fence) is held whole: at its end it is either calls
    (whole_json_calls) or content. Without any call the content is exactly the text fed (finish() gives back
    what was held)."""

    def __init__(self, fmt: ToolCallFormat, names: Collection[str]):
        self.fmt = fmt
        self.names = frozenset(names)
        self.open_tag, self.close_tag = fmt.open.strip(), fmt.close.strip()
        self.pending = ""  # text not yet decided
        self.inside = False  # between an opening tag and its close
        self.held = ""  # trailing whitespace of the content so far (dropped if a call follows)
        self.calls = 0
        self.after_call = False
        self.opening = ""  # the reply's first text while it may still open as JSON
        self.decided = False  # whether the reply's opening has been read
        self.whole: str | None = None  # a reply that opened as JSON, held to its end

    def feed(self, text: str) -> list[str | ToolCall]:
        if self.whole is not None:
            self.whole += text
            return []
        if not self.decided:
            self.opening += text
            start = self.opening.lstrip()
            if start.startswith(JSON_STARTS):
                self.whole, self.opening, self.decided = self.opening, "", True
                return []
            if not start or any(mark.startswith(start) for mark in JSON_STARTS):
                return []  # whitespace, or "`"/"``": not decided yet
            text, self.opening, self.decided = self.opening, "", True
        return self._feed(text)

    def _feed(self, text: str) -> list[str | ToolCall]:
        self.pending += text
        out: list[str | ToolCall] = []
        if not self.open_tag:  # a family whose only call is the whole reply as JSON (held by feed)
            self._content(self.pending, out)
            self.pending = ""
            return out
        while True:
            if self.inside and self.fmt.array:
                return out  # the array of calls runs to the end of the reply: decided there (_finish)
            if not self.inside:
                at = self.pending.find(self.open_tag)
                if at < 0:
                    keep = _partial_tag(self.pending, self.open_tag)
                    self._content(self.pending[: len(self.pending) - keep], out)
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
                self._content(self.pending[:at], out)
                self.pending, self.inside = self.pending[at + len(self.open_tag) :], True
            else:
                end = self.pending.find(self.close_tag)
                if end < 0:
                    return out
                body, self.pending, self.inside = self.pending[:end], self.pending[end + len(self.close_tag) :], False
                call = read_call(body, self.fmt, self.names)
                if call is None:
                    self._content(self.open_tag + body + self.close_tag, out)
                else:
                    out.append(call)
                    self.calls += 1
                    self.held, self.after_call = "", True

    def finish(self) -> list[str | ToolCall]:
        """The end of the text: an unfinished call and any held text come back as content."""
        if self.whole is not None:
            whole, self.whole = self.whole, None
            calls = whole_json_calls(whole, self.fmt, self.names)
            if calls:
                self.calls += len(calls)
                return list(calls)
            return self._feed(whole) + self._finish()
        if not self.decided:
            self.decided = True
            opening, self.opening = self.opening, ""
            return self._feed(opening) + self._finish()
        return self._finish()

    def _finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self.inside and self.fmt.array:
            calls = array_calls(self.pending, self.fmt, self.names)
            if calls:
                self.pending, self.inside = "", False
                self.calls += len(calls)
                self.held = ""
                return list(calls)
        rest = (self.open_tag if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        self._content(rest, out)
        if not self.calls and self.held:
            out.append(self.held)
        self.held = ""
        return out

    def _content(self, text: str, out: list) -> None:
        text = self.held + text
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        self.held = text[len(body) :]
        if body:
            out.append(body)
            self.after_call = False


def split_tool_calls(text: str, fmt: ToolCallFormat, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, calls); content is None when there are calls and nothing else."""
    stream = ToolCallStream(fmt, names)
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if calls else content, calls
