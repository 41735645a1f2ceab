"""OpenAI tool calling at the door: the request's tools, tool_choice and tool messages checked and turned into what
the chat template takes, and a ToolPlan for the reply (which format to parse, which grammar constrains a required
call); the reply's tool_calls in OpenAI's shapes, whole or streamed."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import ConfigError, SamplingParams
from specdec.server.errors import bad_request, unsupported
from specdec.toolcalls.formats import ToolCallFormat, detect_format, known_format_names
from specdec.toolcalls.grammar import tool_call_grammar
from specdec.toolcalls.parse import ToolCall, ToolCallStream, split_tool_calls

MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOLS_JSON_BYTES = 256 * 1024  # every definition together, as JSON: all of it goes into the prompt
MAX_PARAMETERS_JSON_BYTES = 64 * 1024  # one tool's parameter schema (the grammar compiler's schema cap)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps names plain in a grammar


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallMessagePart(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tools mean for its prompt and reply."""

    fmt: ToolCallFormat
    names: tuple[str, ...]
    template_tools: list[dict[str, Any]]  # what the chat template gets as `tools`
    template_tools_chars: int  # their length as JSON text (what the prompt-size check counts)
    grammar: str | None  # Lark text constraining the output ("required" or a named function), else None
    forced: bool  # the output is calls only (finish_reason "tool_calls" whenever it ends on its own)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.fmt, self.names)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return split_tool_calls(text, self.fmt, self.names)


def tool_plan(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None, parallel: bool | None,
              template: str | None, added_vocab: Mapping[str, int]) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools, or tool_choice "none": a plain chat); 400s name the parameter.
    template: the model's chat template text; added_vocab: its tokenizer's added tokens (text -> id)."""
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise bad_request("tool_choice needs tools: give the tools the model may call", "tool_choice")
        return None
    if not tools:
        raise bad_request("tools must list at least one tool (omit it for none)", "tools")
    definitions = [tool.model_dump(exclude_none=True) for tool in tools]
    definitions_text = json.dumps(definitions)
    if len(definitions_text.encode()) > MAX_TOOLS_JSON_BYTES:
        raise bad_request(f"the tools take more than {MAX_TOOLS_JSON_BYTES} bytes as JSON", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise bad_request("a function name must be 1-64 letters, digits, _ or -", f"tools.{i}.function.name")
        if name in names:
            raise bad_request(f"two tools are named {name!r}", f"tools.{i}.function.name")
        parameters = tool.function.parameters
        if parameters is not None and len(json.dumps(parameters).encode()) > MAX_PARAMETERS_JSON_BYTES:
            raise bad_request(f"a tool's parameters take more than {MAX_PARAMETERS_JSON_BYTES} bytes as JSON",
                              f"tools.{i}.function.parameters")
        names.append(name)
    if tool_choice == "none":
        return None  # the model is not told of the tools, so it answers in text (earlier calls still render)
    fmt = detect_format(template)
    if fmt is None:
        raise unsupported("tools", "this model's chat template renders no tools in a tool-call syntax this server "
                          f"parses (known: {known_format_names()})")
    grammar, forced = None, False
    tags = {tag: added_vocab[tag] for tag in fmt.tags if tag and tag in added_vocab}
    if tool_choice == "required":
        schemas = [(t.function.name, t.function.parameters) for t in tools]
        grammar, forced = tool_call_grammar(fmt, schemas, parallel is not False, tags), True
    elif isinstance(tool_choice, NamedToolChoice):
        wanted = tool_choice.function.name
        if wanted not in names:
            raise bad_request(f"tool_choice names the function {wanted!r}, which is not among the tools",
                              "tool_choice.function.name")
        tool = tools[names.index(wanted)]
        grammar, forced = tool_call_grammar(fmt, [(wanted, tool.function.parameters)], False, tags), True
    return ToolPlan(fmt, tuple(names), definitions, len(definitions_text), grammar, forced)


def constrained_to_calls(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """The request's SamplingParams with its tool-call grammar, when tool_choice requires a call."""
    if plan is None or plan.grammar is None:
        return params
    if params.json_schema is not None:
        raise bad_request("response_format cannot constrain a reply that tool_choice requires to be a tool call",
                          "response_format")
    try:
        return dataclasses.replace(params, lark_grammar=plan.grammar)
    except ConfigError as exc:  # ignore_eos: the grammar decides where the calls end
        raise bad_request(f"tool_choice {exc}", "tool_choice") from None


def assistant_tool_calls(calls: list[ToolCallMessagePart], where: str) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates take them: arguments as the JSON object they encode."""
    out = []
    for j, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            raise bad_request("a tool call's arguments must be the JSON text of an object",
                              f"{where}.tool_calls.{j}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise bad_request("a tool call's arguments must be the JSON text of an object",
                              f"{where}.tool_calls.{j}.function.arguments")
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


class ToolCallLedger:
    """The calls the history has made and not yet answered: every tool message must answer one of them."""

    def __init__(self) -> None:
        self.open: set[str] = set()

    def called(self, calls: list[ToolCallMessagePart]) -> None:
        self.open |= {call.id for call in calls}

    def answered(self, tool_call_id: str | None, where: str) -> None:
        if tool_call_id is None:
            raise bad_request("a tool message needs the tool_call_id of the call it answers", f"{where}.tool_call_id")
        if tool_call_id not in self.open:
            raise bad_request(f"tool_call_id {tool_call_id!r} answers no earlier assistant tool call",
                              f"{where}.tool_call_id")
        self.open.discard(tool_call_id)


def reply_finish(finish: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason for a reply that made `calls` calls: "tool_calls" when it ended on its own."""
    return "tool_calls" if calls and finish == "stop" else finish


def tool_call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A call streamed as OpenAI streams one: its id, type and name first, then its arguments."""
    head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [head, {"index": index, "function": {"arguments": call.arguments}}]


class ToolCallChunks:
    """A streamed reply's text -> SSE chunks: content deltas as they are certain, each call once it is whole
    (its id and name, then its arguments), numbered from 0."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.stream = ctx.tools.stream()

    @property
    def calls(self) -> int:
        return self.stream.calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._chunks(self.stream.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return self._chunks(self.stream.finish())

    def _chunks(self, events: list) -> list[dict[str, Any]]:
        chunks, index = [], self.stream.calls - sum(isinstance(e, ToolCall) for e in events)
        for event in events:
            if isinstance(event, ToolCall):
                chunks += [self.ctx.chunk(None, tool_calls=[delta]) for delta in tool_call_deltas(event, index)]
                index += 1
            else:
                chunks.append(self.ctx.chunk(event))
        return chunks
