"""Tool calling: the Hermes parser (whole and streamed, malformed calls kept as content), the grammar that makes a
required call valid under speculation (greedy identical to plain constrained decoding), the chat template given
the tools and the tool history, and the openai SDK driving it all against a live server, bad input included."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.decoder import SpecDecoder
from specdec.toolcalls.formats import HERMES, LLAMA3_JSON, MISTRAL, detect_format
from specdec.toolcalls.grammar import tool_call_grammar
from specdec.toolcalls.parse import ToolCall, ToolCallStream, split_tool_calls
from tiny_gguf import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, write_tiny_gguf

NAMES = ("get_weather", "noargs")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def calls_of(events) -> list[tuple[str, dict]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


# --------------------------------------------------------------------------------------------- parsing (pure)


def test_the_format_is_found_from_the_template():
    assert detect_format(TOOL_CHAT_TEMPLATE) is HERMES
    assert detect_format(CHAT_TEMPLATE) is None  # renders no tools
    assert detect_format("{{ tools }} <function_calls>") is None  # a syntax this server does not parse
    assert detect_format("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]") is MISTRAL
    assert detect_format("{{ tools }}<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert detect_format(None) is None


@pytest.mark.parametrize("text", ["plain answer", "a < b and <tool", "ends with <tool_ca", "  spaced \n\n",
                                  "<tool_call>never closed", "x</tool_call>", "", '{"a": 1}', "``` not json```",
                                  '```json\n{"name": "get_weather"}\n``` and more', "`code`", "[1, 2]"])
def test_text_without_a_call_comes_back_exactly(text):
    assert split_tool_calls(text, HERMES, NAMES) == (text, [])
    stream = ToolCallStream(HERMES, NAMES)
    pieces = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(pieces) == text and not calls_of(pieces)


def test_calls_are_parsed_with_their_content_and_whitespace_around_them_dropped():
    text = f"Let me look.\n{CALL}\n" + CALL.replace("get_weather", "noargs").replace('{"city": "Paris"}', "{}") + "\n"
    content, calls = split_tool_calls(text, HERMES, NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("noargs", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert split_tool_calls(CALL, HERMES, NAMES)[0] is None  # calls only: content null, as OpenAI sends it
    # Arguments written as a JSON string holding an object are that object.
    quoted = CALL.replace('{"city": "Paris"}', json.dumps(json.dumps({"city": "Paris"})))
    assert calls_of(split_tool_calls(quoted, HERMES, NAMES)[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("bad", [
    CALL.replace('"Paris"}', '"Paris"'),  # not JSON
    CALL.replace("get_weather", "get_wether"),  # no such tool
    CALL.replace('{"city": "Paris"}', "[1, 2]"),  # arguments not an object
    CALL.replace('"name"', '"tool"'),  # no name
    CALL[:-5],  # never closed
])
def test_a_malformed_or_unfinished_call_stays_content_never_a_broken_call(bad):
    text = "Sure. " + bad
    assert split_tool_calls(text, HERMES, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    ' {"name": "get_weather", "arguments": {"city": "Paris"}}',
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noargs", "arguments": {}}]',
])
def test_a_reply_that_is_only_a_json_call_is_that_call(text):
    # Qwen2.5-Coder often answers with the call as bare or fenced JSON instead of its template's tags.
    for pieces in ([text], list(text)):
        stream = ToolCallStream(HERMES, NAMES)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        assert not [e for e in events if isinstance(e, str)]
        assert calls_of(events)[0] == ("get_weather", {"city": "Paris"})
    assert split_tool_calls(text.replace("get_weather", "unknown"), HERMES, NAMES)[1] == []


def test_streaming_in_any_pieces_gives_what_the_whole_text_gives():
    text = f"Checking. {CALL}\n{CALL.replace('Paris', 'Oslo')} done"
    content, calls = split_tool_calls(text, HERMES, NAMES)
    expected = [(c.name, json.loads(c.arguments)) for c in calls]
    assert content == "Checking.done" and len(expected) == 2
    for size in (1, 2, 3, 7, 13, len(text)):
        stream = ToolCallStream(HERMES, NAMES)
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
        assert "".join(e for e in events if isinstance(e, str)) == content
        assert calls_of(events) == expected


MISTRAL_CALLS = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "noargs", "arguments": {}, "id": "a1b2c3d4e"}]')
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("fmt, text, expected", [
    (MISTRAL, MISTRAL_CALLS, [("get_weather", {"city": "Paris"}), ("noargs", {})]),
    (MISTRAL, "Sure. " + MISTRAL_CALLS, [("get_weather", {"city": "Paris"}), ("noargs", {})]),
    (LLAMA3_JSON, LLAMA3_CALL, [("get_weather", {"city": "Paris"})]),
    (LLAMA3_JSON, "  " + LLAMA3_CALL.replace("parameters", "arguments"), [("get_weather", {"city": "Paris"})]),
])
def test_other_families_calls_are_parsed_whole_and_streamed(fmt, text, expected):
    for size in (1, 3, len(text)):
        stream = ToolCallStream(fmt, NAMES)
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
        assert calls_of(events) == expected, size
        content = "".join(e for e in events if isinstance(e, str))
        assert content == ("Sure." if text.startswith("Sure") else "")


@pytest.mark.parametrize("fmt, text", [
    (MISTRAL, MISTRAL_CALLS[:-2]),  # never closed
    (MISTRAL, MISTRAL_CALLS.replace("noargs", "unknown")),  # one call names no tool: none is returned
    (MISTRAL, "[TOOL_CALLS]{}"),
    (LLAMA3_JSON, "The call would be " + LLAMA3_CALL),  # not the whole reply
    (LLAMA3_JSON, LLAMA3_CALL[:-1]),
    (LLAMA3_JSON, "plain <tool_call> text"),
])
def test_other_families_malformed_calls_stay_content(fmt, text):
    assert split_tool_calls(text, fmt, NAMES) == (text, [])
    stream = ToolCallStream(fmt, NAMES)
    pieces = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(pieces) == text


# --------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    target = write_tiny_gguf(root / "target.gguf", seed=0, layers=3, tools=True)
    draft = write_tiny_gguf(root / "noisy.gguf", seed=0, layers=3, noise=0.15, tools=True)
    return SpecDecoder.load(ModelRef(target=str(target), draft=str(draft), max_context=1024, threads=1))


def required_params(decoder, tools, parallel=True) -> SamplingParams:
    schemas = [(t["function"]["name"], t["function"].get("parameters")) for t in tools]
    tags = {tag: decoder.added_vocab[tag] for tag in HERMES.tags}
    return SamplingParams(max_tokens=120, lark_grammar=tool_call_grammar(HERMES, schemas, parallel, tags))


@pytest.mark.parametrize("fmt", [MISTRAL, LLAMA3_JSON], ids=["mistral", "llama3-json"])
def test_a_required_call_in_other_families_syntax_is_valid_and_parses(decoder, fmt):
    schemas = [(t["function"]["name"], t["function"].get("parameters")) for t in (WEATHER, CLOCK)]
    params = SamplingParams(max_tokens=120, lark_grammar=tool_call_grammar(fmt, schemas, True))
    prompt = decoder.encode("Weather in Paris?", chat=False)
    plain = decoder.generate(prompt, params, SpecConfig(drafter="none"))
    fast = decoder.generate(prompt, params, SpecConfig(drafter="draft_model", num_speculative_tokens=4,
                                                       k_policy="fixed"))
    assert fast.tokens == plain.tokens and plain.finish_reason == "stop"
    content, calls = split_tool_calls(plain.text, fmt, ("get_weather", "clock"))
    assert calls and content is None, plain.text
    for call in calls:
        arguments = json.loads(call.arguments)
        assert (call.name == "clock" and arguments["zone"] in ("utc", "cet")) or arguments["unit"] in ("c", "f")


def test_the_template_gets_the_tools_and_the_tool_history(decoder):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = decoder.tokenizer.decode(decoder.encode_chat(messages, tools=[WEATHER]))
    assert '"name": "get_weather", "description": "the weather in a city"' in text  # the tool, as the template has it
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "<tools>" not in decoder.tokenizer.decode(decoder.encode_chat(messages[:1]))


@pytest.mark.parametrize("k", [2, 5])
def test_a_required_call_is_valid_and_greedy_equals_plain_constrained_decoding(decoder, k):
    prompt = decoder.encode_chat([{"role": "user", "content": "weather and time?"}], tools=[WEATHER, CLOCK])
    params = required_params(decoder, [WEATHER, CLOCK])
    plain = decoder.generate(prompt, params, SpecConfig(drafter="none"))
    fast = decoder.generate(prompt, params, SpecConfig(drafter="draft_model", num_speculative_tokens=k,
                                                       k_policy="fixed"))
    assert fast.tokens == plain.tokens and fast.finish_reason == "stop"
    content, calls = split_tool_calls(decoder.tokenizer.decode(fast.tokens, skip_special_tokens=True), HERMES,
                                      ("get_weather", "clock"))
    assert content is None and calls
    for call in calls:
        arguments = json.loads(call.arguments)
        if call.name == "get_weather":
            assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")
            assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8
        else:
            assert arguments in ({"zone": "utc"}, {"zone": "cet"})
    assert fast.stats.num_forced_tokens > 0  # the tags and the names need no drafter


def test_a_negative_control_a_call_the_grammar_was_not_given_is_not_made(decoder):
    # The same request without the grammar: the tiny model writes no call of its own, so the calls above come
    # from the constraint and not from the model.
    prompt = decoder.encode_chat([{"role": "user", "content": "weather and time?"}], tools=[WEATHER, CLOCK])
    free = decoder.generate(prompt, SamplingParams(max_tokens=60), SpecConfig(drafter="none"))
    assert split_tool_calls(decoder.tokenizer.decode(free.tokens, skip_special_tokens=True), HERMES,
                            ("get_weather", "clock"))[1] == []


# --------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(decoder):
    from specdec.server import create_app
    from test_server import LiveServer

    with LiveServer(create_app(decoder, served_model_name="tiny")) as live:
        yield live


@pytest.fixture()
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_full_tool_round_trip_through_the_openai_sdk(client):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=120, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "clock")
    json.loads(call.function.arguments)
    # The call and its result go back; the model answers (tool_choice auto: text, or a call if it wrote one).
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK], max_tokens=8,
                                           temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_streamed_call_is_the_call_a_whole_reply_makes(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK],
                  tool_choice={"type": "function", "function": {"name": "clock"}}, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == ["clock"]  # the named function, once
    names, arguments, ids, finish = {}, {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.delta.content in (None, "")
            for delta in choice.delta.tool_calls or []:
                if delta.id:
                    ids[delta.index], names[delta.index] = delta.id, delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(names.values()) == ["clock"]
    assert json.loads(arguments[0]) == json.loads(whole.message.tool_calls[0].function.arguments)


def test_auto_never_returns_a_broken_call(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                         tools=[WEATHER], max_tokens=30, temperature=1, seed=3)
    message = out.choices[0].message
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert message.content is not None or message.tool_calls


def _bad(server, body, param, code=None):
    import httpx

    response = httpx.post(server.url + "/v1/chat/completions", json={"max_tokens": 4, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_bad_tool_requests_are_clear_400s_and_the_server_goes_on(server, client):
    user = [{"role": "user", "content": "x"}]
    named = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in _bad(server, {"messages": user, "tools": [WEATHER], "tool_choice": named}, "tool_choice.function.name")["message"]
    _bad(server, {"messages": user + [{"role": "tool", "content": "r", "tool_call_id": "c9"}], "tools": [WEATHER]},
         "messages.1.tool_call_id")
    lookaround = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}}}
    _bad(server, {"messages": user, "tools": [lookaround], "tool_choice": "required"}, "tools", "invalid_tool_parameters")
    template_error = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    assert "system message" in _bad(server, {"messages": template_error, "tools": [WEATHER]}, "messages")["message"]
    _bad(server, {"messages": user, "tools": [WEATHER, WEATHER]}, "tools.1.function.name")
    _bad(server, {"messages": user, "tools": [{**WEATHER, "function": {"name": "has space"}}]}, "tools.0.function.name")
    _bad(server, {"messages": user, "tools": [CLOCK] * 129}, "tools")
    _bad(server, {"messages": user, "tool_choice": "required"}, "tool_choice")
    _bad(server, {"messages": user, "tools": [WEATHER], "tool_choice": "required",
                  "response_format": {"type": "json_object"}}, "response_format")
    out = client.chat.completions.create(model="tiny", messages=user, tools=[CLOCK], tool_choice="required",
                                         max_tokens=60, temperature=0)
    assert out.choices[0].message.tool_calls[0].function.name == "clock"
