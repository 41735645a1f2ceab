"""Edges of the lossless contract: stop strings inside an accepted draft, drafts that cannot read the target's ids, and what the torch target's batching changes.

- Stop strings: plain and speculative runs must end at the same token (the one that completes the stop
  string, as vLLM does) and report the same tokens, text and counts, wherever the stop string falls.
- Vocabulary: a draft whose embedding table cannot read every token the target emits is refused at load;
  a padding id the target scores without a token (or a prompt id) makes the drafter stop drafting, not crash.
- Batching: the torch fp32 target's verification rows are close to, not bit-identical with, one-token
  decoding (what docs/how-it-works.md states); the int8 linear is row-exact.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_cache_keeps, tiny_qwen2, tiny_tokenizer
from markov_backend import MarkovBackend
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.backends.pytorch.weights import PackedFp32Linear, RowExactInt8Linear, apply_weight_format
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine
from specdec.loading.models import VocabMismatchError, check_vocab_compatible

PROMPT = [5, 6, 7, 8, 9]
LENGTH = 30
NO_EOS = SamplingParams(max_tokens=LENGTH, ignore_eos=True)


def letters(ids) -> str:
    """Two letters per token, so stop strings can start and end inside a token or on its boundary."""
    return "".join(chr(97 + t % 26) + chr(97 + (t * 7 + 3) % 26) for t in ids)


@pytest.fixture(scope="module")
def target_model():
    return tiny_qwen2(seed=0, layers=2)


def engines(target_model, drafter: str = "draft_model", k: int = 6):
    """Plain and speculative engines on one target; the draft is the target itself, so every draft is
    accepted and each step emits k + 1 tokens: a stop string almost always falls inside a step."""
    target = TransformersBackend(target_model, name="target", max_context=128)
    draft = TransformersBackend(target_model, name="self-draft", max_context=128)
    spec = SpecConfig(num_speculative_tokens=k, drafter=drafter)
    speculative = SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec, letters)
    return plain_engine(target, letters), speculative


def streamed(engine, prompt, params):
    chunks = list(engine.stream(prompt, params))
    return [t for c in chunks for t in c.tokens], "".join(c.text for c in chunks), chunks[-1].finish_reason


# ---------------------------------------------------------------------------------------------
# Stop strings inside a step


@pytest.mark.parametrize("drafter", ["draft_model", "hybrid"])
def test_stop_string_ends_the_tokens_where_plain_decoding_does(target_model, drafter):
    plain, speculative = engines(target_model, drafter)
    reference = plain.generate(PROMPT, NO_EOS).tokens
    full = letters(reference)
    tried = inside_a_step = 0
    for start in range(2 * LENGTH - 6):
        for size in (1, 2, 3, 5):
            stop = full[start : start + size]
            if full.find(stop) != start:
                continue  # occurs earlier: covered by that start
            params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, stop=(stop,))
            end = -(-(start + size) // 2)  # the token in which the stop string ends
            expected = reference[:end]
            for engine in (plain, speculative):
                result = engine.generate(PROMPT, params)
                assert (result.tokens, result.text, result.finish_reason) == (expected, full[:start], "stop"), (
                    engine.drafter, start, size)
                assert result.stats.num_generated_tokens == len(expected)
                assert len(result.from_draft) == len(expected)
                assert streamed(engine, PROMPT, params) == (expected, full[:start], "stop")
                assert_cache_keeps(engine, PROMPT, expected)
            tried += 1
            inside_a_step += end % 7 != 0  # steps emit 7 tokens: the stop did not end a step
    assert tried >= 60 and inside_a_step >= 50, (tried, inside_a_step)
    assert speculative.total_stats.mean_acceptance_length > 3  # drafts really were accepted in big steps


def test_of_several_stop_strings_the_first_completed_wins_as_in_plain_decoding(target_model):
    """A long stop string that starts earlier but completes later than a short one inside it: token by
    token the short one is seen first, so a whole accepted draft must be cut there too."""
    plain, speculative = engines(target_model)
    full = letters(plain.generate(PROMPT, NO_EOS).tokens)
    checked = 0
    for start in range(30):
        long, short = full[start : start + 8], full[start + 3 : start + 5]
        if full.find(long) != start or full.find(short) != start + 3:
            continue
        params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, stop=(long, short))
        a, b = plain.generate(PROMPT, params), speculative.generate(PROMPT, params)
        assert a.text == full[: start + 3] and a.tokens == b.tokens and a.text == b.text, start
        checked += 1
    assert checked >= 10


def test_eos_after_a_stop_string_in_the_same_step_is_not_generated(target_model):
    plain, speculative = engines(target_model)
    reference = plain.generate(PROMPT, NO_EOS).tokens
    stop = letters(reference)[4:6]  # completes in token 2; make token 4 an EOS, in the same 7-token step
    for engine in (plain, speculative):
        engine.target.eos_token_ids = frozenset({reference[4]})
        result = engine.generate(PROMPT, SamplingParams(max_tokens=LENGTH, stop=(stop,)))
        assert result.tokens == reference[:3] and result.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# A draft that cannot read every id of the target


def _backend(model, tokenizer=None, name="m"):
    return TransformersBackend(model, tokenizer, name=name, max_context=128)


def test_draft_with_a_smaller_embedding_table_is_refused_at_load():
    big, small = tiny_qwen2(seed=0, layers=1, vocab=120), tiny_qwen2(seed=1, layers=1)
    with pytest.raises(VocabMismatchError, match=r"'draft' can only read token ids below 97.*23 ids from 97"):
        check_vocab_compatible(_backend(big, name="target"), _backend(small, name="draft"))
    # The target's tokenizer names all 120 ids, the draft's only the first 97 (same strings): still refused.
    with pytest.raises(VocabMismatchError, match="below 97"):
        check_vocab_compatible(_backend(big, tiny_tokenizer(120)), _backend(small, tiny_tokenizer(97)))
    # Padding rows: the target scores 120 ids but has tokens for 97 only, all of which the draft reads.
    check_vocab_compatible(_backend(big, tiny_tokenizer(97)), _backend(small, tiny_tokenizer(97)))
    # Same embedding rows, a smaller draft head: the draft reads everything and proposes a subset.
    pruned = tiny_qwen2(seed=2, layers=1, vocab=120)
    pruned.lm_head = torch.nn.Linear(64, 97, bias=False)
    check_vocab_compatible(_backend(big, name="target"), _backend(pruned, name="draft"))


@pytest.mark.parametrize("drafter", ["draft_model", "hybrid"])
def test_a_prompt_id_the_draft_cannot_embed_gives_plain_steps_not_a_crash(drafter):
    target = _backend(tiny_qwen2(seed=0, layers=2, vocab=120), name="target")
    draft = _backend(tiny_qwen2(seed=1, layers=1), name="draft")  # 97 rows: id 110 is a padding id to it
    spec = SpecConfig(num_speculative_tokens=4, drafter=drafter)
    engine = SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    readable = engine.generate([5, 6, 7], params)
    assert readable.stats.num_drafts > 0  # the control: with readable ids it drafts
    prompt = [5, 110, 7]
    expected = plain_engine(target).generate(prompt, params).tokens
    result = engine.generate(prompt, params)
    assert result.tokens == expected
    assert_cache_keeps(engine, prompt, result.tokens)


def test_a_target_generated_id_the_draft_cannot_embed_stops_drafting():
    """The target (an exact Markov chain over 120 ids) walks 5 -> 6 -> ... -> 9 -> 110 -> 5; the draft
    model has 97 embedding rows. Drafting runs until 110 is emitted, then the request continues plainly."""
    table = torch.full((120, 120), -10.0)
    walk = {5: 6, 6: 7, 7: 8, 8: 9, 9: 110}
    for token in range(120):
        table[token, walk.get(token, 5)] = 10.0
    target = MarkovBackend(table, max_context=128)
    draft = _backend(tiny_qwen2(seed=1, layers=1), name="draft")
    spec = SpecConfig(num_speculative_tokens=3)
    engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
    result = engine.generate([5], SamplingParams(max_tokens=20, ignore_eos=True))
    assert result.tokens == ([6, 7, 8, 9, 110, 5] * 4)[:20]
    assert result.stats.num_drafts >= 1
    steps_after = result.stats.num_target_forwards - result.stats.num_drafts
    assert steps_after >= 20 - result.tokens.index(110) - 1  # one token per plain step after 110


@pytest.mark.parametrize("extra", ["tokens", "padding"])
def test_llamacpp_draft_with_fewer_tokens(tmp_path, monkeypatch, extra):
    """A target GGUF with 4 more ids than its draft: refused if they are tokens, allowed if they are the
    "[PAD<id>]" placeholders llama.cpp's converter writes for padding rows (Qwen2.5-7B vs 0.5B)."""
    pytest.importorskip("llama_cpp")
    import tiny_gguf
    from specdec.backends.llamacpp.backend import LlamaCppBackend

    draft_path = tiny_gguf.write_tiny_gguf(tmp_path / "draft.gguf", seed=1, layers=1)
    base = tiny_gguf.vocabulary

    def with_extra_ids(fim: bool = False, tools: bool = False):
        tokens, types, merges = base(fim, tools)
        first = len(tokens)
        if extra == "tokens":
            return tokens + [f"extra{i}" for i in range(4)], types + [1] * 4, merges
        return tokens + [f"[PAD{first + i}]" for i in range(4)], types + [5] * 4, merges  # 5: UNUSED

    monkeypatch.setattr(tiny_gguf, "vocabulary", with_extra_ids)
    target_path = tiny_gguf.write_tiny_gguf(tmp_path / "target.gguf", seed=0, layers=1)
    target = LlamaCppBackend(target_path, name="target", max_context=64)
    draft = LlamaCppBackend(draft_path, name="draft", max_context=64)
    try:
        assert target.vocab_size == draft.vocab_size + 4
        if extra == "tokens":
            with pytest.raises(VocabMismatchError, match=f"below {draft.vocab_size}.*4 ids"):
                check_vocab_compatible(target, draft)
            return
        check_vocab_compatible(target, draft)
        # Should the target ever produce a padding id, drafting stops instead of feeding it to the draft.
        spec = SpecConfig(num_speculative_tokens=3)
        engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec)
        prompt = [40, target.vocab_size - 1, 41]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        assert engine.generate(prompt, params).tokens == plain_engine(target).generate(prompt, params).tokens
    finally:
        target.close()
        draft.close()


# ---------------------------------------------------------------------------------------------
# What batching changes on the torch backend (docs/how-it-works.md, "Greedy identity")


def _rows_batched_and_alone(layer, rows: torch.Tensor):
    with torch.no_grad():
        return layer(rows), torch.cat([layer(rows[i : i + 1]) for i in range(rows.shape[0])])


def test_int8_linear_rows_are_bit_identical_alone_or_batched_and_fp32_only_close():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 97)
    rows = torch.randn(6, 64) * 3
    batched, alone = _rows_batched_and_alone(RowExactInt8Linear(linear), rows)
    assert torch.equal(batched, alone)
    for fp32 in (linear, PackedFp32Linear(linear)):
        batched, alone = _rows_batched_and_alone(fp32, rows)
        torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_format", ["fp32", "int8"])
def test_torch_verification_rows_agree_with_one_token_decoding_within_rounding(weight_format):
    """The claim docs make for the torch target: a (k+1)-token verification pass gives each row's logits
    within kernel rounding (not bit for bit) of one-token decoding, so greedy output can only differ
    where two logits are that close (a near-tie)."""
    model = apply_weight_format(tiny_qwen2(seed=4, layers=2), weight_format)
    backend = TransformersBackend(model, name=weight_format, max_context=64)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    cache = backend.new_cache()
    backend.forward(tokens[:2], cache)
    batched = backend.forward(tokens[2:], cache, num_logits=5)
    cache = backend.new_cache()
    backend.forward(tokens[:2], cache)
    alone = torch.stack([backend.forward([t], cache)[0] for t in tokens[2:]])
    scale = alone.abs().max()
    assert (batched - alone).abs().max() <= 1e-4 * scale
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))  # these logits are peaked: no near-tie here
