"""Log-probabilities under speculation: each returned token's log-probability and its top alternatives come from the
verify pass's row for that token, so they equal plain decoding's (an independent one-token-at-a-time reference), and
with --exact kernels bit for bit; cut with the tokens at EOS, stop strings and max_tokens; in OpenAI's shapes through
the SDK, streamed too, with bad values refused."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.config import ConfigError, ModelRef, SamplingParams, SpecConfig
from specdec.decoder import SpecDecoder
from tiny_gguf import write_tiny_gguf

PLAIN = SpecConfig(drafter="none")


def speculative(k: int) -> SpecConfig:
    return SpecConfig(drafter="draft_model", num_speculative_tokens=k, k_policy="fixed")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return (write_tiny_gguf(root / "target.gguf", seed=0, layers=3),
            write_tiny_gguf(root / "noisy.gguf", seed=0, layers=3, noise=0.15))


@pytest.fixture(scope="module")
def decoder(ggufs):
    return SpecDecoder.load(ModelRef(target=str(ggufs[0]), draft=str(ggufs[1]), max_context=512, threads=1))


@pytest.fixture(scope="module")
def exact_decoder(ggufs):
    return SpecDecoder.load(ModelRef(target=str(ggufs[0]), draft=str(ggufs[1]), max_context=512, threads=1,
                                     batch_invariant=True))


def reference_logprobs(decoder, prompt: list[int], tokens: list[int], top: int):
    """By hand: the target fed one token at a time, log-softmax of each row, the token's entry and the best `top`."""
    target = decoder.target
    cache = target.new_cache(target.max_context)
    row = target.forward(prompt, cache, 1)[-1]
    out = []
    for token in tokens:
        scores = torch.log_softmax(row.float(), dim=-1)
        values, ids = scores.topk(top)
        out.append((float(scores[token]), list(zip(ids.tolist(), values.tolist()))))
        row = target.forward([token], cache, 1)[-1]
    return out


def test_greedy_logprobs_equal_the_reference_and_plain_decoding(decoder):
    prompt = decoder.encode("the cat and the dog", chat=False)
    params = SamplingParams(max_tokens=24, logprobs=3, ignore_eos=True)
    plain = decoder.generate(prompt, params, PLAIN)
    expected = reference_logprobs(decoder, prompt, plain.tokens, 3)
    for got, (logprob, top) in zip(plain.logprobs, expected, strict=True):
        assert math.isclose(got.logprob, logprob, abs_tol=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in top]
        assert got.top[0][0] == got.token  # greedy: the chosen token is the most likely
    for k in (2, 5):
        fast = decoder.generate(prompt, params, speculative(k))
        assert fast.stats.num_draft_tokens > 0
        agree = next((i for i, (a, b) in enumerate(zip(fast.tokens, plain.tokens)) if a != b), len(plain.tokens))
        assert agree > 4  # fast kernels may flip a near-tie late; up to there the numbers must agree
        for got, want in zip(fast.logprobs[:agree], plain.logprobs[:agree]):
            assert got.token == want.token and math.isclose(got.logprob, want.logprob, abs_tol=1e-3)


def test_exact_kernels_make_speculative_logprobs_bit_identical(exact_decoder):
    prompt = exact_decoder.encode("the cat and the dog", chat=False)
    params = SamplingParams(max_tokens=24, logprobs=5, ignore_eos=True)
    plain = exact_decoder.generate(prompt, params, PLAIN)
    for k in (3, 6):
        fast = exact_decoder.generate(prompt, params, speculative(k))
        assert fast.stats.num_accepted_tokens > 0
        assert fast.tokens == plain.tokens and fast.logprobs == plain.logprobs


def test_a_negative_control_rows_off_by_one_are_caught(exact_decoder):
    # Each token scored under the row after it (the verify pass's rows read one off) gives other numbers.
    prompt = exact_decoder.encode("the cat and the dog", chat=False)
    plain = exact_decoder.generate(prompt, SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True), PLAIN)
    target = exact_decoder.target
    cache = target.new_cache(target.max_context)
    rows = [target.forward(prompt, cache, 1)[-1]] + [target.forward([t], cache, 1)[-1] for t in plain.tokens]
    right = [float(torch.log_softmax(rows[j].float(), -1)[t]) for j, t in enumerate(plain.tokens)]
    shifted = [float(torch.log_softmax(rows[j + 1].float(), -1)[t]) for j, t in enumerate(plain.tokens)]
    assert all(math.isclose(a.logprob, b, abs_tol=1e-4) for a, b in zip(plain.logprobs, right))
    assert any(not math.isclose(a.logprob, b, abs_tol=1e-4) for a, b in zip(plain.logprobs, shifted))


def test_logprobs_are_cut_with_the_tokens_and_sampled_ones_match_their_tokens(decoder):
    prompt = decoder.encode("the cat", chat=False)
    for params in (SamplingParams(max_tokens=7, logprobs=1, ignore_eos=True),
                   SamplingParams(max_tokens=40, logprobs=0, stop=("e",)),
                   SamplingParams(max_tokens=40, logprobs=2, temperature=0.8, seed=5)):
        out = decoder.generate(prompt, params, speculative(4))
        assert [lp.token for lp in out.logprobs] == out.tokens
        assert all(lp.logprob <= 0 and len(lp.top) == params.logprobs for lp in out.logprobs)
    assert decoder.generate(prompt, SamplingParams(max_tokens=3), speculative(4)).logprobs is None
    with pytest.raises(ConfigError):
        SamplingParams(logprobs=21)


def test_the_openai_sdk_gets_logprobs_whole_and_streamed(decoder):
    import httpx
    import openai

    from specdec.server import create_app
    from test_server import LiveServer

    prompt = "the cat and the dog"
    library = decoder.generate(decoder.encode(prompt, chat=False), SamplingParams(max_tokens=10, logprobs=2), PLAIN)
    with LiveServer(create_app(decoder, served_model_name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
        block = completion.choices[0].logprobs
        listed = [lp for lp in library.logprobs if lp.token not in decoder.target.eos_token_ids]
        assert len(block.tokens) == len(listed) == completion.usage.completion_tokens - (
            len(library.logprobs) - len(listed))
        for got, want in zip(block.token_logprobs, listed):
            assert math.isclose(got, want.logprob, abs_tol=1e-3)
        assert block.text_offset[0] == 0 and all(1 <= len(top) <= 2 for top in block.top_logprobs)  # a dict: same-text ids merge
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0,
                      logprobs=True, top_logprobs=3)
        whole = client.chat.completions.create(**kwargs).choices[0]
        entries = whole.logprobs.content
        assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
        # A token may hold part of a character (its text is then a replacement character): the bytes join whole.
        assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == whole.message.content
        streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs) for c in chunk.choices
                    if c.logprobs for e in c.logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for body, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                ({"top_logprobs": 2}, "top_logprobs")):
                bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            bad = http.post("/v1/completions", json={"prompt": "x", "logprobs": 99})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


# -- the prompt's log-probabilities (completions' echo) -------------------------------------------------------


def reference_prompt_logprobs(decoder, prompt: list[int], top: int):
    """By hand: the prompt fed one token at a time; the row after prompt[:i + 1] scores prompt[i + 1]."""
    target = decoder.target
    cache = target.new_cache(target.max_context)
    out = []
    for i in range(len(prompt) - 1):
        scores = torch.log_softmax(target.forward([prompt[i]], cache, 1)[-1].float(), dim=-1)
        values, ids = scores.topk(top)
        out.append((prompt[i + 1], float(scores[prompt[i + 1]]), ids.tolist()))
    return out


@pytest.mark.parametrize("chunk", [None, 4, 5])
def test_prompt_logprobs_equal_the_reference_in_any_prefill_chunks(decoder, chunk):
    from specdec.engine.scheduler import BatchEngine

    prompt = decoder.encode("the cat and the dog sat on the mat", chat=False)
    assert len(prompt) > 10
    expected = reference_prompt_logprobs(decoder, prompt, 2)
    engine = BatchEngine(decoder.target, None, PLAIN, prefill_chunk=chunk)
    engine.add(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True))
    outputs = []
    while engine.running:
        outputs += engine.step()
    got = outputs[0].prompt_logprobs
    assert len(got) == len(prompt) - 1 and all(o.prompt_logprobs is None for o in outputs[1:])
    for lp, (token, logprob, top_ids) in zip(got, expected):
        assert lp.token == token and math.isclose(lp.logprob, logprob, abs_tol=2e-3)
        assert [t for t, _ in lp.top] == top_ids
    assert sum(len(o.tokens) for o in outputs) == 3


def test_a_negative_control_prompt_rows_off_by_one_are_caught(decoder, monkeypatch):
    from specdec.core.logprobs import row_logprobs
    from specdec.engine.scheduler import BatchEngine

    def off_by_one(sequence, rows, logits):  # each row read as scoring its own token, not the next one
        start = sequence.prefilled
        sequence.prompt_logprobs = (sequence.prompt_logprobs or []) + row_logprobs(
            logits[:rows], sequence.prompt[start:start + rows], 1)[1 if start == 0 else 0:]

    prompt = decoder.encode("the cat and the dog sat on the mat", chat=False)
    expected = reference_prompt_logprobs(decoder, prompt, 1)
    monkeypatch.setattr(BatchEngine, "_score_prompt_rows", staticmethod(off_by_one))
    got = decoder.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), PLAIN).prompt_logprobs
    assert any(not math.isclose(lp.logprob, logprob, abs_tol=2e-3) for lp, (_, logprob, _) in zip(got, expected))


def test_max_tokens_zero_scores_the_prompt_only_and_skips_the_prefix_cache(decoder):
    prompt = decoder.encode("one two three four", chat=False)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    first = decoder.generate(prompt, params, speculative(3))
    again = decoder.generate(prompt, params, speculative(3))
    assert first.tokens == [] and first.text == "" and first.finish_reason == "length"
    assert [lp.logprob for lp in again.prompt_logprobs] == [lp.logprob for lp in first.prompt_logprobs]
    assert again.stats.num_cached_prompt_tokens == 0  # no cached prefix has the rows the scores need
    assert len(first.prompt_logprobs) == len(prompt) - 1 and all(lp.top == () for lp in first.prompt_logprobs)
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_echo_through_the_openai_sdk_is_what_lm_evaluation_harness_reads(decoder):
    """completions with echo + logprobs (+ max_tokens 0 or 1): the prompt's text first, its tokens' scores (the
    first null) equal to the one-token-at-a-time reference, then the completion's; streamed, the prompt first."""
    import openai

    from specdec.server import create_app
    from test_server import LiveServer

    prompt = "the cat and the dog sat"
    ids = decoder.encode(prompt, chat=False)
    expected = reference_prompt_logprobs(decoder, ids, 1)
    with LiveServer(create_app(decoder, served_model_name="tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0).choices[0]
        assert only.text == prompt and only.finish_reason == "length"
        block = only.logprobs
        assert len(block.tokens) == len(ids) and block.token_logprobs[0] is None and block.top_logprobs[0] is None
        for got, (_, want, _) in zip(block.token_logprobs[1:], expected):
            assert math.isclose(got, want, abs_tol=2e-3)
        assert "".join(block.tokens) == prompt and block.text_offset[0] == 0
        one = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                        temperature=0, extra_body={"ignore_eos": True}).choices[0]
        assert len(one.logprobs.token_logprobs) == len(ids) + 1  # harness: [ctxlen:-1] drops the generated one
        assert one.logprobs.token_logprobs[1:-1] == block.token_logprobs[1:] and one.text.startswith(prompt)
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, temperature=0)
        assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                                temperature=0, stream=True))
        assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
        assert "".join(c.choices[0].text for c in chunks) == one.text[: len(prompt)] + "".join(
            c.choices[0].text for c in chunks[1:])
