"""Per-request limits: the stop list's size, prompt text too long for the context (refused before tokenizing, so the
next request is not held up), empty and non-JSON bodies, and tool calling fields refused where they cannot be honoured."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx
from fastapi.testclient import TestClient

from specdec.server import create_app
from specdec.server.request_limits import (
    MAX_CHAT_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    prompt_char_limit,
)
from test_server import MAX_CONTEXT, LiveServer, make_decoder, tiny_tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = {"role": "user", "content": "w1 w2"}
PROMPT_LIMIT = prompt_char_limit(MAX_CONTEXT)


def one_token_text(chars: int) -> str:
    """Text of `chars` characters that the tiny whitespace tokenizer reads as one token: it fits any context."""
    return "w1" + " " * (chars - 2)


@pytest.fixture(scope="module")
def tokenized():
    """The lengths of the texts the server handed to the tokenizer (completion prompts and chat contents)."""
    return []


@pytest.fixture(scope="module")
def client(target_model, draft_model, tokenized):
    decoder = make_decoder(target_model, draft_model, tiny_tokenizer())
    encode, encode_chat = decoder.encode, decoder.encode_chat

    def recording_encode(prompt, *args, **kwargs):
        tokenized.append(len(prompt))
        return encode(prompt, *args, **kwargs)

    def recording_encode_chat(messages, *args, **kwargs):
        tokenized.append(sum(len(m["content"]) for m in messages))
        return encode_chat(messages, *args, **kwargs)

    decoder.encode, decoder.encode_chat = recording_encode, recording_encode_chat
    with TestClient(create_app(decoder, served_model_name="tiny")) as c:
        yield c


def post(client, path, body=None, **kwargs):
    """POST and return (response, seconds it took)."""
    began = time.perf_counter()
    response = client.post(path, json=body, **kwargs) if body is not None else client.post(path, **kwargs)
    return response, time.perf_counter() - began


def assert_quick_error(response, seconds, status, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert seconds < 1.0, f"a refusal took {seconds:.2f} s"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# --------------------------------------------------------------------------------------------- stop


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_huge_stop_list_is_refused_at_once(client, path):
    """100,000 stop strings (a 1.1 MB body, under the size limit) held the engine for 47 s on a real model."""
    stops = [f"stop sequence {i}" for i in range(100_000)]
    body = {"prompt": "w1 w2"} if path == COMPLETIONS else {"messages": [USER]}
    error = assert_quick_error(*post(client, path, {**body, "max_tokens": 2, "stop": stops}), 400, "stop")
    assert f"at most {MAX_STOP_SEQUENCES}" in error["message"] and "100000" in error["message"]


def test_stop_limits_count_and_length(client):
    body = {"prompt": "w1 w2", "max_tokens": 2}
    longest = "x" * MAX_STOP_CHARS
    served, _ = post(client, COMPLETIONS, {**body, "stop": [longest] * MAX_STOP_SEQUENCES})  # at the limits
    assert served.status_code == 200, served.text
    assert_quick_error(*post(client, COMPLETIONS, {**body, "stop": ["w9"] * (MAX_STOP_SEQUENCES + 1)}), 400, "stop")
    error = assert_quick_error(*post(client, COMPLETIONS, {**body, "stop": ["w9", longest + "x"]}), 400, "stop.1")
    assert f"at most {MAX_STOP_CHARS}" in error["message"]
    assert_quick_error(*post(client, COMPLETIONS, {**body, "stop": longest + "x"}), 400, "stop")
    stop = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["stop"]
    assert {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS} in stop["anyOf"]
    assert any(choice.get("maxItems") == MAX_STOP_SEQUENCES for choice in stop["anyOf"])


# --------------------------------------------------------------------------------------------- prompt length


WORDS = "w1 " * (PROMPT_LIMIT // 3 + 1)  # just over the limit, and far more words (tokens) than the context
OVERSIZE = [
    (COMPLETIONS, {"prompt": WORDS}, "prompt"),
    (COMPLETIONS, {"prompt": [WORDS]}, "prompt"),
    (CHAT, {"messages": [{"role": "system", "content": WORDS[: PROMPT_LIMIT // 2]},
                         {"role": "user", "content": WORDS[: PROMPT_LIMIT // 2 + 1]}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", OVERSIZE, ids=["text", "one-text-list", "chat"])
def test_text_too_long_for_the_context_is_refused_without_tokenizing(client, tokenized, path, body, param):
    tokenized.clear()
    error = assert_quick_error(*post(client, path, {**body, "max_tokens": 2}), 400, param, "context_length_exceeded")
    assert str(PROMPT_LIMIT) in error["message"]
    assert tokenized == []  # refused by its length: the tokenizer never saw it
    # One character less is tokenized and served (here it is a single token): the bound refuses nothing that fits.
    # A chat's bound counts the template's text too, so its content is that much shorter.
    overhead = 0 if path == COMPLETIONS else len(template_text(client, [{"role": "user", "content": ""}]))
    fitting = {"prompt": one_token_text(PROMPT_LIMIT)} if path == COMPLETIONS else {
        "messages": [{"role": "user", "content": one_token_text(PROMPT_LIMIT - overhead)}]}
    served, _ = post(client, path, {**fitting, "max_tokens": 2})
    assert served.status_code == 200, served.text
    assert tokenized == [PROMPT_LIMIT - overhead]


def template_text(client, messages) -> str:
    tokenizer = client.app.state.specdec.decoder.tokenizer
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_chat_templates_expansion_counts_before_tokenizing(client, tokenized):
    """Many short messages: their contents fit the bound, the template's role markers around each do not. The
    server renders the template and refuses the text by its length, untokenized (240k one-character messages
    once expanded to 1.44M tokens and held the tokenizer 9.5 s)."""
    messages = [{"role": "user", "content": one_token_text(12)}] * MAX_CHAT_MESSAGES
    assert sum(len(m["content"]) for m in messages) <= PROMPT_LIMIT < len(template_text(client, messages))
    tokenized.clear()
    error = assert_quick_error(*post(client, CHAT, {"messages": messages, "max_tokens": 2}), 400, "messages",
                               "context_length_exceeded")
    assert "chat template" in error["message"]
    assert tokenized == [sum(len(m["content"]) for m in messages)]  # handed to encode_chat, which refused it
    # Within the bound the same messages are served: the check counts, it does not refuse chats as such.
    served, _ = post(client, CHAT, {"messages": messages[:8], "max_tokens": 2})
    assert served.status_code == 200, served.text


def test_more_messages_or_parts_than_the_caps_are_refused_by_count(client, tokenized):
    tokenized.clear()
    too_many = [{"role": "user", "content": "w1"}] * (MAX_CHAT_MESSAGES + 1)
    error = assert_quick_error(*post(client, CHAT, {"messages": too_many}), 400, "messages")
    assert str(MAX_CHAT_MESSAGES) in error["message"]
    parts = [{"type": "text", "text": "w1"}] * (MAX_CONTENT_PARTS + 1)
    error = assert_quick_error(*post(client, CHAT, {"messages": [{"role": "user", "content": parts}]}), 400,
                               "messages.0.content")
    assert str(MAX_CONTENT_PARTS) in error["message"]
    assert tokenized == []
    at_cap = [{"type": "text", "text": "w1"}] + [{"type": "text", "text": " "}] * (MAX_CONTENT_PARTS - 1)
    served, _ = post(client, CHAT, {"messages": [{"role": "user", "content": at_cap}], "max_tokens": 2})
    assert served.status_code == 200, served.text


def block_tokenizing_above(decoder, route: str, chars_limit: int, release: threading.Event) -> list[int]:
    """Make the decoder's tokenizing of texts longer than `chars_limit` block until `release` (as if it took
    forever); returns the list of the lengths it was handed."""
    name = "encode" if route == "completion" else "encode_chat"
    real = getattr(decoder, name)
    held: list[int] = []

    def blocking(arg, *args, **kwargs):
        chars = len(arg) if isinstance(arg, str) else sum(len(m["content"]) for m in arg)
        if chars > chars_limit:
            held.append(chars)
            release.wait(60)
        return real(arg, *args, **kwargs)

    setattr(decoder, name, blocking)
    return held


@pytest.mark.parametrize("route", ["completion", "chat"])
def test_a_request_right_after_an_oversize_prompt_is_served(target_model, draft_model, route):
    """A prompt far too long for the context must not hold up the request after it: on a real model an 8 MB
    prompt was tokenized for 11.5 s on the one tokenizer thread, and the next request waited behind it. Here
    tokenizing such a text blocks until the test ends, as if it took forever."""
    decoder = make_decoder(target_model, draft_model, tiny_tokenizer())
    release = threading.Event()
    oversize_tokenized = block_tokenizing_above(decoder, route, PROMPT_LIMIT, release)
    text = "w1 " * 200_000  # 600,000 characters: 200,000 tokens, far over the 256-token context
    if route == "completion":
        path, big, small = COMPLETIONS, {"prompt": text}, {"prompt": "w1 w2", "max_tokens": 3}
    else:
        path = CHAT
        big = {"messages": [{"role": "user", "content": text}]}
        small = {"messages": [USER], "max_tokens": 3}

    async def oversize_then_normal(url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            oversize = asyncio.create_task(c.post(path, json=big))
            await asyncio.sleep(0.05)  # let it go first
            normal = await c.post(path, json=small)
            return await oversize, normal

    with LiveServer(create_app(decoder, served_model_name="tiny")) as live:
        try:
            oversize, normal = asyncio.run(oversize_then_normal(live.url))
        finally:
            release.set()
    assert normal.status_code == 200, normal.text
    assert oversize.status_code == 400 and oversize.json()["error"]["code"] == "context_length_exceeded"
    assert oversize_tokenized == []


# --------------------------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", [None, "application/json", "text/plain"])
def test_an_empty_body_says_so(client, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    error = assert_quick_error(*post(client, path, content=b"", headers=headers), 400)
    assert "body is empty" in error["message"] and "None" not in error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_is_415(client, path, content_type):
    """`curl -d` without `-H 'Content-Type: application/json'` sends form-urlencoded: the body itself is fine JSON."""
    body = b'{"prompt": "w1 w2", "max_tokens": 2}' if path == COMPLETIONS else \
        b'{"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}'
    headers = {"content-type": content_type} if content_type else {}
    error = assert_quick_error(*post(client, path, content=body, headers=headers), 415,
                               code="unsupported_media_type")
    assert "Content-Type: application/json" in error["message"]
    assert (content_type or "no Content-Type") in error["message"]
    served, _ = post(client, path, content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert served.status_code == 200, served.text


# --------------------------------------------------------------------------------------------- tool calling


# Tool fields this test model cannot honour, each refused naming the field: an empty list, a choice without tools,
# the deprecated function calling; tool_choice "none" and parallel_tool_calls alone change nothing.
TOOL_FIELDS = [("tools", [], None), ("tool_choice", "auto", None), ("tool_choice", "required", None),
               ("functions", [], "unsupported_parameter"), ("function_call", "none", "unsupported_parameter")]


@pytest.mark.parametrize("field,value,code", TOOL_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in TOOL_FIELDS])
def test_tool_calling_fields_without_what_they_need_are_refused(client, field, value, code):
    body = {"messages": [USER], "max_tokens": 2}
    error = assert_quick_error(*post(client, CHAT, {**body, field: value}), 400, field, code)
    assert "tool" in error["message"] or "function" in error["message"]
    served, _ = post(client, CHAT, {**body, field: None})  # null is the same as leaving the field out
    assert served.status_code == 200, served.text


@pytest.mark.parametrize("field,value", [("tool_choice", "none"), ("parallel_tool_calls", False)])
def test_tool_fields_that_change_nothing_here_are_served(client, field, value):
    served, _ = post(client, CHAT, {"messages": [USER], "max_tokens": 2, field: value})
    assert served.status_code == 200, served.text


@pytest.mark.parametrize("message", [{"role": "assistant", "content": None}, {"role": "user", "content": None},
                                     {"role": "assistant"}])
def test_a_message_without_text_content_is_refused(client, message):
    body = {"messages": [USER, message, USER], "max_tokens": 2}
    error = assert_quick_error(*post(client, CHAT, body), 400, "messages.1.content")
    assert "content" in error["message"]


# --------------------------------------------------------------------------------------------- body structure


def test_bodies_of_too_many_json_values_are_refused_unparsed(client, tokenized):
    """240k one-character messages (7 MiB) or 300k token ids fit the byte limit but would cost seconds and
    gigabytes to parse and validate: refused by their count (413) before any parser runs."""
    tokenized.clear()
    cap = client.app.state.specdec.limits.max_body_values
    bodies = [{"messages": [{"role": "user", "content": "x"}] * 240_000}, {"prompt": [1] * (cap + 1)}]
    for body in bodies:
        error = assert_quick_error(*post(client, COMPLETIONS if "prompt" in body else CHAT, body), 413,
                                   code="too_many_json_values")
        assert str(cap) in error["message"]
    assert tokenized == []
    # The count skips text: as many commas and brackets inside a string are not values, and the request is
    # refused for what it is (too long for the context), not for its structure.
    commas = {"prompt": "[a, {b}], " * (cap // 2), "max_tokens": 2}
    assert_quick_error(*post(client, COMPLETIONS, commas), 400, "prompt", "context_length_exceeded")


@pytest.mark.parametrize("route", ["completion", "chat"])
def test_long_prompts_being_tokenized_never_hold_up_a_short_one(target_model, draft_model, route):
    """Two long prompts within the bound (tokenized: they might fit) whose tokenizing never ends, and a short
    request after them: it is served meanwhile, since long prompts take turns on a lane of their own."""
    from specdec.server.app import SHORT_PROMPT_CHARS

    decoder = make_decoder(target_model, draft_model, tiny_tokenizer())
    release = threading.Event()
    held = block_tokenizing_above(decoder, route, SHORT_PROMPT_CHARS, release)
    text = "w1 " * (SHORT_PROMPT_CHARS // 3 + 10)
    assert SHORT_PROMPT_CHARS < len(text) <= PROMPT_LIMIT
    if route == "completion":
        path, long_body, small = COMPLETIONS, {"prompt": text}, {"prompt": "w1 w2", "max_tokens": 3}
    else:
        path, long_body = CHAT, {"messages": [{"role": "user", "content": text}]}
        small = {"messages": [USER], "max_tokens": 3}

    async def long_ones_then_short(url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            waiting = [asyncio.create_task(c.post(path, json=long_body)) for _ in range(2)]
            await asyncio.sleep(0.3)  # both are being tokenized, or waiting for the long lane
            short = await c.post(path, json=small)
            seen = list(held)
            release.set()
            return short, seen, await asyncio.gather(*waiting)

    with LiveServer(create_app(decoder, served_model_name="tiny")) as live:
        try:
            short, seen, _ = asyncio.run(long_ones_then_short(live.url))
        finally:
            release.set()
    assert short.status_code == 200, short.text
    assert len(seen) == 1  # one long prompt on its lane, the other waiting behind it, not in front of the short one
