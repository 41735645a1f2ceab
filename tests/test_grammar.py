"""Structured output under speculation: a JSON schema's grammar (llguidance) masks every verified row as plain
constrained decoding masks it after that row's prefix.

The reference is independent of the engine's processor code: the tiny GGUF target decoded one token at a time with
its raw logits, masked by a fresh llguidance matcher, argmax. Speculative greedy output (a correlated draft model,
k 2-6) and our plain decoding must equal it token for token, the text must parse and match the schema, a grammar
that ends inside a draft must end the text there, the tokens the grammar forces must be counted apart, and a schema
the engine cannot compile must be refused before any work.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

import llguidance
import llguidance.hf
import llguidance.torch

from specdec.config import ConfigError, ModelRef, SamplingParams, SpecConfig
from specdec.decoder import SpecDecoder
from specdec.grammar.errors import GrammarError
from tiny_gguf import write_tiny_gguf

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# Bounded: every output completes in a few tokens, so the grammar ends inside a draft and only EOS may follow.
SWITCH = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "on": {"type": "boolean"}},
          "required": ["unit", "on"], "additionalProperties": False}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    target = write_tiny_gguf(root / "target.gguf", seed=0, layers=3)
    draft = write_tiny_gguf(root / "noisy.gguf", seed=0, layers=3, noise=0.15)
    return SpecDecoder.load(ModelRef(target=str(target), draft=str(draft), max_context=512, threads=1))


def reference_constrained_greedy(decoder, prompt: list[int], schema: dict, max_tokens: int) -> list[int]:
    """Plain constrained decoding by hand: one token per forward, the raw logits masked by llguidance, argmax."""
    target = decoder.target
    tokenizer = llguidance.hf.from_tokenizer(target.tokenizer, n_vocab=target.vocab_size,
                                             eos_token=sorted(target.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, target.vocab_size)
    cache = target.new_cache(target.max_context)
    logits = target.forward(prompt, cache, 1)[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        row = logits.float().clone().unsqueeze(0)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(row, mask)
        token = int(torch.argmax(row[0]))
        out.append(token)
        if token in target.eos_token_ids:
            break
        assert matcher.consume_token(token)
        logits = target.forward([token], cache, 1)[-1]
    return out


def spec(k: int) -> SpecConfig:
    return SpecConfig(drafter="draft_model", num_speculative_tokens=k, k_policy="fixed")


@pytest.mark.parametrize("schema", [PERSON, SWITCH], ids=["person", "switch"])
def test_greedy_constrained_output_equals_plain_constrained_decoding(decoder, schema):
    prompt = decoder.encode("Give me the JSON.", chat=False)
    params = SamplingParams(max_tokens=40, json_schema=json.dumps(schema))
    expected = reference_constrained_greedy(decoder, prompt, schema, 40)
    plain = decoder.generate(prompt, params, SpecConfig(drafter="none"))
    assert plain.tokens == expected
    for k in (2, 4, 6):
        out = decoder.generate(prompt, params, spec(k))
        assert out.tokens == expected, k
        assert out.stats.num_forced_tokens > 0  # '{"name":"' and the like came free of the drafter
    unconstrained = decoder.generate(prompt, SamplingParams(max_tokens=40), SpecConfig(drafter="none"))
    assert unconstrained.tokens != expected  # the grammar changes the output: the test can tell


def test_a_grammar_that_ends_inside_a_draft_ends_the_text_there(decoder):
    prompt = decoder.encode("Switch it.", chat=False)
    for k in (3, 6):
        out = decoder.generate(prompt, SamplingParams(max_tokens=60, json_schema=json.dumps(SWITCH)), spec(k))
        value = json.loads(out.text)
        assert set(value) == {"unit", "on"} and value["unit"] in ("celsius", "fahrenheit")
        assert isinstance(value["on"], bool)
        assert out.finish_reason == "stop" and len(out.tokens) < 60


def test_sampled_constrained_output_is_always_valid(decoder):
    prompt = decoder.encode("Who?", chat=False)
    for seed in range(6):
        out = decoder.generate(prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                      json_schema=json.dumps(SWITCH)), spec(4))
        assert json.loads(out.text)["unit"] in ("celsius", "fahrenheit")


def test_json_object_mode_and_bad_schemas(decoder):
    prompt = decoder.encode("An object.", chat=False)
    out = decoder.generate(prompt, SamplingParams(max_tokens=30, json_schema='{"type": "object"}'), spec(4))
    assert out.text.startswith("{")
    with pytest.raises(GrammarError, match="strin"):
        decoder.generate(prompt, SamplingParams(max_tokens=4, json_schema='{"type": "strin"}'), spec(2))
    with pytest.raises(GrammarError, match="look-around"):
        decoder.generate(prompt, SamplingParams(max_tokens=4, json_schema=json.dumps(
            {"type": "string", "pattern": "(?=a)b"})), spec(2))
    with pytest.raises(GrammarError, match="bytes"):
        decoder.generate(prompt, SamplingParams(max_tokens=4, json_schema=json.dumps(
            {"type": "object", "description": "x" * 70_000})), spec(2))
    with pytest.raises(ConfigError):
        SamplingParams(json_schema="[1, 2]")
    # The engine is unharmed: the next request runs.
    assert decoder.generate(prompt, SamplingParams(max_tokens=3), spec(2)).tokens


def test_the_openai_sdk_parses_into_a_pydantic_model_and_bad_formats_get_400(decoder):
    """response_format through the official SDK against a live server: parse() into a pydantic model; a schema the
    engine cannot compile and an unknown format type are clear 400s, and the server goes on serving."""
    from typing import Literal

    import httpx
    import openai
    from pydantic import BaseModel

    from specdec.server import create_app
    from test_server import LiveServer

    class Switch(BaseModel):
        unit: Literal["celsius", "fahrenheit"]
        on: bool

    with LiveServer(create_app(decoder, served_model_name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Switch it."}],
                                            response_format=Switch, max_tokens=60, temperature=0)
        parsed = out.choices[0].message.parsed
        assert isinstance(parsed, Switch) and out.choices[0].finish_reason == "stop"
        assert out.model_extra["specdec"]["num_forced_tokens"] > 0
        completion = client.completions.create(model="tiny", prompt="Switch:", max_tokens=60, temperature=0,
                                               extra_body={"response_format": {"type": "json_object"}})
        assert completion.choices[0].text.startswith("{")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            bad = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "strin"}}}})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json_schema", bad.text
            assert "strin" in bad.json()["error"]["message"]
            bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "response_format": {"type": "xml"}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.type"
            assert http.post("/v1/completions", json={"prompt": "w", "max_tokens": 2}).status_code == 200
