"""Stream pacing: events of exactly N tokens whose texts join to the engine's text, against a batched TextStream
as reference, and through the server: the same text as unpaced, one content event per N tokens whatever the
drafts accepted."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from specdec.engine.output import StepOutput
from specdec.engine.textstream import TextStream
from specdec.server import create_app, sse
from specdec.server.limits import ServerLimits
from specdec.server.pacing import TokenPacer
from test_server import make_decoder, tiny_tokenizer

EOS = 3


def decode_with(tokenizer):
    return lambda ids: tokenizer.decode(list(ids))


def steps_of(tokens: list[int], rng: random.Random) -> list[list[int]]:
    """Split tokens into steps of 1 to 8 (what speculation's accepted lengths look like)."""
    steps, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 8)
        steps.append(tokens[i:i + n])
        i += n
    return steps


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("per_event", [1, 3, 5])
def test_events_hold_n_tokens_and_join_to_the_engines_text(seed, per_event):
    tokenizer = tiny_tokenizer()
    decode = decode_with(tokenizer)
    rng = random.Random(seed)
    tokens = [rng.randrange(7, 97) for _ in range(rng.randint(1, 40))]
    stop = ["w9 w10"] if seed % 3 == 0 else []
    ends_with_eos = seed % 2 == 0
    # The reference: the engine's own TextStream fed the same steps (as BatchEngine._emit feeds it).
    engine_text = TextStream(decode, stop)
    outputs = []
    steps = steps_of(tokens + ([EOS] if ends_with_eos else []), rng)
    for i, step in enumerate(steps):
        visible = [t for t in step if t != EOS]
        before = len(engine_text.tokens)
        delta = engine_text.push(visible)
        finish = None
        if engine_text.stopped:
            step, finish = step[:len(engine_text.tokens) - before], "stop"
        elif i == len(steps) - 1:
            finish = "stop" if ends_with_eos else "length"
            delta += engine_text.flush()
        outputs.append(StepOutput(0, step, [False] * len(step), delta, finish))
        if finish:
            break
    pacer = TokenPacer(per_event, decode, stop, frozenset({EOS}))
    events, due_after = [], []
    for output in outputs:
        new = pacer.feed(output)
        events += new
        due_after.append(len(events))
    total = sum(len(o.tokens) for o in outputs)
    assert "".join(events) == "".join(o.text for o in outputs) == engine_text.text
    assert len(events) == math.ceil(total / per_event)
    # Each event is sent as soon as its N tokens exist, never later.
    seen = 0
    for output, count in zip(outputs, due_after):
        seen += len(output.tokens)
        assert count == seen // per_event or (output.finish_reason and count == math.ceil(seen / per_event))


def test_pacing_of_zero_tokens_is_refused():
    with pytest.raises(ValueError):
        TokenPacer(0, str, [], frozenset())
    with pytest.raises(ValueError):
        ServerLimits(stream_tokens_per_event=0)


def stream(client, body):
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        payloads = list(sse.parse(response.read().decode().splitlines()))
    chunks = [p for p in payloads if p != "[DONE]"]
    return chunks


def test_the_server_sends_n_tokens_to_an_event(target_model):
    prompt = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"
    body = {"prompt": prompt, "max_tokens": 23, "temperature": 0}
    texts = {}
    for per_event in (None, 4):
        # The target drafts for itself: every draft is accepted, so unpaced steps carry several tokens.
        app = create_app(make_decoder(target_model, target_model, tiny_tokenizer()), served_model_name="tiny",
                         limits=ServerLimits(stream_tokens_per_event=per_event))
        with TestClient(app) as client:
            chunks = stream(client, body)
        content = [c for c in chunks if not c["choices"][0]["finish_reason"]]
        texts[per_event] = "".join(c["choices"][0]["text"] for c in chunks)
        stats = chunks[-1]["specdec"]
        if per_event is None:
            # The negative control: unpaced, the events follow the steps, fewer than the tokens when drafts land.
            assert stats["num_accepted_tokens"] > 0 and len(content) < 23
        else:
            assert len(content) == math.ceil(23 / per_event), [c["choices"][0]["text"] for c in content]
    assert texts[None] == texts[4]


def test_the_flag_reaches_the_limits_and_zero_is_a_one_line_error():
    from specdec.errors import UserError
    from specdec.server.options import limits_from_args, serve_parser

    args = serve_parser().parse_args(["m.gguf", "--stream-tokens-per-event", "3", "--parallel", "1"])
    assert limits_from_args(args).stream_tokens_per_event == 3
    assert limits_from_args(serve_parser().parse_args(["m.gguf", "--parallel", "1"])).stream_tokens_per_event is None
    with pytest.raises(UserError, match="--stream-tokens-per-event"):
        limits_from_args(serve_parser().parse_args(["m.gguf", "--stream-tokens-per-event", "0", "--parallel", "1"]))
