"""Hostile request input: lone surrogates, coerced types, unknown roles, and the OpenAPI document against the
server's real answers (a bounded schemathesis run)."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
schemathesis = pytest.importorskip("schemathesis")

from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from specdec.backends.pytorch.backend import TransformersBackend
from specdec.decoder import SpecDecoder
from specdec.server import create_app
from specdec.server.errors import APIError, error_body
from specdec.server.schemas import lone_surrogate_path
from test_server import LiveServer, tiny_tokenizer

# A small context bounds every generation (chat's default max_tokens is the rest of the context), so
# the schemathesis run stays short whatever max_tokens it draws.
MAX_CONTEXT = 48
BAD = "\\ud800"  # JSON text for a lone UTF-16 surrogate (escaped: json.dumps would not write one raw)


@pytest.fixture(scope="module")
def app(target_model, draft_model):
    tokenizer = tiny_tokenizer()
    target = TransformersBackend(target_model, tokenizer, name="tiny-target", max_context=MAX_CONTEXT)
    draft = TransformersBackend(draft_model, tokenizer, name="tiny-draft", max_context=MAX_CONTEXT)
    return create_app(SpecDecoder(target, draft), served_model_name="tiny")


@pytest.fixture(scope="module")
def client(app):
    # raise_server_exceptions (the default): any exception inside the app fails the test, 500 or not.
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def live(app):
    with LiveServer(app) as server:
        yield server


def post_raw(client, path: str, text: str):
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def assert_openai_error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


OK_COMPLETION = '{"prompt": "w1 w2", "max_tokens": 2, "temperature": 0}'

# --------------------------------------------------------------------------------------------- surrogates

SURROGATE_BODIES = [
    ("/v1/completions", f'{{"prompt": "w1 {BAD}", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["w1 {BAD}"], "max_tokens": 2}}', "prompt.0"),
    ("/v1/completions", f'{{"prompt": "w1", "model": "{BAD}", "max_tokens": 2}}', "model"),
    ("/v1/completions", f'{{"prompt": "w1", "stop": ["w2", "x{BAD}"], "max_tokens": 2}}', "stop.1"),
    ("/v1/completions", f'{{"prompt": "w1", "user": "{BAD}", "max_tokens": 2}}', "user"),
    ("/v1/completions", f'{{"prompt": "w1", "metadata": {{"k": "{BAD}"}}, "max_tokens": 2}}', "metadata.k"),
    ("/v1/completions", f'{{"prompt": "w1", "metadata": {{"{BAD}": "v"}}, "max_tokens": 2}}', "metadata"),
    ("/v1/completions", f'{{"prompt": "w1", "{BAD}": 1}}', None),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{BAD}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions", f'{{"model": "{BAD}", "messages": [{{"role": "user", "content": "w1"}}]}}', "model"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "w1", "name": "{BAD}"}}]}}',
     "messages.0.name"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{BAD}"}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "{BAD}", "content": "w1"}}]}}', "messages.0.role"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_BODIES, ids=[f"{i}-{p}" for i, (_, _, p) in
                                                                   enumerate(SURROGATE_BODIES)])
def test_lone_surrogate_is_a_400_and_the_client_keeps_working(client, path, body, param):
    assert json.loads(body)  # valid JSON: the surrogate is a legal \u escape, only not valid Unicode
    error = assert_openai_error(post_raw(client, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]
    json.dumps(error).encode("utf-8")  # the answer itself is clean UTF-8
    assert post_raw(client, "/v1/completions", OK_COMPLETION).status_code == 200


def test_lone_surrogate_keeps_the_keep_alive_connection(live):
    """uvicorn closes a connection whose app raised; the next request on the same socket must still work."""
    bad = f'{{"prompt": "w1", "model": "{BAD}", "max_tokens": 2}}'.encode()
    good = OK_COMPLETION.encode()
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        reader = sock.makefile("rb")
        statuses = []
        for body in (bad, good, f'{{"prompt": "{BAD}"}}'.encode(), good):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            statuses.append(_read_response(reader))
    assert [status for status, _ in statuses] == [400, 200, 400, 200]
    assert all(b"connection: close" not in headers.lower() for _, headers in statuses)


def _read_response(reader) -> tuple[int, bytes]:
    status_line = reader.readline()
    assert status_line, "the server closed the connection"
    headers, length = b"", 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        headers += line
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)
    return int(status_line.split()[1]), headers


def test_error_bodies_echoing_user_text_always_encode():
    error = APIError(404, "The model `\ud800` does not exist", param="x\udfff", code="model_not_found")
    rendered = JSONResponse(error.body(), status_code=404).body  # raised UnicodeEncodeError before
    assert json.loads(rendered)["error"]["message"] == "The model `\\ud800` does not exist"
    assert error_body("fine \u00e9", "t")["error"]["message"] == "fine \u00e9"  # valid text is untouched


def test_lone_surrogate_path_finds_strings_and_keys_at_any_depth():
    assert lone_surrogate_path({"a": [1, "ok", {"b": "\ud800"}]}) == "a.2.b"
    assert lone_surrogate_path({"a": {"\udc00": 1}}) == "a"
    assert lone_surrogate_path(json.loads('{"a": "\\ud83d\\ude00 \\u00e9"}')) is None  # JSON joins a pair
    deep: list = ["\ud800"]
    for _ in range(5000):  # deeper than the recursion limit
        deep = [deep]
    assert lone_surrogate_path(deep).count(".") == 5000


# --------------------------------------------------------------------------------------------- strict types

COERCED = [
    ({"prompt": "w1", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "w1", "max_tokens": 3.0}, "max_tokens"),
    ({"prompt": "w1", "max_tokens": True}, "max_tokens"),
    ({"prompt": "w1", "stream": "yes"}, "stream"),
    ({"prompt": "w1", "stream": 1}, "stream"),
    ({"prompt": [True, False]}, "prompt.0"),
    ({"prompt": [[1, True]]}, "prompt.0.1"),
    ({"prompt": [1.0, 2.0]}, "prompt.0"),
    ({"prompt": "w1", "temperature": "0.5"}, "temperature"),
    ({"prompt": "w1", "temperature": False}, "temperature"),
    ({"prompt": "w1", "top_p": "1"}, "top_p"),
    ({"prompt": "w1", "seed": "7"}, "seed"),
    ({"prompt": "w1", "n": "1"}, "n"),
    ({"prompt": "w1", "ignore_eos": "true"}, "ignore_eos"),
    ({"prompt": "w1", "stop": 5}, "stop"),
    ({"prompt": "w1", "stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"prompt": 42}, "prompt"),
]


@pytest.mark.parametrize("body,param", COERCED, ids=[f"{i}-{p}" for i, (_, p) in enumerate(COERCED)])
def test_values_of_the_wrong_json_type_are_refused(client, body, param):
    assert_openai_error(client.post("/v1/completions", json=body), 400, param)


def test_chat_values_of_the_wrong_json_type_are_refused(client):
    message = {"role": "user", "content": "w1"}
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": [message], "max_completion_tokens": "2"}),
                        400, "max_completion_tokens")
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}),
                        400, "messages.0.content")
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": [message], "logprobs": 0}),
                        400, "logprobs")


VALID = [
    ("/v1/completions", {"prompt": "w1 w2", "temperature": 1, "top_p": 1, "max_tokens": 2, "seed": 3}),
    ("/v1/completions", {"prompt": "w1 w2", "temperature": 0.0, "top_p": 0.9, "min_p": 0, "top_k": -1,
                         "max_tokens": 2}),
    ("/v1/completions", {"prompt": [1, 10, 11], "max_tokens": 2, "stop": "w5", "n": 1, "ignore_eos": False}),
    ("/v1/completions", {"prompt": ["w1 w2"], "max_tokens": 2, "stop": ["w5", "w6"], "stream": False}),
    ("/v1/completions", {"prompt": [[1, 10, 11]], "max_tokens": 2, "presence_penalty": 0, "logit_bias": {}}),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "w1"}, {"role": "developer", "content": "w2"},
        {"role": "user", "content": [{"type": "text", "text": "w3"}], "name": "w4"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "w5"}],
        "max_tokens": 2, "temperature": 1, "tools": None, "response_format": {"type": "text"}}),
]


@pytest.mark.parametrize("path,body", VALID, ids=[str(i) for i in range(len(VALID))])
def test_valid_openai_inputs_are_still_served(client, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text


# --------------------------------------------------------------------------------------------- roles, emptiness


def test_unknown_roles_and_tool_messages_are_refused(client):
    def chat(*messages):
        return client.post("/v1/chat/completions", json={"messages": list(messages), "max_tokens": 2})

    user = {"role": "user", "content": "w1"}
    error = assert_openai_error(chat(user, {"role": "wizard", "content": "w2"}), 400, "messages.1.role")
    assert "'system', 'developer', 'user', 'assistant' or 'tool'" in error["message"]
    assert_openai_error(chat({"role": None, "content": "w1"}), 400, "messages.0.role")
    assert_openai_error(chat({"content": "w1"}), 400, "messages.0.role")
    # A tool message must answer an earlier assistant call; the legacy function role is refused, naming tools.
    for message in ({"role": "tool", "content": "w2"}, {"role": "tool", "content": "w2", "tool_call_id": "c1"}):
        error = assert_openai_error(chat(user, message), 400, "messages.1.tool_call_id")
    error = assert_openai_error(chat(user, {"role": "function", "content": "w2", "name": "f"}), 400,
                                "messages.1.role", "unsupported_parameter")
    assert "tool messages" in error["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert_openai_error(chat(user, {"role": "user", "content": "w1", "tool_calls": [call]}), 400,
                        "messages.1.tool_calls")
    assert_openai_error(chat(user, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "f", "arguments": "[1]"}}]}), 400, "messages.1.tool_calls.0.function.arguments")
    # Null content goes only with tool calls.
    error = assert_openai_error(chat({"role": "assistant", "content": None, "tool_calls": []}), 400,
                                "messages.0.content")
    assert "tool_calls" in error["message"]


@pytest.mark.parametrize("prompt,param", [("", "prompt"), ([], "prompt"), ([""], "prompt.0"), ([[]], "prompt.0"),
                                          ([-1], "prompt.0")])
def test_empty_prompts_are_refused_by_validation(client, prompt, param):
    assert_openai_error(client.post("/v1/completions", json={"prompt": prompt}), 400, param)


def test_unknown_field_names_are_named_whatever_their_characters(client):
    error = assert_openai_error(client.post("/v1/completions", json={"prompt": "w1", "top-k[0]": 1}), 400,
                                "top-k[0]", "unsupported_parameter")
    assert error["message"] == "Unrecognized request argument supplied: top-k[0]"


# --------------------------------------------------------------------------------------------- OpenAPI


def test_openapi_declares_what_the_server_answers(client):
    doc = client.get("/openapi.json").json()
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"] == error_ref
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"4XX", "5XX"} <= set(responses)
    assert doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]["404"]["content"]["application/json"][
        "schema"] == error_ref
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")

    schemas = doc["components"]["schemas"]
    prompt_choices = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt_choices[0] == {"type": "string", "minLength": 1}
    assert all(choice["minItems"] == 1 for choice in prompt_choices[1:])
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}


# --------------------------------------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(live.url + "/openapi.json")


# (method, path, whether it has input that can violate the schema: a string path parameter cannot);
# schemathesis's own pytest integration
# (`schema.parametrize`, `from_fixture`) fails on pytest 9 (it reads the removed Node._nodeid), so each
# operation is driven here with its hypothesis strategy directly.
OPERATIONS = [("GET", "/health", False), ("GET", "/metrics", False), ("GET", "/v1/models", False),
              ("GET", "/v1/models/{model_id}", False), ("POST", "/v1/completions", True),
              ("POST", "/v1/chat/completions", True), ("POST", "/infill", True)]
RUNS = [(method, path, mode) for method, path, has_input in OPERATIONS
        for mode in (["positive", "negative"] if has_input else ["positive"])]


def test_every_operation_is_fuzzed(client):
    documented = {(method.upper(), path) for path, ops in client.get("/openapi.json").json()["paths"].items()
                  for method in ops}
    assert documented == {(method, path) for method, path, _ in OPERATIONS}


@pytest.mark.parametrize("method,path,mode", RUNS, ids=[f"{m} {p} {mode}" for m, p, mode in RUNS])
def test_openapi_conformance(api_schema, method, path, mode):
    """Every answer is a declared status, content type and body shape, and none is a server error: for
    30 schema-valid requests per operation (positive) and 30 schema-violating ones (negative).

    Streaming (`stream: true`) is drawn like any other value: the whole event stream is read (the small
    context bounds every generation), its content type is checked against the declared
    text/event-stream, and its body is not schema-checked (it is events, not one JSON document)."""
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=30, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                       response_schema_conformance], timeout=60)

    check()
