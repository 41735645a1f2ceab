"""/infill (llama-server's) and /v1/completions with a suffix, on a tiny GGUF with FIM tokens: the answer equals plain
greedy decoding of a prompt laid out by hand, streamed and not; special-token text is parsed only in a raw completion
prompt; llama-server's stops and fields; bad input refused with a 4xx before any work."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")

import httpx
from fastapi.testclient import TestClient

from specdec.config import ModelRef, SamplingParams, SpecConfig
from specdec.decoder import SpecDecoder
from specdec.server import create_app, sse
from specdec.server.infill_reply import InfillStops, indent_cut, select_fields, time_limit_cut
from test_server import LiveServer

PREFIX = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a"
SUFFIX = "\n\ndef mul(a, b):\n    return a * b\n"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("infill")
    return {"fim": write_tiny_gguf(root / "fim.gguf", seed=0, fim=True, context=1024),
            "plain": write_tiny_gguf(root / "plain.gguf", seed=0, context=1024)}


@pytest.fixture(scope="module")
def decoder(ggufs):
    ref = ModelRef(target=str(ggufs["fim"]), draft=None, max_context=1024, threads=1, parallel=2)
    return SpecDecoder.load(ref, SpecConfig(drafter="suffix", k_policy="fixed", num_speculative_tokens=4))


@pytest.fixture(scope="module")
def client(decoder):
    with TestClient(create_app(decoder, served_model_name="tiny-fim")) as c:
        yield c


def by_hand(decoder, prefix: str, suffix: str, prompt: str = "", files=()) -> list[int]:
    """llama-server's layout written out from its source, token by token, independently of specdec.fim."""
    from tiny_gguf import FIM_IDS

    text = decoder.encode_text
    ids = [FIM_IDS["<|repo_name|>"], *text("myproject\n")]
    for name, body in files:
        ids += [FIM_IDS["<|file_sep|>"], *text(name + "\n"), *text(body)]
    ids += [FIM_IDS["<|file_sep|>"], *text("filename\n")]
    return ids + [FIM_IDS["<|fim_prefix|>"], *text(prefix), *text(prompt), FIM_IDS["<|fim_suffix|>"], *text(suffix),
                  FIM_IDS["<|fim_middle|>"]]


def plain_greedy(decoder, ids: list[int], n: int) -> str:
    return decoder.generate(ids, SamplingParams(temperature=0, max_tokens=n), SpecConfig(drafter="none")).text


def sse_events(response) -> list:
    return list(sse.parse(response.text.splitlines()))


# --------------------------------------------------------------------------------------------- /infill


def test_infill_equals_plain_greedy_of_llama_servers_layout(client, decoder):
    files = [("util.py", "def helper():\n    return 1\n")]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": " -", "n_predict": 24, **GREEDY,
            "input_extra": [{"filename": n, "text": t, "time": 123} for n, t in files]}
    response = client.post("/infill", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    ids = by_hand(decoder, PREFIX, SUFFIX, " -", files)
    assert out["content"] == plain_greedy(decoder, ids, 24)
    assert out["tokens_evaluated"] == len(ids) and out["stop"] is True and out["truncated"] is False
    assert out["stop_type"] in ("eos", "limit") and out["tokens_predicted"] <= 24
    assert out["tokens_cached"] == len(ids) + out["tokens_predicted"]
    timings = out["timings"]
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "cache_n"} <= set(timings)
    assert timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert out["generation_settings"]["n_ctx"] == 1024 and out["model"] == "tiny-fim"


def test_infill_penalties_follow_the_samplers_chain_and_match_plain_decoding(client, decoder):
    ids = by_hand(decoder, PREFIX, SUFFIX)
    free = decoder.generate(ids, SamplingParams(temperature=0, max_tokens=16), SpecConfig(drafter="none"))
    options = {"repeat_penalty": 1.5, "repeat_last_n": 16, "frequency_penalty": 0.9,
               "logit_bias": [[free.tokens[0], False]]}
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16, **GREEDY, **options}
    out = client.post("/infill", json=body).json()
    expected = decoder.generate(ids, SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                                                    repeat_last_n=16, frequency_penalty=0.9,
                                                    logit_bias={free.tokens[0]: float("-inf")}),
                                SpecConfig(drafter="none"))
    assert out["content"] == expected.text != free.text
    # Without "penalties" in the chain only logit_bias applies, as in llama-server.
    chain = [s for s in GREEDY.get("samplers", ["top_k", "temperature"]) if s != "penalties"]
    out = client.post("/infill", json={**body, "samplers": chain}).json()
    only_bias = decoder.generate(ids, SamplingParams(temperature=0, max_tokens=16,
                                                     logit_bias={free.tokens[0]: float("-inf")}),
                                 SpecConfig(drafter="none"))
    assert out["content"] == only_bias.text


def test_infill_streams_llama_servers_events_without_done(client, decoder):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 20, "stream": True, **GREEDY}
    with client.stream("POST", "/infill", json=body) as response:
        assert response.status_code == 200
        raw = response.read().decode()
    assert "[DONE]" not in raw
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    *deltas, final = events
    assert all(e["stop"] is False for e in deltas) and final["stop"] is True and final["content"] == ""
    text = "".join(e["content"] for e in deltas)
    assert text == plain_greedy(decoder, by_hand(decoder, PREFIX, SUFFIX), 20)
    assert final["tokens_predicted"] == sum(len(e["tokens"]) for e in deltas)


def test_successive_keystrokes_reuse_the_prefix(client, decoder):
    first = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, **GREEDY})
    second = client.post("/infill", json={"input_prefix": PREFIX, "prompt": " b", "input_suffix": SUFFIX,
                                          "n_predict": 4, **GREEDY})
    assert first.status_code == second.status_code == 200
    before, after = by_hand(decoder, PREFIX, SUFFIX), by_hand(decoder, PREFIX, SUFFIX, " b")
    common = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    timings = second.json()["timings"]
    # every token up to the keystroke came from the slot the first request left; the suffix after it is new
    assert timings["cache_n"] == common and timings["prompt_n"] == len(after) - common


def test_n_predict_zero_only_caches_and_n_cmpl_answers_an_array(client):
    warm = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "n_predict": 0, "samplers": [],
                                        "input_extra": [{"filename": "x.py", "text": "import os\n"}]})
    assert warm.status_code == 200 and warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    many = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "n_cmpl": 3,
                                        "seed": 5, "samplers": ["top_k", "top_p", "infill"]})
    assert many.status_code == 200 and isinstance(many.json(), list) and len(many.json()) == 3
    assert [b["index"] for b in many.json()] == [0, 1, 2]
    settings = many.json()[0]["generation_settings"]
    # llama-server's chain: no "temperature" in the list means sampling at 1; "infill" is reported as not applied
    assert settings["temperature"] == 1.0 and settings["samplers_not_applied"] == ["infill"]


def test_response_fields_are_flat_paths(client):
    out = client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3, **GREEDY,
                                       "response_fields": ["content", "timings/prompt_n", "truncated", "nope/x"]})
    assert set(out.json()) == {"content", "timings/prompt_n", "truncated"}


def test_a_client_that_goes_away_frees_its_slot(decoder):
    app = create_app(decoder, served_model_name="tiny-fim")
    state = app.state.specdec
    with LiveServer(app) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 400, "stream": True,
                    "ignore_eos": True, **GREEDY}
            with http.stream("POST", "/infill", json=body) as response:
                next(response.iter_lines())  # the first event is out: the job runs
            deadline = time.monotonic() + 10
            while state.worker.running_jobs and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not state.worker.running_jobs
            after = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 2,
                                               **GREEDY})
            assert after.status_code == 200


# --------------------------------------------------------------------------------------------- /v1/completions


def test_completions_with_a_suffix_are_fim(client, decoder):
    response = client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16, **GREEDY})
    assert response.status_code == 200, response.text
    ids = by_hand(decoder, PREFIX, SUFFIX)
    assert response.json()["choices"][0]["text"] == plain_greedy(decoder, ids, 16)
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    streamed = client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16,
                                                    "stream": True, **GREEDY})
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"  # OpenAI's framing on this endpoint
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == response.json()["choices"][0]["text"]


def test_special_token_text_is_parsed_in_a_raw_completion_prompt_only(client, decoder):
    from tiny_gguf import FIM_IDS

    raw = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    as_tokens = [FIM_IDS["<|fim_prefix|>"], *decoder.encode_text(PREFIX), FIM_IDS["<|fim_suffix|>"],
                 *decoder.encode_text(SUFFIX), FIM_IDS["<|fim_middle|>"]]
    response = client.post("/v1/completions", json={"prompt": raw, "max_tokens": 12, **GREEDY})
    assert response.json()["usage"]["prompt_tokens"] == len(as_tokens)
    assert response.json()["choices"][0]["text"] == plain_greedy(decoder, as_tokens, 12)
    # in /infill's text fields and in a chat message the same characters stay characters
    assert decoder.encode_infill(raw, "").ids.count(FIM_IDS["<|fim_prefix|>"]) == 1  # the layout's own only
    chat = decoder.encode_chat([{"role": "user", "content": raw}])
    assert not set(FIM_IDS.values()) & set(chat)
    assert decoder.tokenizer.decode(chat).count("<|fim_prefix|>") == 1  # the text is all there
    ordinary = decoder.encode_chat([{"role": "user", "content": "hello"}])  # the template's own specials stay
    assert ordinary == decoder.tokenizer(decoder.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": SUFFIX}, "input_prefix"),
    ({"input_prefix": PREFIX}, "input_suffix"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{}]}, None),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": "ok"}]}, None),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": 123, "text": "abc"}]}, None),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"text": 456}]}, None),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": "abc"}, None),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": 5}, "prompt"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_cmpl": 9}, "n_cmpl"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "samplers": ["mirostat"]}, "samplers"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "repeat_penalty": 0}, "repeat_penalty"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "presence_penalty": 9}, "presence_penalty"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "logit_bias": [[1, 200]]}, "logit_bias"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "logit_bias": {"1": False, "01": 2}}, "logit_bias"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "typical_p": 0.5}, "typical_p"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": -2}, "n_predict"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_cmpl": 2, "stream": True}, "n_cmpl"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "bogus": 1}, "bogus"),
])
def test_bad_infill_requests_get_a_clear_400(client, body, param):
    response = client.post("/infill", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_input_too_large_is_refused_before_tokenizing(client):
    limit_chars = 128 * 1024
    began = time.perf_counter()
    response = client.post("/infill", json={"input_prefix": "x", "input_suffix": "y" * (limit_chars + 1)})
    assert response.status_code == 400 and time.perf_counter() - began < 0.5
    assert response.json()["error"]["code"] == "context_length_exceeded"
    many = [{"filename": "f.py", "text": "a"}] * 257
    assert client.post("/infill", json={"input_prefix": "", "input_suffix": "", "input_extra": many}).status_code == 400
    big = [{"filename": "f.py", "text": "z" * 70_000}, {"filename": "g.py", "text": "z" * 70_000}]
    response = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "input_extra": big})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_extra"


def test_a_model_without_fim_tokens_gets_a_400_not_a_plain_completion(ggufs):
    decoder = SpecDecoder.load(ModelRef(target=str(ggufs["plain"]), draft=None, max_context=256, threads=1))
    with TestClient(create_app(decoder)) as plain:
        for path, body in (("/infill", {"input_prefix": "a", "input_suffix": "b"}),
                           ("/v1/completions", {"prompt": "a", "suffix": "b"})):
            response = plain.post(path, json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "fim_not_supported"
            assert "prefix token is missing" in response.json()["error"]["message"]
        assert plain.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_a_suffix_needs_a_text_prompt(client):
    response = client.post("/v1/completions", json={"prompt": [1, 2, 3], "suffix": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


# --------------------------------------------------------------------------------------------- llama-server's stops


def test_indent_rule_cuts_the_first_shallower_line_after_a_newline():
    assert indent_cut("x = 1\n    y = 2\n  z", 4) == len("x = 1\n    y = 2\n  ")
    assert indent_cut("x = 1\n    y = 2\n   ", 4) is None  # that line has no text yet
    assert indent_cut("x\n\n    y", 4) is None  # blank lines do not count
    assert indent_cut("no newline", 8) is None and indent_cut("a\nb", 0) is None


def test_time_limit_ends_at_the_next_newline_once_over():
    assert time_limit_cut("ab\ncd\nef", 4, elapsed_ms=600, limit_ms=500) == 6
    assert time_limit_cut("ab\ncd", 4, elapsed_ms=600, limit_ms=500) is None
    assert time_limit_cut("ab\ncd\n", 0, elapsed_ms=400, limit_ms=500) is None
    clock = iter([0.0, 0.2, 0.7]).__next__
    stops = InfillStops(0, 500, clock=clock)
    assert [stops.feed("a\n"), stops.feed("b\n"), stops.feed("c\nd\n")] == ["a\n", "b\n", "c\n"]
    assert stops.stopped and stops.feed("more") == ""


def test_select_fields():
    body = {"content": "x", "timings": {"prompt_n": 3}}
    assert select_fields(body, ["timings/prompt_n", "content", "timings/none"]) == {"timings/prompt_n": 3,
                                                                                   "content": "x"}
