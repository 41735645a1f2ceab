"""`specdec serve --parallel N`: concurrent requests generate together, each stream gets what it gets alone, and the
metrics show several running and the rows of each shared pass."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from specdec.backends.pytorch.backend import TransformersBackend  # noqa: E402
from specdec.config import SpecConfig  # noqa: E402
from specdec.decoder import SpecDecoder  # noqa: E402
from specdec.server import create_app  # noqa: E402
from specdec.server.limits import ServerLimits  # noqa: E402
from test_server import LiveServer, metric_values, tiny_tokenizer  # noqa: E402
from test_server_lifecycle import in_thread, wait_until  # noqa: E402

PROMPTS = ["w1 w2", "w5 w6 w7 w5 w6 w7 w5 w6", "w9", "w11 w12 w13 w14", "w20 w21 w20 w21 w20", "w30 w31 w32"]


@pytest.fixture(scope="module")
def decoder(target_model, draft_model):
    tokenizer = tiny_tokenizer()
    target = TransformersBackend(target_model, tokenizer, name="tiny-target", max_context=256)
    draft = TransformersBackend(draft_model, tokenizer, name="tiny-draft", max_context=256)
    return SpecDecoder(target, draft, SpecConfig(drafter="draft_model", num_speculative_tokens=3))


class HoldAtWidth:
    """Wraps the worker's BatchEngine: no step runs before `start` is set (so every request can arrive first,
    however slowly the client threads start), and the first step taken with `width` sequences running waits for
    release."""

    def __init__(self, batch, width: int):
        self._batch = batch
        self.width = width
        self.start = threading.Event()
        self.reached = threading.Event()
        self.release = threading.Event()
        self.widths: list[int] = []

    def step(self):
        assert self.start.wait(20)
        self.widths.append(len(self._batch.running))
        if len(self._batch.running) == self.width and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(20)
        return self._batch.step()

    def __getattr__(self, name):
        return getattr(self._batch, name)


def body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}


def streamed_text(url: str, prompt: str) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body(prompt, True), timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                choice = json.loads(line[6:])["choices"]
                if choice:
                    text.append(choice[0]["text"])
    return "".join(text)


def test_parallel_streams_generate_together_and_each_gets_its_solo_output(decoder):
    solo = {}
    app_solo = create_app(decoder, served_model_name="tiny")
    with LiveServer(app_solo) as live:
        for prompt in PROMPTS:
            solo[prompt] = httpx.post(live.url + "/v1/completions", json=body(prompt, False),
                                      timeout=60).json()["choices"][0]["text"]
    app = create_app(decoder, served_model_name="tiny", limits=ServerLimits(parallel=3))
    state = app.state.specdec
    hold = HoldAtWidth(state.worker.batch, 3)
    state.worker.batch = hold
    with LiveServer(app) as live:
        before = metric_values(httpx.get(live.url + "/metrics").text)
        calls = [in_thread(lambda p=p: streamed_text(live.url, p)) for p in PROMPTS]
        wait_until(lambda: len(hold.running) + state.worker.num_waiting == len(PROMPTS), timeout=30,
                   what="every request admitted or waiting")
        hold.start.set()
        wait_until(lambda: hold.reached.is_set() and state.worker.num_waiting == 3, timeout=30,
                   what="three requests running together and three waiting")
        running = metric_values(httpx.get(live.url + "/metrics").text)
        assert running[("specdec:num_requests_running", ())] == 3
        assert running[("specdec:num_requests_waiting", ())] == 3
        hold.release.set()
        texts = []
        for thread, result in calls:
            thread.join(60)
            assert "error" not in result, result.get("error")
            texts.append(result["value"])
        after = metric_values(httpx.get(live.url + "/metrics").text)
    assert max(hold.widths) == 3
    assert texts == [solo[p] for p in PROMPTS]
    passes = after[("specdec:target_pass_rows_count", ())] - before.get(("specdec:target_pass_rows_count", ()), 0)
    rows = after[("specdec:target_pass_rows_sum", ())] - before.get(("specdec:target_pass_rows_sum", ()), 0)
    assert passes > 0 and rows / passes > 2  # passes shared by several sequences (and their drafts)
    assert after[("specdec:num_requests_running", ())] == 0
