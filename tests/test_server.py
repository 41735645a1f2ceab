"""The OpenAI-compatible server against a live uvicorn on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from specdec.backends.pytorch.backend import TransformersBackend  # noqa: E402
from specdec.config import SamplingParams  # noqa: E402
from specdec.decoder import SpecDecoder  # noqa: E402
from specdec.server import create_app, sse

MAX_CONTEXT = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer over the tiny models' 97-token vocabulary (EOS = 3 = '</s>')."""
    words = ["[PAD]", "<s>", "[UNK]", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    words += [f"w{i}" for i in range(97 - len(words))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


class SlowBackend(TransformersBackend):
    """A backend that takes a fixed extra time per forward: every engine step costs >= (k + 1) * delay,
    so a long generation is reliably still running when its client leaves."""

    delay = 0.02

    def forward(self, tokens, cache, num_logits=1):
        time.sleep(self.delay)
        return super().forward(tokens, cache, num_logits)


class LiveServer:
    """uvicorn (or a subclass such as GracefulServer) for `app` on 127.0.0.1 and a free port, in a thread."""

    def __init__(self, app, server_cls=uvicorn.Server, http="h11", **server_kwargs):
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http=http,
                                timeout_graceful_shutdown=5)
        self.server = server_cls(config, **server_kwargs)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models are fastest on one thread, and the worker shares 2 cores with uvicorn and the clients."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def make_decoder(target_model, draft_model, tokenizer, backend_cls=TransformersBackend) -> SpecDecoder:
    target = backend_cls(target_model, tokenizer, name="tiny-target", max_context=MAX_CONTEXT)
    draft = backend_cls(draft_model, tokenizer, name="tiny-draft", max_context=MAX_CONTEXT)
    return SpecDecoder(target, draft)


@pytest.fixture(scope="module")
def reference(target_model, draft_model, tokenizer):
    """A separate decoder (own caches) for expected outputs: plain decoding of the same target."""
    decoder = make_decoder(target_model, draft_model, tokenizer)

    def run(prompt_ids, **params):
        return decoder.plain_engine().generate(prompt_ids, SamplingParams(**params))

    run.decoder = decoder
    return run


@pytest.fixture(scope="module")
def live(target_model, draft_model, tokenizer):
    app = create_app(make_decoder(target_model, draft_model, tokenizer), served_model_name="tiny")
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def metric_values(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels without model_name): value} from a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


PROMPT = "w1 w2 w3 w4"


# --------------------------------------------------------------------------------------------- basics


def test_health_and_models(http):
    assert http.get("/health").status_code == 200
    models_ = http.get("/v1/models").json()
    assert models_["object"] == "list"
    assert [m["id"] for m in models_["data"]] == ["tiny"]
    assert models_["data"][0]["max_model_len"] == MAX_CONTEXT
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/other").status_code == 404


def test_completion_matches_plain_greedy_and_reports_specdec_stats(client, reference, tokenizer):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    expected = reference(tokenizer(PROMPT)["input_ids"], max_tokens=20, temperature=0)
    choice = out.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.usage.prompt_tokens == 4
    assert out.usage.completion_tokens == len(expected.tokens)
    assert out.usage.total_tokens == 4 + len(expected.tokens)
    # Speculative statistics live in our extension field, not in OpenAI's prediction-token fields.
    stats = out.model_extra["specdec"]
    assert stats["drafter"] == "draft_model" and stats["num_speculative_tokens"] == 5
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert 0 <= stats["acceptance_rate"] <= 1
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"],
                                                            abs=1e-3)
    assert stats["num_generated_tokens"] == len(expected.tokens)
    assert stats["tokens_per_second"] > 0
    details = out.usage.completion_tokens_details
    assert details is None or (details.accepted_prediction_tokens in (None, 0)
                               and details.rejected_prediction_tokens in (None, 0))


def test_penalties_and_logit_bias_match_plain_decoding_with_the_same_options(client, reference, tokenizer):
    """Every penalty option through the openai SDK equals the library's plain decoding with the same options, and
    the options really change the text (a wrong mapping would be caught either way)."""
    ids = tokenizer(PROMPT)["input_ids"]
    plain = reference(ids, max_tokens=20, temperature=0)
    banned = plain.tokens[0]
    options = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias={str(banned): -100})
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"repetition_penalty": 1.3, "repeat_last_n": 8}, **options)
    expected = reference(ids, max_tokens=20, temperature=0, presence_penalty=0.7, frequency_penalty=0.4,
                         logit_bias={banned: -100.0}, repetition_penalty=1.3, repeat_last_n=8)
    assert out.choices[0].text == expected.text != plain.text
    assert banned not in expected.tokens
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=12, temperature=0, frequency_penalty=1.5)
    chat_ids = reference.decoder.encode_chat([{"role": "user", "content": PROMPT}])
    assert chat.choices[0].message.content == reference(chat_ids, max_tokens=12, temperature=0,
                                                        frequency_penalty=1.5).text


def test_completion_streaming_equals_non_streaming(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # include_usage: a last chunk with empty choices carries usage (and our stats); others carry usage=None.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].model_extra["specdec"]["num_drafts"] > 0
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing(http):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: {") and "\n" not in event
    payloads = list(sse.parse(raw.splitlines()))
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["choices"][0]["finish_reason"] == "length" and "specdec" in payloads[-2]


def test_chat_non_streaming_and_streaming(client, reference):
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=15, temperature=0)
    prompt_ids = reference.decoder.encode_chat(messages)
    expected = reference(prompt_ids, max_tokens=15, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.model_extra["specdec"]["num_generated_tokens"] == len(expected.tokens)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].object == "chat.completion.chunk" and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_max_tokens_length_and_max_completion_tokens_precedence(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=50,
                                         max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_stop_strings_string_and_list(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = full.split()
    assert len(words) > 4
    stop_word = words[3]
    for stop in (stop_word, ["w-never", stop_word]):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].text == full[:full.index(stop_word)]
        assert stop_word not in out.choices[0].text
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop_word,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop_word)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_parameters_and_seed_reproducibility(client, reference, tokenizer):
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95,
              "seed": 1234, "extra_body": {"top_k": 40}}
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    c = client.completions.create(**{**kwargs, "seed": 99}).choices[0].text
    d = client.completions.create(**{**kwargs, "seed": 99}).choices[0].text
    assert c == d
    # Sampled output is a sample of the target distribution; with temperature -> tiny it is greedy.
    cold = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1e-6, seed=5)
    assert cold.choices[0].text == reference(tokenizer(PROMPT)["input_ids"], max_tokens=12, temperature=0).text


def test_token_id_prompt(client, reference):
    out = client.completions.create(model="tiny", prompt=[1, 10, 11, 12], max_tokens=8, temperature=0)
    assert out.choices[0].text == reference([1, 10, 11, 12], max_tokens=8, temperature=0).text
    assert out.usage.prompt_tokens == 4


def test_metrics_exposition(http, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.8, seed=3)
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    values = metric_values(text)
    # vLLM's spec-decode counter names, with _total appended on exposition.
    drafts = values[("specdec:spec_decode_num_drafts_total", ())]
    draft_tokens = values[("specdec:spec_decode_num_draft_tokens_total", ())]
    accepted = values[("specdec:spec_decode_num_accepted_tokens_total", ())]
    per_pos = [values[("specdec:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
               for i in range(5)]
    assert drafts > 0 and draft_tokens >= drafts and accepted <= draft_tokens
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position i needs i-1 accepted
    assert values[("specdec:time_to_first_token_seconds_count", ())] > 0
    assert values[("specdec:inter_token_latency_seconds_count", ())] > 0
    assert values[("specdec:e2e_request_latency_seconds_count", ())] > 0
    assert values[("specdec:request_success_total", (("finished_reason", "length"),))] > 0
    assert values[("specdec:generation_tokens_total", ())] > 0
    assert values[("specdec:prompt_tokens_total", ())] > 0
    assert values[("specdec:num_requests_running", ())] == 0
    assert 'model_name="tiny"' in text and "_created" not in text


def test_prefix_reuse_is_reported_as_cached_tokens(http, client, reference):
    """A follow-up request shares the first one's prompt and output: usage.prompt_tokens_details.cached_tokens
    says how much of it the KV cache held, /metrics counts it as prefix cache hits, and the output is
    still plain greedy decoding's."""
    first_prompt = [1] + [(i * 11 + 7) % 90 for i in range(24)]
    first = client.completions.create(model="tiny", prompt=first_prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details is not None
    before = metric_values(http.get("/metrics").text)
    generated = reference(first_prompt, max_tokens=6, temperature=0, ignore_eos=True).tokens
    follow_up = first_prompt + generated + [40, 41]
    chunks = list(client.completions.create(model="tiny", prompt=follow_up, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == len(first_prompt) + len(generated) - 1  # everything the cache held was shared
    assert chunks[-1].model_extra["specdec"]["num_cached_prompt_tokens"] == cached
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(follow_up, max_tokens=6, temperature=0).text
    after = metric_values(http.get("/metrics").text)
    hits, queries = "specdec:prefix_cache_hits_total", "specdec:prefix_cache_queries_total"
    assert after[(hits, ())] - before[(hits, ())] == cached
    assert after[(queries, ())] - before[(queries, ())] == len(follow_up)
    # A prompt sharing nothing: nothing cached (the field is still there, as OpenAI sends it).
    out = client.completions.create(model="tiny", prompt=[2, 50, 51], max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


# --------------------------------------------------------------------------------------------- errors


def _assert_openai_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


LONG_PROMPT = " ".join(["w7"] * (MAX_CONTEXT + 10))

BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, 400, "temperature", None),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": PROMPT, "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "suffix": "x"}, 400, "echo", None),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": -3}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"w1": 3}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999": 1}}, 400, None, None),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 1.1, "repeat_penalty": 1.2}, 400,
     "repetition_penalty", None),
    ("/v1/completions", {"prompt": PROMPT, "repeat_last_n": -2}, 400, "repeat_last_n", None),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, 400, "prompt", "unsupported_parameter"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_CONTEXT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                              "top_logprobs": -1}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "n": 3}, 400, "n", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]},
     400, "tools.0.function", None),
    # This test model's chat template renders no tools: a well-formed tool is refused, naming the reason.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_parameter"),
    # The tiny word-level tokenizer has no byte-level decoder, which the grammar engine needs: a clear 400.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format",
     "invalid_json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                              "response_format": {"type": "yaml"}}, 400, "response_format.type", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{i}-{param or 'body'}" for i, (_, _, _, param, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(http, path, body, status, param, code):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    _assert_openai_error(response, status, param, code)


def test_errors_reach_the_openai_client_and_server_keeps_serving(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=LONG_PROMPT, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"
    _assert_openai_error(http.get("/v1/nothing"), 404)
    _assert_openai_error(http.get("/v1/completions"), 405)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    values = metric_values(http.get("/metrics").text)
    assert values[("specdec:request_errors_total", (("status", "400"),))] >= 2


# --------------------------------------------------------------------------------------------- concurrency


def _request(i: int) -> dict:
    """Twenty different requests: chat or completion, greedy or seeded sampling, various lengths."""
    prompt = " ".join(f"w{(i * 7 + j) % 80}" for j in range(3 + i % 4))
    kind = "chat" if i % 2 else "completion"
    params = {"max_tokens": 10 + i % 7, "temperature": 0.0 if i % 3 == 0 else 0.8, "seed": 1000 + i}
    return {"kind": kind, "prompt": prompt, **params}


async def _run_async(aclient, spec: dict, stream: bool) -> tuple[str, str | None, int]:
    common = {"model": "tiny", "max_tokens": spec["max_tokens"], "temperature": spec["temperature"],
              "seed": spec["seed"]}
    if spec["kind"] == "chat":
        messages = [{"role": "user", "content": spec["prompt"]}]
        if not stream:
            out = await aclient.chat.completions.create(messages=messages, **common)
            return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens
        pieces, finish, used, ids = [], None, None, set()
        async for chunk in await aclient.chat.completions.create(messages=messages, stream=True,
                                                                 stream_options={"include_usage": True}, **common):
            ids.add(chunk.id)
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        assert len(ids) == 1
        return "".join(pieces), finish, used
    if not stream:
        out = await aclient.completions.create(prompt=spec["prompt"], **common)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    pieces, finish, used, ids = [], None, None, set()
    async for chunk in await aclient.completions.create(prompt=spec["prompt"], stream=True,
                                                        stream_options={"include_usage": True}, **common):
        ids.add(chunk.id)
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            used = chunk.usage.completion_tokens
    assert len(ids) == 1
    return "".join(pieces), finish, used


def test_twenty_concurrent_streams_equal_solo_requests(live):
    specs = [_request(i) for i in range(20)]

    async def main():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            solo = [await _run_async(aclient, spec, stream=False) for spec in specs]
            tasks = [asyncio.create_task(_run_async(aclient, spec, stream=True)) for spec in specs]
            # The event loop stays responsive while the engine works through the queue.
            waiting, health_seconds = 0.0, []
            async with httpx.AsyncClient(base_url=live.url) as h:
                while not all(task.done() for task in tasks):
                    began = time.perf_counter()
                    health = await h.get("/health")
                    health_seconds.append(time.perf_counter() - began)
                    assert health.status_code == 200
                    metrics = metric_values((await h.get("/metrics")).text)
                    waiting = max(waiting, metrics[("specdec:num_requests_waiting", ())])
                    await asyncio.sleep(0.05)
            together = await asyncio.gather(*tasks)
            return solo, together, health_seconds, waiting

    solo, together, health_seconds, waiting = asyncio.run(main())
    assert health_seconds and max(health_seconds) < 2.0
    assert waiting >= 5  # the requests really were queued behind one another
    for spec, alone, crowd in zip(specs, solo, together):
        assert crowd == alone, spec
        assert alone[1] in ("stop", "length") and alone[0] is not None


# --------------------------------------------------------------------------------------------- disconnects


@pytest.fixture(scope="module")
def slow_live(target_model, draft_model, tokenizer):
    decoder = make_decoder(target_model, draft_model, tokenizer, backend_cls=SlowBackend)
    app = create_app(decoder, served_model_name="slow")
    with LiveServer(app) as server:
        server.decoder = decoder
        yield server


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_for_metric(url: str, key: tuple, at_least: float, timeout: float = 15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        values = metric_values(httpx.get(url + "/metrics").text)
        if values.get(key, 0) >= at_least or time.time() > deadline:
            return values
        time.sleep(0.05)


ABORTED = ("specdec:request_success_total", (("finished_reason", "abort"),))
GENERATED = ("specdec:generation_tokens_total", ())


def test_client_disconnect_mid_stream_stops_generation(slow_live, reference):
    before = metric_values(httpx.get(slow_live.url + "/metrics").text)
    max_tokens = 200
    body = {"prompt": "w1 w2", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sock = _raw_post(slow_live.port, "/v1/completions", body)
    received = b""
    while b'"text":"' not in received:
        data = sock.recv(4096)
        assert data, "stream ended before the first chunk"
        received += data
    assert b"200 OK" in received.split(b"\r\n", 1)[0]
    sock.close()

    values = _wait_for_metric(slow_live.url, ABORTED, before[ABORTED] + 1)
    assert values[ABORTED] == before[ABORTED] + 1
    # Generation stopped soon after the client left, far from max_tokens (each step takes >= 120 ms).
    assert values[GENERATED] - before[GENERATED] < max_tokens / 2
    engine = slow_live.decoder.engine()
    stats = engine.last_stats
    assert stats.num_generated_tokens < max_tokens / 2
    # The target cache keeps the abandoned request's prompt and emitted tokens (minus the last) for reuse.
    assert engine.cache.length == len(engine.retained.tokens) == stats.num_prompt_tokens + stats.num_generated_tokens - 1
    # The engine is free and its caches are consistent: the next request completes, and correctly.
    with httpx.Client(base_url=slow_live.url, timeout=60) as http:
        out = http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 6, "temperature": 0}).json()
    expected = reference(reference.decoder.encode("w1 w2", chat=False), max_tokens=6, temperature=0)
    assert out["choices"][0]["text"] == expected.text


def test_client_disconnect_non_streaming_stops_generation(slow_live):
    before = metric_values(httpx.get(slow_live.url + "/metrics").text)
    body = {"messages": [{"role": "user", "content": "w4"}], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    sock = _raw_post(slow_live.port, "/v1/chat/completions", body)
    time.sleep(0.3)
    sock.close()
    values = _wait_for_metric(slow_live.url, ABORTED, before[ABORTED] + 1)
    assert values[ABORTED] == before[ABORTED] + 1
    assert values[GENERATED] - before[GENERATED] < 100
    with httpx.Client(base_url=slow_live.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 3}).status_code == 200


def test_request_abandoned_while_queued_is_never_run(slow_live):
    before = metric_values(httpx.get(slow_live.url + "/metrics").text)
    busy = _raw_post(slow_live.port, "/v1/completions", {"prompt": "w1 w2 w3", "max_tokens": 200, "temperature": 0,
                                                           "ignore_eos": True, "stream": True})
    while b'"text":"' not in busy.recv(4096):
        pass
    queued = _raw_post(slow_live.port, "/v1/completions", {"prompt": "w5 w6 w7 w8 w9", "max_tokens": 100})
    time.sleep(0.3)
    queued.close()  # leaves while still waiting behind `busy` (the server polls for this every 0.2 s)
    time.sleep(0.8)
    busy.close()
    values = _wait_for_metric(slow_live.url, ABORTED, before[ABORTED] + 2)
    assert values[ABORTED] == before[ABORTED] + 2
    # Only the running request was prefilled: the queued one was skipped without any engine work.
    assert values[("specdec:prompt_tokens_total", ())] - before[("specdec:prompt_tokens_total", ())] == 3
