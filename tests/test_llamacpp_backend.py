"""The llama.cpp backend on tiny GGUF files written in the test: logits vs a torch reference, batch invariance bit for bit
(with negative controls), greedy speculative == plain for every drafter and policy, rollback, sampled distribution,
loading, CLI and server."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.backends.kvcache import ContextOverflowError
from specdec.backends.llamacpp.backend import (
    EXACT_REPACKED_ROWS,
    INVARIANT_ROWS,
    LlamaCppBackend,
    batch_invariance_problems,
)
from specdec.config import SamplingParams, SpecConfig
from specdec.core.sampling import probabilities
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine
from tiny_gguf import EOS_ID, VOCAB, quantize_q4_k_m, write_tiny_gguf

PREFIX = [(i * 37) % 280 for i in range(40)]
ROWS = [(i * 53 + 7) % 280 for i in range(12)]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    paths = {
        "target": write_tiny_gguf(root / "target.gguf", seed=0, layers=3),
        "draft": write_tiny_gguf(root / "draft.gguf", seed=1, layers=1),
        "noisy": write_tiny_gguf(root / "noisy.gguf", seed=0, layers=3, noise=0.15),
        "f32_256": write_tiny_gguf(root / "wide.gguf", seed=3, hidden=256, ffn=512),
    }
    paths["q4_k"] = quantize_q4_k_m(paths["f32_256"], root / "wide-q4_k_m.gguf")
    return paths


@pytest.fixture(scope="module")
def target(gguf_dir):
    return LlamaCppBackend(gguf_dir["target"], name="tiny-target", max_context=512, threads=1)


@pytest.fixture(scope="module")
def draft(gguf_dir):
    return LlamaCppBackend(gguf_dir["draft"], name="tiny-draft", max_context=512, threads=1, batch_invariant=False)


def test_this_build_can_be_batch_invariant(target):
    assert batch_invariance_problems() == []
    assert target.batch_invariant and target.vocab_size == VOCAB
    assert EOS_ID in target.eos_token_ids


def test_logits_match_a_torch_reference_of_the_same_weights(gguf_dir, target):
    from transformers import AutoModelForCausalLM

    path = gguf_dir["target"]
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokens = [5, 70, 200, 33, 12, 99, 150, 7, 280, 3]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    cache = target.new_cache()
    batched = target.forward(tokens, cache, num_logits=len(tokens))  # one prefill, all rows
    cache.trim(cache.length)
    stepwise = torch.cat([target.forward([t], cache) for t in tokens])  # plain decoding
    scale = float(expected.abs().max())
    for got in (batched, stepwise):
        assert got.shape == expected.shape and got.dtype == torch.float32
        # llama.cpp keeps K/V in F16, torch in F32: close, not equal.
        assert float((got - expected).abs().max()) < 2e-3 * scale
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _row_differences(backend, one_decode: bool = False) -> list[int]:
    """For batches of 2..12 rows after a 40-token prefix: how many rows differ bitwise from decoding alone."""
    cache = backend.new_cache()
    backend.forward(PREFIX, cache)
    alone = [backend.forward([t], cache)[0] for t in ROWS]
    differences = []
    for n in range(2, len(ROWS) + 1):
        cache.trim(cache.length - len(PREFIX))
        if one_decode:  # what the backend avoids: all rows in one llama_decode
            rows = torch.from_numpy(backend.decode_together(ROWS[:n], cache))
        else:
            rows = backend.forward(ROWS[:n], cache, num_logits=n)
        differences.append(sum(not torch.equal(rows[i], alone[i]) for i in range(n)))
    return differences


@pytest.mark.parametrize("model", ["target", "q4_k"])
def test_rows_are_bit_identical_alone_or_in_a_batch(gguf_dir, model):
    backend = LlamaCppBackend(gguf_dir[model], max_context=512, threads=2)
    assert _row_differences(backend) == [0] * (len(ROWS) - 1)


def test_negative_controls_show_the_kernels_the_backend_avoids(gguf_dir):
    # Fast mode (the default): repacked Q4_K weights take the gemm for each group of 4 rows: rows change.
    fast = LlamaCppBackend(gguf_dir["q4_k"], max_context=512, threads=2, batch_invariant=False)
    assert fast.extra_buffers and sum(_row_differences(fast)) > 0
    exact = LlamaCppBackend(gguf_dir["q4_k"], max_context=512, threads=2, batch_invariant=True)
    differences = _row_differences(exact, one_decode=True)
    if exact.amx:
        # An AMX library: AMX's buffers take the weights first, and exact mode slices by the length its probe
        # measured on this model; one row more in one llama_decode changes rows.
        rows = exact.invariant_rows
        assert exact.extra_buffers and rows == exact.amx_invariance["rows"] >= INVARIANT_ROWS
        assert rows < len(ROWS), "the tiny model's rows must change somewhere for this control to mean anything"
        assert differences[: rows - 1] == [0] * (rows - 1) and all(d > 0 for d in differences[rows - 1 :])
    else:
        # Exact mode keeps the repacked weights, so its slices must stay under 4 rows: passes of 2-3 rows take
        # the one-row gemv, passes of 4+ rows in one llama_decode do not.
        assert exact.extra_buffers and exact.invariant_rows == EXACT_REPACKED_ROWS == 3
        assert differences[:2] == [0, 0] and all(d > 0 for d in differences[2:])
    # Without repacking, 8+ rows in one llama_decode take the tiled K-quant matmul and change too.
    stored = LlamaCppBackend(gguf_dir["q4_k"], max_context=512, threads=2, batch_invariant=True, extra_buffers=False)
    assert stored.invariant_rows == INVARIANT_ROWS
    assert _row_differences(stored) == [0] * (len(ROWS) - 1)
    differences = _row_differences(stored, one_decode=True)
    assert differences[: INVARIANT_ROWS - 1] == [0] * (INVARIANT_ROWS - 1)
    assert all(d > 0 for d in differences[INVARIANT_ROWS - 1 :])


def test_rollback_restores_the_cache_exactly(target):
    cache = target.new_cache()
    target.forward(PREFIX, cache)
    first = target.forward(ROWS[:5], cache, num_logits=5)
    assert cache.length == len(PREFIX) + 5
    assert cache.trim(3) == 3 and cache.length == len(PREFIX) + 2
    again = target.forward(ROWS[2:5], cache, num_logits=3)  # rewritten over the trimmed cells
    assert torch.equal(again, first[2:])
    held = cache.length
    assert cache.trim(10_000) == held and cache.length == 0


def test_context_overflow_leaves_the_cache_unchanged(gguf_dir):
    backend = LlamaCppBackend(gguf_dir["target"], max_context=64, threads=1)
    cache = backend.new_cache()
    backend.forward(PREFIX, cache)
    with pytest.raises(ContextOverflowError):
        backend.forward(list(range(30)), cache, num_logits=30)
    assert cache.length == len(PREFIX)
    # The cache still works and holds what it held: the next row is what it was before.
    alone = backend.forward([ROWS[0]], cache)
    cache.trim(cache.length)
    backend.forward(PREFIX, cache)
    assert torch.equal(backend.forward([ROWS[0]], cache), alone)


def test_caches_are_independent_sequences(target):
    a, b = target.new_cache(), target.new_cache()
    assert a.seq_id != b.seq_id
    target.forward(PREFIX[:10], a)
    target.forward(PREFIX[:10], b)
    a.trim(a.length)  # removing a's positions leaves b's
    assert b.length == 10
    via_b = target.forward(PREFIX[10:11], b)
    b.trim(b.length)
    fresh = target.forward(PREFIX[:11], target.new_cache())
    # b's cells sat after a's, so its attention sums ran in another order: close, not bitwise.
    assert torch.allclose(via_b, fresh, atol=1e-4)


# ------------------------------------------------------------------------------------- engine on llama.cpp

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [100, 200, 3], list(range(20, 60)))


def _spec_engine(target, draft, drafter: str, k: int, policy: str = "fixed", **spec_kwargs):
    spec = SpecConfig(num_speculative_tokens=k, drafter=drafter, k_policy=policy, **spec_kwargs)
    return SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec)


@pytest.mark.parametrize(
    "drafter,k,policy",
    [("draft_model", 1, "fixed"), ("draft_model", 3, "fixed"), ("draft_model", 8, "fixed"),
     ("draft_model", 6, "adaptive"), ("draft_model", 4, "heuristic"), ("prompt_lookup", 5, "fixed"),
     ("prompt_lookup", 10, "adaptive"), ("hybrid", 5, "fixed"), ("hybrid", 6, "adaptive")],
)
def test_greedy_speculative_equals_plain_decoding(target, draft, drafter, k, policy):
    plain = plain_engine(target)
    engine = _spec_engine(target, draft, drafter, k, policy)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, GREEDY).tokens
        result = engine.generate(prompt, GREEDY)
        assert result.tokens == expected, (drafter, k, policy, prompt)
    if drafter != "prompt_lookup":
        assert engine.total_stats.num_draft_tokens > 0


def test_confidence_stop_and_eos_inside_drafts(target, draft):
    plain = plain_engine(target)
    engine = _spec_engine(target, draft, "draft_model", 6, draft_p_min=0.3)
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=60)  # stops at EOS wherever it falls
        assert engine.generate(prompt, params).tokens == plain.generate(prompt, params).tokens


def test_cache_invariant_after_every_step(target, draft):
    engine = _spec_engine(target, draft, "draft_model", 4)
    prompt = PROMPTS[0]
    context = list(prompt)
    stream = engine.stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    for chunk in stream:
        context += chunk.tokens
        if chunk.finish_reason is None:
            assert engine.cache.length == len(context) - 1
    assert engine.cache.length == 0  # an exact target is left empty: no prefix reuse (see test_prefix_cache)
    # An abandoned stream leaves it empty too; the draft model keeps what it holds, and knows what that is.
    stream = engine.stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert engine.cache.length == 0 and engine.drafter.cache.length == len(engine.drafter.retained.tokens) > 0


SAMPLED = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)


def _exact_distribution(target, prompt, params, length):
    """P(sequence) for every sequence in the top-k support, from the target's own logits."""
    cache = target.new_cache()
    frontier = [((), 1.0)]
    for _ in range(length):
        nxt = []
        for seq, prob in frontier:
            cache.trim(cache.length)
            logits = target.forward(list(prompt) + list(seq), cache)[0]
            p = probabilities(logits, params)
            for token in torch.nonzero(p).flatten().tolist():
                nxt.append((seq + (token,), prob * float(p[token])))
        frontier = nxt
    return dict(frontier)


def _chi_square(counts: dict, exact: dict) -> tuple[float, float]:
    assert set(counts) <= set(exact), "a sequence with probability 0 was emitted"
    n = sum(counts.values())
    keys = sorted(exact)
    observed = np.array([counts.get(key, 0) for key in keys], dtype=float)
    expected = np.array([exact[key] for key in keys]) / sum(exact.values()) * n
    big = expected >= 5
    obs = list(observed[big]) + [observed[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    tv = 0.5 * float(np.abs(observed / n - expected / n).sum())
    return float(chisquare(obs, exp).pvalue), tv


def test_sampled_output_follows_the_target_distribution(gguf_dir, target, monkeypatch):
    # The target's weights plus noise: a draft that is often, not always, right.
    draft = LlamaCppBackend(gguf_dir["noisy"], max_context=512, threads=1, batch_invariant=False)
    prompt = [100, 200, 3, 50]
    exact = _exact_distribution(target, prompt, SAMPLED, 3)
    engine = _spec_engine(target, draft, "draft_model", 3)
    counts: dict = {}
    for seed in range(2500):
        tokens = tuple(engine.generate(prompt, dataclasses.replace(SAMPLED, seed=seed)).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    p_value, tv = _chi_square(counts, exact)
    assert p_value > 1e-3 and tv < 0.07, (p_value, tv)
    assert 0.05 < engine.total_stats.acceptance_rate < 0.98  # the draft really differs from the target

    # Negative control: a verifier that accepts every draft token is caught by the same test.
    import specdec.engine.scheduler as engine_module  # the step code lives there
    from specdec.core.sampling import sample_token
    from specdec.core.verify import Verdict

    def always_accept(tokens, draft_probs, target_probs, generator):
        return Verdict(len(tokens), sample_token(target_probs[len(tokens)], generator), True)

    monkeypatch.setattr(engine_module, "verify_sampled", always_accept)
    wrong = _spec_engine(target, draft, "draft_model", 3)
    counts = {}
    for seed in range(1000):
        tokens = tuple(wrong.generate(prompt, dataclasses.replace(SAMPLED, seed=seed)).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    # Caught either way: a sequence the target gives probability 0, or a failed chi-square.
    caught = not set(counts) <= set(exact) or _chi_square(counts, exact)[0] < 1e-6
    assert caught


# ----------------------------------------------------------------------------- loading, CLI and server


def test_load_pair_picks_llama_cpp_for_gguf_and_reads_the_tokenizer(gguf_dir, tmp_path, monkeypatch):
    from specdec.loading.models import VocabMismatchError, check_vocab_compatible, load_pair

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target, draft = load_pair(str(gguf_dir["target"]), str(gguf_dir["draft"]), max_context=256, threads=1,
                              batch_invariant=True)
    assert isinstance(target, LlamaCppBackend) and isinstance(draft, LlamaCppBackend)
    assert target.batch_invariant and not draft.batch_invariant
    assert draft.tokenizer is None  # only the target encodes and decodes
    ids = target.tokenizer("def f(x):\n    return x")["input_ids"]
    assert target.tokenizer.decode(ids) == "def f(x):\n    return x"
    chat = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The tokenizer is converted once and cached.
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1

    # A draft whose ids mean other strings is refused.
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=5, layers=1)
    other_backend = LlamaCppBackend(other, max_context=64, threads=1, batch_invariant=False)
    monkeypatch.setattr(other_backend, "token_strings", lambda: [s[::-1] + b"x" for s in draft.token_strings()])
    with pytest.raises(VocabMismatchError, match="different vocabularies"):
        check_vocab_compatible(target, other_backend)


def test_backend_choice_and_errors(gguf_dir, tmp_path):
    from specdec.loading.models import ModelLoadError, ResolvedModel, choose_backend, load_backend

    gguf = ResolvedModel(str(gguf_dir["target"].parent), gguf_dir["target"].name, label="t")
    hf_dir = ResolvedModel(str(tmp_path), label="dir")
    assert choose_backend("auto", gguf) == "llama.cpp"
    assert choose_backend("torch", gguf) == "torch"
    assert choose_backend("auto", hf_dir) == "torch"
    with pytest.raises(ModelLoadError, match="runs .gguf files"):
        choose_backend("llama.cpp", hf_dir)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="could not load"):
        load_backend(str(broken), backend="llama.cpp", role="draft")


def test_cli_generate_on_llama_cpp(gguf_dir, tmp_path, monkeypatch, capsys):
    from specdec.cli.main import main

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    code = main(["generate", str(gguf_dir["target"]), "--draft", str(gguf_dir["draft"]), "--max-tokens", "12",
                 "--no-chat", "--json", "-k", "3", "--k-policy", "fixed", "--prompt", "def f(x):", "--ignore-eos",
                 "--threads", "1", "--exact"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["identical_to_plain"] is True and "exact" in report["runtime"]
    assert report["stats"]["num_generated_tokens"] == 12 and report["stats"]["num_draft_tokens"] > 0
    assert report["verify_cost"] > 0
    # --weight-format is a torch conversion: refused with --backend llama.cpp.
    code = main(["generate", str(gguf_dir["target"]), "--backend", "llama.cpp", "--weight-format", "int8"])
    assert code == 2 and "torch backend" in capsys.readouterr().err


def test_server_serves_the_llama_cpp_backend(target, draft):
    from fastapi.testclient import TestClient

    from specdec.decoder import SpecDecoder
    from specdec.server import create_app

    class WordTokenizer:  # ids as words: the server only needs encode/decode here
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [int(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(i) for i in ids)

    decoder = SpecDecoder(target, draft)
    decoder.tokenizer = WordTokenizer()
    expected = plain_engine(target, decode=decoder.tokenizer.decode).generate(
        [5, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True)
    )
    with TestClient(create_app(decoder, served_model_name="tiny")) as client:
        response = client.post("/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        })
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 10
        assert body["specdec"]["num_draft_tokens"] > 0
        metrics = client.get("/metrics").text
        assert "specdec:spec_decode_num_draft_tokens_total" in metrics
    assert len(expected.tokens) == 10


def _mapped(path) -> bool:
    return any(line.rstrip().endswith(str(path)) for line in open("/proc/self/maps"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_repacked_weights_are_read_into_memory_and_weights_as_stored_stay_mapped(gguf_dir, tmp_path):
    """With llama.cpp's extra buffers the file is read, not mapped (the mapping only kept the file's pages resident
    beside the repacked copies); without them the weights are used in place from the mapping (the control)."""
    import shutil

    model = shutil.copy(gguf_dir["q4_k"], tmp_path / "read.gguf")
    repacked = LlamaCppBackend(model, max_context=128, threads=1, batch_invariant=False, extra_buffers=True)
    assert not repacked.weights_mapped and not _mapped(model)
    stored = LlamaCppBackend(model, max_context=128, threads=1, batch_invariant=False, extra_buffers=False)
    assert stored.weights_mapped and _mapped(model)
    stored.close()
    assert not _mapped(model)
    cache = repacked.new_cache(128)
    assert torch.isfinite(repacked.forward([1, 2, 3], cache)).all()
    repacked.close()
