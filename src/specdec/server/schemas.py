"""OpenAI request models (pydantic, strict types, unknown fields refused) and the response/chunk bodies returned.

The request models are also the OpenAPI document: every constraint declared here (non-empty prompt and
messages, the accepted roles, non-negative token ids) is enforced by validation, and validation accepts
nothing the document does not declare (no type coercion: "3" is not an integer, "yes" is not a boolean)."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdec.config import ConfigError, SamplingParams
from specdec.core.logprobs import MAX_TOP_LOGPROBS
from specdec.server.errors import bad_request, unsupported
from specdec.server.logprob_reply import joined
from specdec.server.request_limits import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
)
from specdec.server.tools import (
    MAX_TOOLS,
    ToolCallLedger,
    ToolCallMessagePart,
    ToolChoice,
    ToolPlan,
    Tools,
    assistant_tool_calls,
    reply_finish,
)

# ---------------------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    # strict: JSON types only, never coerced ("3" is no integer, true no token id); a float field still
    # takes a JSON integer (`temperature: 1`), which is the same JSON number.
    model_config = ConfigDict(extra="forbid", strict=True)


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# What /v1/completions accepts as `prompt`; a list of several prompts (a batch) is refused as unsupported.
Prompt = NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1)] | Annotated[
    list[TokenIds], Field(min_length=1)]
# At most MAX_STOP_SEQUENCES strings of at most MAX_STOP_CHARS characters (see request_limits).
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)]
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


def lone_surrogate_path(value: Any) -> str | None:
    """Where in a parsed JSON value the first string that is not valid Unicode sits, as a dotted path
    ("messages.0.content"; a bad key: the object holding it, "" for the top level), or None.

    JSON's \\ud800 escapes decode to lone UTF-16 surrogates, which no tokenizer, chat template or
    UTF-8 writer accepts. Iterative, because a body may nest deeper than Python's recursion limit. Almost every
    body has none: one C-speed encoding of the whole value says so, and only a body that fails it is walked."""
    try:
        json.dumps(value, ensure_ascii=False, check_circular=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, RecursionError):  # not plain JSON data, or nested deeper than dumps goes: walk it
        pass
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not _encodable(key):
                    return path
                children.append((child, child_path))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item)]))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(StrictModel):
    include_usage: bool = False


class _GenerationRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Unknown fields are refused (400), and known options that would change the output but that
    we cannot apply exactly (penalties, logit_bias, logprobs, n > 1, ...) are refused too: a
    request is either served as asked or rejected, never silently approximated.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI default 1.0; 0 = greedy
    top_p: float | None = None
    seed: int | None = None
    stop: Stop | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM spelling): top_k (0 or -1 disables), min_p (0 disables), ignore_eos, repetition_penalty
    # (llama.cpp's repeat_penalty, its spelling accepted too, over the last repeat_last_n tokens; 1 disables).
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None
    # Structured output (OpenAI's; vLLM also takes it on /v1/completions): text, json_object or json_schema.
    response_format: dict[str, Any] | None = None
    repeat_last_n: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    # Narrows who shares this request's caches within its tenant (vLLM's cache_salt; OpenAI's prompt_cache_key
    # is read the same way when no cache_salt is given): it can never widen sharing beyond the tenant.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and len(messages) > MAX_CHAT_MESSAGES:
            return data  # refused by its length next (too_long), without reading its text first
        return refuse_lone_surrogates(data)


def refuse_lone_surrogates(data: Any) -> Any:
    """A request body's validator: any string holding a lone UTF-16 surrogate is refused, naming its path."""
    path = lone_surrogate_path(data)
    if path is not None:
        where = f"'{path}'" if path else "the request body"
        raise PydanticCustomError(
            "invalid_unicode", "{where} is not valid Unicode text: it contains a lone UTF-16 surrogate "
            "(a \\ud800-\\udfff escape that is not half of a pair)", {"where": where, "param": path or None})
    return data


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(StrictModel):
    role: ChatRole  # "developer" is the newer name of "system"
    # null or left out only on an assistant message that makes tool calls (chat_messages checks it)
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallMessagePart], Field(max_length=MAX_TOOLS)] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only: the call it answers

    @field_validator("role", mode="before")
    @classmethod
    def _no_function_messages(cls, role: Any) -> Any:
        if role == "function":  # OpenAI's deprecated function calling: tool messages replace it
            raise PydanticCustomError("unsupported", "'function' messages are OpenAI's deprecated function calling; "
                                      "send tool messages (role 'tool', with tool_call_id)", {})
        return role


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None


# ---------------------------------------------------------------------------------------------------------
# Request -> SamplingParams, with every refusal naming its parameter
# ---------------------------------------------------------------------------------------------------------


def check_completion_options(req: CompletionRequest) -> None:
    if req.echo and req.suffix is not None:
        raise bad_request("echo cannot be combined with suffix", "echo")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of=1")


def check_chat_options(req: ChatCompletionRequest) -> None:
    # tools, tool_choice and parallel_tool_calls are read by server/tools.py; the deprecated function calling
    # fields are refused, naming their replacement.
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise unsupported(name, "OpenAI's deprecated function calling: send tools and tool_choice")
    if req.modalities is not None and list(req.modalities) != ["text"]:
        raise unsupported("modalities", "only ['text']")
    for name in ("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"):
        if getattr(req, name) is not None:
            raise unsupported(name)


def sampling_params(req: _GenerationRequest, max_tokens: int | None, default_max_tokens: int,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    """Validate the shared sampling fields and build SamplingParams (max_tokens None -> default)."""
    if req.n is not None and req.n < 1:
        raise bad_request(f"n must be at least 1, got {req.n}", "n")
    if req.n not in (None, 1):
        raise unsupported("n", "only n=1; send one request per completion")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    penalties = penalty_options(req)
    penalties["json_schema"] = response_schema(req.response_format)
    penalties["logprobs"] = requested_logprobs(req)
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if echo and (penalties["logprobs"] is not None or max_tokens == 0):
        # The prompt's own scores from the prefill (what lm-evaluation-harness reads); max_tokens 0: only them.
        penalties["prompt_logprobs"] = penalties["logprobs"] or 0
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise bad_request(f"{max_tokens_param} must be at least 1 (0 only with echo), got {max_tokens}",
                          max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise bad_request(f"temperature must be a finite number >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not (0 < top_p <= 1):
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise bad_request(f"top_k must be >= 0 (or -1 to disable), got {req.top_k}", "top_k")
    min_p = 0.0 if req.min_p is None else req.min_p
    if not (0 <= min_p < 1):
        raise bad_request(f"min_p must be in [0, 1), got {min_p}", "min_p")
    if req.seed is not None and not (-(2**63) <= req.seed < 2**64):
        raise bad_request("seed must fit in 64 bits", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop strings must be non-empty", "stop")
    try:
        return SamplingParams(
            temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
            max_tokens=int(max_tokens if max_tokens is not None else default_max_tokens), stop=tuple(stop),
            seed=req.seed, ignore_eos=bool(req.ignore_eos), **penalties,
        )
    except ConfigError as exc:
        raise bad_request(str(exc)) from exc


def requested_logprobs(req: _GenerationRequest) -> int | None:
    """How many alternatives per token the reply's logprobs list (None: no logprobs): completions' `logprobs: N`,
    chat's `logprobs: true` with `top_logprobs: N` (0 when left out)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        top, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        top, param = getattr(req, "logprobs", None), "logprobs"
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param)
    return top


def response_schema(response_format: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format as the JSON schema text the grammar engine compiles (None: free text).

    {"type": "text"} or absent: free text; {"type": "json_object"}: any JSON object; {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}: the schema (strict or not, it is enforced: the
    output always matches it)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    extra = set(response_format) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"response_format has unknown fields {sorted(extra)}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a json_schema object with a name and a schema",
                          "response_format.json_schema")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"response_format.json_schema has unknown fields {sorted(unknown)}",
                          "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad_request("response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                          "response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON object (a JSON schema)",
                          "response_format.json_schema.schema")
    if spec.get("strict") not in (None, True, False):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    return json.dumps(schema)  # key order kept: it is the order of the properties in the output


MAX_LOGIT_BIAS = 1024  # ids a logit_bias may name (each one is an index into every verified row)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound: -100 bans a token, 100 makes it all but certain


def logit_bias_pairs(bias: dict[str, float] | None, param: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs, each id an integer and each bias in
    [-100, 100]; ids beyond the vocabulary are refused by the engine before any work."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"{param} names {len(bias)} tokens; at most {MAX_LOGIT_BIAS}", param)
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"\d{1,9}", key.strip()):
            raise bad_request(f"{param} keys must be token ids (non-negative integers as strings), got {key!r}",
                              param)
        if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise bad_request(f"{param} values must be in [-100, 100], got {value} for token {key}", param)
        pairs.append((int(key), float(value)))
    if len({token for token, _ in pairs}) != len(pairs):
        raise bad_request(f"{param} names a token id twice", param)
    return tuple(sorted(pairs))


def checked_penalties(presence: float | None, frequency: float | None, repetition: float | None,
                      repeat_last_n: int | None, repetition_param: str = "repetition_penalty") -> dict[str, Any]:
    """The penalty values a client gave (None: not given), each checked with a 400 naming it, as SamplingParams
    fields: presence/frequency in [-2, 2] (OpenAI), the repetition penalty in (0, 10], repeat_last_n >= -1."""
    options: dict[str, Any] = {}
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if value is not None:
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise bad_request(f"{name} must be in [-2, 2], got {value}", name)
            options[name] = float(value)
    if repetition is not None:
        if not (math.isfinite(repetition) and 0 < repetition <= 10):
            raise bad_request(f"{repetition_param} must be in (0, 10], got {repetition}", repetition_param)
        options["repetition_penalty"] = float(repetition)
    if repeat_last_n is not None:
        if repeat_last_n < -1:
            raise bad_request(f"repeat_last_n must be -1 (the whole context), 0 (off) or more, got "
                              f"{repeat_last_n}", "repeat_last_n")
        options["repeat_last_n"] = int(repeat_last_n)
    return options


def penalty_options(req: _GenerationRequest) -> dict[str, Any]:
    """presence/frequency penalties (counted over the output), logit_bias, and the repetition penalty (vLLM's
    repetition_penalty or llama.cpp's repeat_penalty) as SamplingParams fields: applied to every verified row as
    plain decoding applies them (core/penalties.py)."""
    if req.repetition_penalty is not None and req.repeat_penalty is not None \
            and req.repetition_penalty != req.repeat_penalty:
        raise bad_request("repetition_penalty and repeat_penalty name the same option: give one",
                          "repetition_penalty")
    repetition = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    options = checked_penalties(req.presence_penalty, req.frequency_penalty, repetition, req.repeat_last_n,
                                "repetition_penalty" if req.repetition_penalty is not None else "repeat_penalty")
    options["logit_bias"] = logit_bias_pairs(req.logit_bias)
    return options


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content ("developer" is the system role), an assistant's
    tool calls with their arguments as objects, and tool messages each answering an earlier call."""
    messages = []
    ledger = ToolCallLedger()
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise unsupported(f"{where}.content", "only text content parts")
                texts.append(part["text"])
            content = "\n".join(texts)
        if message.tool_calls is not None and message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        if message.tool_call_id is not None and message.role != "tool":
            raise bad_request("only tool messages carry a tool_call_id", f"{where}.tool_call_id")
        if content is None and not message.tool_calls:
            raise bad_request("a message's content must be text (a string or a list of text parts): null content "
                              "only goes with an assistant's tool_calls", f"{where}.content")
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = assistant_tool_calls(message.tool_calls, where)
            ledger.called(message.tool_calls)
        if role == "tool":
            ledger.answered(message.tool_call_id, where)
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    return messages


def message_chars(messages: list[dict[str, Any]]) -> int:
    """The text a chat's messages carry (contents, names, call arguments): what check_prompt_chars bounds."""
    return sum(len(m["content"] or "") + len(m.get("name", ""))
               + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in messages)


# ---------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens the KV cache already held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseContext:
    """The envelope fields every body and chunk of one request shares, and its tool plan (chat with tools)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, tools: ToolPlan | None = None,
                 logprobs=None, echo: tuple[str, list[int]] | None = None):
        self.kind = kind
        self.model = model
        self.tools = tools
        self.logprobs = logprobs  # a LogprobShaper when the request asked for logprobs (server/logprob_reply.py)
        self.echo = echo  # completions' echo: the prompt's text and ids, written ahead of the completion
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def _logprobs(self, logprobs) -> dict[str, Any] | None:
        return self.logprobs.shape(self.kind, logprobs) if self.logprobs is not None else None

    def echoed(self, prompt_logprobs) -> tuple[str, dict[str, Any] | None]:
        """The echoed prompt's text and, when logprobs were asked for, its log-probabilities (first: null)."""
        text, ids = self.echo
        return text, (self.logprobs.prompt(ids, prompt_logprobs) if self.logprobs is not None else None)

    def full(self, text: str, finish_reason: str | None, usage_: dict, specdec: dict | None,
             logprobs=None, prompt_logprobs=None) -> dict[str, Any]:
        if self.kind == "completion":
            body = self._envelope("text_completion")
            head, head_logprobs = self.echoed(prompt_logprobs) if self.echo is not None else ("", None)
            body["choices"] = [{"index": 0, "text": head + text,
                                "logprobs": joined(head_logprobs, self._logprobs(logprobs)),
                                "finish_reason": finish_reason}]
        else:
            body = self._envelope("chat.completion")
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                message["content"], calls = self.tools.split(text)
                if calls:
                    message["tool_calls"] = [call.openai() for call in calls]
                finish_reason = reply_finish(finish_reason, len(calls))
            body["choices"] = [{"index": 0, "message": message, "logprobs": self._logprobs(logprobs),
                                "finish_reason": finish_reason}]
        body["usage"] = usage_
        body["specdec"] = specdec
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              include_usage: bool = False, specdec: dict | None = None,
              tool_calls: list[dict[str, Any]] | None = None, logprobs=None) -> dict[str, Any]:
        shaped = self._logprobs(logprobs) if logprobs else None
        if self.kind == "completion":
            body = self._envelope("text_completion")
            body["choices"] = [{"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}]
        else:
            body = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}]
        if include_usage:
            body["usage"] = None
        if specdec is not None:
            body["specdec"] = specdec
        return body

    def usage_chunk(self, usage_: dict, specdec: dict | None) -> dict[str, Any]:
        body = self._envelope("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        body["choices"] = []
        body["usage"] = usage_
        if specdec is not None:
            body["specdec"] = specdec
        return body


# ---------------------------------------------------------------------------------------------------------
# Response shapes, for the OpenAPI document (the handlers build plain dicts: see ResponseContext)
# ---------------------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the KV cache of the previous request")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = Field(None, description="the tokens' log-probabilities, when asked for")
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    specdec: dict[str, Any] | None = Field(description="this request's speculative decoding statistics")


class ResponseFunction(BaseModel):
    name: str
    arguments: str = Field(description="the JSON text of the arguments object")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the reply is tool calls only")
    tool_calls: list[ResponseToolCall] | None = Field(None, description="present when the model called tools")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = Field(None, description="the tokens' log-probabilities, when asked for")
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    specdec: dict[str, Any] | None = Field(description="this request's speculative decoding statistics")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="present once the model is loaded")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok", "loading", "error", "shutting_down"]
    message: str | None = Field(None, description="why loading failed")


# The 200 answer of a generation route: JSON, or with `stream: true` server-sent events.
GENERATION_200_DESCRIPTION = "the completion (JSON), or with `stream: true` `data: {chunk}` events then `data: [DONE]`"
SSE_RESPONSE = {"text/event-stream": {"schema": {"type": "string"}}}
