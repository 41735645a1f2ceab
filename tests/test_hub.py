"""Hub ids at first contact (specdec.loading.hub): an unreachable hub gives one line at once, or the local cache with a
note; HF_HUB_OFFLINE without the model in the cache is one line; no progress bar of a quick load, none before
an error; library error messages of several lines are printed on one."""

from __future__ import annotations

import socket
import time

import pytest

from conftest import save_tiny_model, tiny_llama, tiny_tokenizer
from specdec.cli.main import main
from specdec.loading import hub
from specdec.loading.models import ModelLoadError, load_backend, resolve


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache of our own, and a hub that cannot be reached (no network is touched)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "unreachable_reason", lambda url: "huggingface.co:443: Name or service not known")
    return cache


def _cache_model(cache, repo_id: str, revision: str = "main"):
    """Lay a tiny model out as huggingface_hub caches a download: refs/<revision> -> snapshots/<commit>/."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / revision).write_text(commit)
    save_tiny_model(folder / "snapshots" / commit, tiny_llama(0), tiny_tokenizer())


def _no_transformers_load(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to load (and would retry the hub)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_an_unreachable_hub_and_an_uncached_id_is_one_line_at_once(hub_cache, monkeypatch, capsys):
    _no_transformers_load(monkeypatch)
    began = time.monotonic()
    code = main(["generate", "someone/some-model", "--backend", "torch"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - began < 10
    assert err.count("\n") == 1 and err.startswith("specdec generate: error: cannot reach the hub at "), err
    assert "someone/some-model is not in the local hub cache" in err and str(hub_cache) in err
    assert "Retrying" not in err and "Traceback" not in err


def test_an_unreachable_hub_loads_a_cached_id_from_the_cache(hub_cache, capsys):
    _cache_model(hub_cache, "someone/cached-model")
    backend = load_backend("someone/cached-model", role="target", backend="torch", max_context=64)
    assert backend.vocab_size == 97
    err = capsys.readouterr().err
    assert "cannot reach the hub" in err and "loading someone/cached-model from the local cache" in err
    # Negative control: a revision the cache does not hold is refused in one line.
    with pytest.raises(ModelLoadError, match="someone/cached-model@v2 is not in the local hub cache"):
        load_backend("someone/cached-model@v2", role="target", backend="torch")


def test_hub_offline_without_the_model_cached_is_one_line(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    decision = hub.access("someone/some-model")
    assert decision.error and "HF_HUB_OFFLINE is set" in decision.error and "\n" not in decision.error
    _cache_model(hub_cache, "someone/some-model")
    assert hub.access("someone/some-model") == hub.HubAccess()  # cached: transformers reads it offline itself


def test_access_online_asks_nothing_of_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "unreachable_reason", lambda url: None)
    monkeypatch.setattr(hub, "offline_mode", lambda: False)
    assert hub.access("someone/some-model") == hub.HubAccess()
    assert resolve("someone/some-model").hub and not resolve(save_tiny_model(tmp_path / "m", tiny_llama(0))).hub


def test_unreachable_reason_tries_one_connection():
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    port = listening.getsockname()[1]
    try:
        assert hub.unreachable_reason.__wrapped__(f"http://127.0.0.1:{port}/", 2.0) is None
    finally:
        listening.close()
    reason = hub.unreachable_reason.__wrapped__(f"http://127.0.0.1:{port}/", 2.0)  # nothing listens now
    assert reason and reason.startswith(f"127.0.0.1:{port}: ")


def test_a_quick_load_draws_no_progress_bar_and_the_hook_is_restored(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    path = save_tiny_model(tmp_path / "m", tiny_llama(0), tiny_tokenizer())
    capfd.readouterr()
    load_backend(path, role="target", backend="torch", max_context=64)
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err and "%|" not in captured.err, captured.err
    assert getattr(hf_logging, "_tqdm_hook", None) is None  # a library user's transformers is left as it was


def test_a_long_load_still_draws_its_bar(capfd):
    from transformers.utils.logging import tqdm

    from specdec.loading.progress import LONG_WORK_SECONDS, long_work_bars

    with long_work_bars():
        bar = tqdm(total=2, desc="slow work")
        for _ in range(2):
            time.sleep(LONG_WORK_SECONDS / 2 + 0.2)
            bar.update(1)
        bar.close()
    assert "slow work" in capfd.readouterr().err


def test_a_library_error_of_several_lines_is_printed_on_one(monkeypatch, capsys, tmp_path):
    import specdec.decoder

    def fails(*args, **kwargs):
        raise ModelLoadError("could not load target model 'x': We couldn't connect.\nCheck your connection.")

    monkeypatch.setattr(specdec.decoder.SpecDecoder, "load", fails)
    assert main(["generate", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("specdec generate: error: could not load target model 'x': We couldn't "
                                       "connect. Check your connection.\n")
