"""The speculative decode loop against independent references.

Greedy: the output must equal transformers' own `generate(do_sample=False)` of the target (not our
plain loop, which shares code with the engine), for tiny Qwen2 and Llama targets, several prompts
and k in {1, 3, 5}, with drafts that are partly accepted so the rollback path runs. Sampled: the
empirical distribution of the first tokens must equal the exact target distribution (chi-square),
using a fast prefix-dependent mock LM (with an always-accept negative control). Plus EOS / max_tokens /
stop strings falling inside a draft, request validation, seeds, the cache invariant after every
chunk, abandoning a stream, statistics vs from_draft flags, and the drafter's own rollback (its
proposals and q rows must match the draft model on the engine's context after partial acceptance).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import zlib
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import assert_cache_keeps, tiny_llama
from markov_backend import MarkovCache
from specdec.backends.base import ModelBackend
from specdec.backends.kvcache import ContextOverflowError
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.core.sampling import probabilities
from specdec.core.verify import Verdict
from specdec.drafters import create_drafter
from specdec.engine import scheduler as engine_module  # the step code lives there
from specdec.engine.single import SpeculativeEngine, plain_engine

PROMPTS = [[5, 6, 7, 8, 9], [11, 42, 17], [60], [20, 21, 22, 23, 24, 25, 26, 27]]
NEW_TOKENS = 24


def perturbed_copy(model, scale: float, seed: int):
    """A draft that agrees with the target often but not always: the target plus small weight noise."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std())
    return draft


class Family:
    """A target model, a perturbed draft and transformers' greedy references, built once per module."""

    def __init__(self, target, draft_scale: float):
        self.target = target
        self.draft = perturbed_copy(target, draft_scale, seed=1)
        self._references: dict[tuple, list[int]] = {}

    def reference(self, prompt: Sequence[int], new_tokens: int = NEW_TOKENS, eos: int | None = None) -> list[int]:
        """transformers' greedy generate: the independent reference (stops after EOS like we do)."""
        key = (tuple(prompt), new_tokens, eos)
        if key not in self._references:
            kwargs = {"eos_token_id": eos} if eos is not None else {}
            out = self.target.generate(
                torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0, **kwargs
            )
            self._references[key] = out[0, len(prompt) :].tolist()
        return self._references[key]

    def backends(self, max_context: int = 256):
        return (
            TransformersBackend(self.target, name="target", max_context=max_context),
            TransformersBackend(self.draft, name="draft", max_context=max_context),
        )


@pytest.fixture(scope="module")
def qwen(target_model):
    return Family(target_model, draft_scale=0.05)


@pytest.fixture(scope="module")
def llama():
    return Family(tiny_llama(seed=0), draft_scale=0.2)


@pytest.fixture(scope="module", params=["qwen", "llama"])
def family(request):
    return request.getfixturevalue(request.param)


def spec_engine(target_backend, draft_backend, k: int, **spec_kwargs) -> SpeculativeEngine:
    spec = SpecConfig(num_speculative_tokens=k, **spec_kwargs)
    return SpeculativeEngine(target_backend, create_drafter("draft_model", draft_backend=draft_backend, spec=spec), spec)


def collect(engine: SpeculativeEngine, prompt, params, check_invariant: bool = True):
    """Stream a request, checking after every chunk that the target cache holds all emitted tokens but the last."""
    chunks, generated = [], 0
    for chunk in engine.stream(prompt, params):
        chunks.append(chunk)
        generated += len(chunk.tokens)
        if check_invariant:
            assert engine.cache.length == len(prompt) + generated - 1, (engine.cache.length, len(prompt), generated)
            drafter_cache = getattr(engine.drafter, "cache", None)
            if drafter_cache is not None and chunk.finish_reason is None:
                # the draft cache holds a prefix of the context (it may run past an EOS on the last chunk)
                assert drafter_cache.length <= len(prompt) + generated
    return chunks


def tokens_of(chunks):
    return [t for c in chunks for t in c.tokens]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS)


# ---------------------------------------------------------------------------------------------
# Greedy equals transformers' generate


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_transformers_generate(family, k):
    target, draft = family.backends()
    engine = spec_engine(target, draft, k)  # one engine for every prompt: reuse must not leak state
    accepted = drafted = 0
    for prompt in PROMPTS:
        chunks = collect(engine, prompt, GREEDY)
        assert tokens_of(chunks) == family.reference(prompt), prompt
        stats = engine.last_stats
        accepted += stats.num_accepted_tokens
        drafted += stats.num_draft_tokens
    # The rollback path must actually have run: some drafts rejected, some accepted.
    assert 0 < accepted < drafted


def test_plain_engine_equals_transformers_generate(family):
    target, _ = family.backends()
    engine = plain_engine(target)
    for prompt in PROMPTS:
        result = engine.generate(prompt, GREEDY)
        assert result.tokens == family.reference(prompt), prompt
        assert result.stats.num_draft_tokens == 0 and result.stats.mean_acceptance_length == 1.0
        assert result.stats.num_target_forwards == len(result.tokens) - 1  # the first token: the prefill's pass
        assert result.from_draft == [False] * len(result.tokens)


def test_unrelated_draft_still_gives_target_output(qwen, draft_backend):
    target, _ = qwen.backends()
    engine = spec_engine(target, draft_backend, 4)
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, GREEDY).tokens == qwen.reference(prompt)


@pytest.mark.parametrize("spec_kwargs", [{"k_policy": "heuristic"}, {"draft_p_min": 0.6}], ids=["heuristic", "p_min"])
def test_greedy_other_policies_equal_reference(qwen, spec_kwargs):
    target, draft = qwen.backends()
    engine = spec_engine(target, draft, 3, **spec_kwargs)
    for prompt in PROMPTS[:3]:
        assert tokens_of(collect(engine, prompt, GREEDY)) == qwen.reference(prompt)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_same_model_as_draft_accepts_everything(llama, k):
    target, _ = llama.backends()
    self_draft = TransformersBackend(llama.target, name="self", max_context=256)
    engine = spec_engine(target, self_draft, k)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    result = engine.generate(PROMPTS[0], params)
    assert result.tokens == llama.reference(PROMPTS[0])
    assert result.stats.acceptance_rate == 1.0
    # The prefill's pass gives the first token; then every step emits k drafted tokens plus the bonus (the last
    # step's draft is cut to what max_tokens leaves).
    steps = -(-(NEW_TOKENS - 1) // (k + 1))
    assert result.stats.num_target_forwards == steps
    assert result.stats.num_accepted_tokens == NEW_TOKENS - 1 - steps


def test_context_limit_clips_the_draft(qwen):
    """With the cache exactly prompt + max_tokens long, k must shrink near the end, output unchanged."""
    prompt, n = PROMPTS[0], 12
    target, draft = qwen.backends(max_context=len(prompt) + n)
    engine = spec_engine(target, draft, 5)
    assert engine.generate(prompt, SamplingParams(max_tokens=n)).tokens == qwen.reference(prompt)[:n]
    with pytest.raises(ContextOverflowError):
        engine.stream(prompt, SamplingParams(max_tokens=n + 1))


# ---------------------------------------------------------------------------------------------
# EOS, max_tokens and stop strings inside a draft


def _first_occurrences(tokens: Sequence[int], limit: int) -> list[int]:
    return [j for j in range(min(limit, len(tokens))) if tokens[j] not in tokens[:j]]


@pytest.mark.parametrize("draft_kind", ["self", "perturbed"])
def test_eos_inside_a_draft_stops_right_after_it(llama, draft_kind):
    prompt, k = PROMPTS[2], 3
    reference = llama.reference(prompt)
    positions = _first_occurrences(reference, 8)
    # the prefill gives token 0; then with a self draft and k=3, positions 1,2,3 are drafted tokens and 4 is the
    # bonus: cover both
    assert any(j > 0 and (j - 1) % (k + 1) != k for j in positions)
    assert any(j > 0 and (j - 1) % (k + 1) == k for j in positions)
    for j in positions:
        eos = reference[j]
        target, draft = llama.backends()
        target.eos_token_ids = frozenset({eos})
        if draft_kind == "self":
            draft = TransformersBackend(llama.target, name="self", max_context=256)
        engine = spec_engine(target, draft, k)
        chunks = collect(engine, prompt, GREEDY)
        tokens = tokens_of(chunks)
        assert tokens == reference[: j + 1], j
        assert tokens == llama.reference(prompt, eos=eos)  # transformers agrees on where EOS stops
        assert chunks[-1].finish_reason == "stop"
        assert all(c.finish_reason is None for c in chunks[:-1])
        flags = [f for c in chunks for f in c.from_draft]
        assert len(flags) == len(tokens)
        if draft_kind == "self":
            assert flags == [False] + [i % (k + 1) != k for i in range(j)]
        # Like vLLM, statistics describe the verifier: draft tokens it accepted after the EOS still count.
        assert sum(flags) <= engine.last_stats.num_accepted_tokens
        assert engine.last_stats.num_generated_tokens == j + 1
        # the EOS token is not shown as text
        text = "".join(c.text for c in chunks)
        assert text == " ".join(str(t) for t in reference[:j])
        assert_cache_keeps(engine, prompt, tokens)  # what is left: the request's tokens, for the next one


def test_ignore_eos_generates_past_eos(llama):
    prompt = PROMPTS[2]
    reference = llama.reference(prompt)
    target, draft = llama.backends()
    target.eos_token_ids = frozenset({reference[1]})
    result = spec_engine(target, draft, 3).generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    assert result.tokens == reference[:10] and result.finish_reason == "length"


def test_max_tokens_inside_a_draft_gives_the_exact_length(llama):
    prompt = PROMPTS[0]
    reference = llama.reference(prompt)
    assert 3 not in reference[:9]
    self_draft = TransformersBackend(llama.target, name="self", max_context=256)
    target, draft = llama.backends()
    for m in range(1, 9):
        for d in (self_draft, draft):
            engine = spec_engine(target, d, 5)
            chunks = collect(engine, prompt, SamplingParams(max_tokens=m))
            assert tokens_of(chunks) == reference[:m], m
            assert chunks[-1].finish_reason == "length"
            assert engine.last_stats.num_generated_tokens == m


def _two_letters(token: int) -> str:
    return chr(ord("a") + token % 26) + chr(ord("a") + (token * 7 + 3) % 26)


def letters(ids: Sequence[int]) -> str:
    return "".join(_two_letters(int(t)) for t in ids)


@pytest.mark.parametrize("draft_kind", ["self", "perturbed"])
def test_stop_string_across_a_chunk_boundary_is_never_shown(llama, draft_kind):
    prompt, k = PROMPTS[2], 3
    full = letters(llama.reference(prompt))
    # The first chunk is the prefill's token (2 characters); then with a self draft each chunk is 4 tokens = 8
    # characters. Start the stop string at character 9 (the second half of the last token of chunk 1) so it
    # spans the boundary into chunk 2.
    start = 9
    stop = full[start : start + 4]
    assert full.find(stop) == start, "pick another start: the stop string occurs earlier"
    target, draft = llama.backends()
    if draft_kind == "self":
        draft = TransformersBackend(llama.target, name="self", max_context=256)
    spec = SpecConfig(num_speculative_tokens=k)
    engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec, decode=letters)
    shown = ""
    chunks = []
    for chunk in engine.stream(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop=("zzzz", stop))):
        chunks.append(chunk)
        shown += chunk.text
        assert full[:start].startswith(shown), f"streamed {shown!r} goes past the cut {full[:start]!r}"
    assert shown == full[:start]
    assert chunks[-1].finish_reason == "stop"
    if draft_kind == "self":
        assert chunks[0].text + chunks[1].text == full[:start]  # the first half of the stop string was held back
    result = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop=(stop,)))
    assert result.text == full[:start] and result.finish_reason == "stop"
    assert_cache_keeps(engine, prompt, result.tokens)  # the tokens end at the stop: so does the cache


def test_stop_string_that_never_appears_changes_nothing(qwen):
    prompt = PROMPTS[1]
    target, draft = qwen.backends()
    spec = SpecConfig(num_speculative_tokens=3)
    engine = SpeculativeEngine(target, create_drafter("draft_model", draft_backend=draft, spec=spec), spec, decode=letters)
    result = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, stop=("@@",)))
    assert result.tokens == qwen.reference(prompt)
    assert result.text == letters(qwen.reference(prompt))
    assert result.finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# Request validation


def test_empty_prompt_is_refused(qwen):
    target, draft = qwen.backends()
    with pytest.raises(ValueError, match="empty"):
        spec_engine(target, draft, 3).stream([], GREEDY)


def test_prompt_outside_vocab_is_refused(qwen):
    target, draft = qwen.backends()
    with pytest.raises(ValueError, match="vocabulary"):
        spec_engine(target, draft, 3).stream([1, 2, 10_000], GREEDY)


@pytest.mark.parametrize("prompt_len,max_tokens", [(70, 1), (60, 5), (64, 1)])
def test_context_overflow_is_refused_before_any_work(qwen, prompt_len, max_tokens):
    target, draft = qwen.backends(max_context=64)
    engine = spec_engine(target, draft, 3)
    with pytest.raises(ContextOverflowError, match="context"):
        engine.stream([5] * prompt_len, SamplingParams(max_tokens=max_tokens))
    assert target.forward_calls == 0 and draft.forward_calls == 0
    assert engine.cache is None


# ---------------------------------------------------------------------------------------------
# Seeds, invariants, abandoning a stream, statistics


def test_same_seed_same_output_different_seeds_differ(qwen):
    target, draft = qwen.backends()
    engine = spec_engine(target, draft, 3)

    def run(seed):
        return collect(engine, PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=seed, ignore_eos=True))

    a, b, c = tokens_of(run(123)), tokens_of(run(123)), tokens_of(run(124))
    assert a == b
    assert a != c
    # a fresh engine on fresh backends reproduces the seeded run too
    target2, draft2 = qwen.backends()
    fresh = spec_engine(target2, draft2, 3).generate(
        PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=123, ignore_eos=True)
    )
    assert fresh.tokens == a


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cache_invariant_after_every_chunk(llama, temperature):
    target, draft = llama.backends()
    engine = spec_engine(target, draft, 4)
    for seed, prompt in enumerate(PROMPTS):
        chunks = collect(engine, prompt, SamplingParams(temperature=temperature, max_tokens=20, seed=seed))
        assert sum(len(c.tokens) for c in chunks) <= 20


def test_abandoned_stream_leaves_caches_consistent_and_engine_reusable(llama):
    prompt = PROMPTS[1]
    params_list = [GREEDY, SamplingParams(temperature=0.9, top_k=20, max_tokens=NEW_TOKENS, seed=5)]
    for params in params_list:
        target, draft = llama.backends()
        engine = spec_engine(target, draft, 3)
        expected = engine.generate(prompt, params).tokens
        stream = engine.stream(PROMPTS[3], params)
        emitted = next(stream).tokens + next(stream).tokens
        assert engine.cache.length > 0 and engine.drafter.cache.length > 0
        stream.close()
        # The caches keep what the abandoned request had made consistent: its prompt and emitted tokens.
        assert_cache_keeps(engine, PROMPTS[3], emitted)
        assert engine.generate(prompt, params).tokens == expected
    # and a consumer that raises mid-stream
    target, draft = llama.backends()
    engine = spec_engine(target, draft, 3)
    emitted = []
    with pytest.raises(RuntimeError):
        for chunk in engine.stream(PROMPTS[3], GREEDY):
            emitted += chunk.tokens
            raise RuntimeError("client went away")
    assert_cache_keeps(engine, PROMPTS[3], emitted)
    assert engine.generate(prompt, GREEDY).tokens == llama.reference(prompt)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_from_draft_flags_agree_with_stats(qwen, temperature):
    target, draft = qwen.backends()
    engine = spec_engine(target, draft, 3)
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=temperature, max_tokens=NEW_TOKENS, seed=seed, ignore_eos=True)
        chunks = collect(engine, prompt, params)
        stats = engine.last_stats
        flags = [f for c in chunks for f in c.from_draft]
        assert chunks[0].from_draft == [False]  # the prefill's pass gives the first token
        for c in chunks:  # each step: some accepted draft tokens, then one target token
            assert len(c.from_draft) == len(c.tokens)
            assert c.from_draft == [True] * (len(c.tokens) - 1) + [False]
        assert sum(flags) == stats.num_accepted_tokens
        assert flags.count(False) == stats.num_target_forwards + 1 == len(chunks)
        assert len(flags) == stats.num_generated_tokens == NEW_TOKENS
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
        assert stats.num_drafts_per_pos[0] == stats.num_drafts
        assert sum(stats.num_drafts_per_pos) == stats.num_draft_tokens
        assert stats.num_prompt_tokens == len(prompt)
        assert stats.acceptance_rate == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens)


def test_total_stats_accumulate_across_requests(qwen):
    target, draft = qwen.backends()
    engine = spec_engine(target, draft, 3)
    results = [engine.generate(p, GREEDY) for p in PROMPTS[:2]]
    total = engine.total_stats
    assert total.num_generated_tokens == sum(len(r.tokens) for r in results)
    assert total.num_accepted_tokens == sum(r.stats.num_accepted_tokens for r in results)


# ---------------------------------------------------------------------------------------------
# Sampled distribution at engine level (fast mock LM whose logits depend on the whole prefix)


# A token-list cache: the prefix LM below needs exactly what the Markov test backend's cache does.
PrefixCache = MarkovCache


class PrefixLM(ModelBackend):
    """A ModelBackend whose next-token logits are a fixed pseudo-random function of the entire prefix.

    Any cache bookkeeping error (a stale draft token left in, a token missing) changes the prefix and
    therefore the distribution, so the distribution test also checks the rollback.
    """

    def __init__(self, vocab: int, seed: int, scale: float = 1.5, base: PrefixLM | None = None,
                 max_context: int = 64):
        self.vocab_size = vocab
        self.seed = seed
        self.scale = scale
        self.base = base
        self.max_context = max_context
        self.eos_token_ids = frozenset()
        self.forward_calls = 0
        self._memo: dict[tuple, torch.Tensor] = {}

    def logits(self, prefix: Sequence[int]) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self._memo:
            seed = zlib.crc32(np.array([self.seed, *key], dtype=np.int64).tobytes())
            row = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(seed)) * self.scale
            if self.base is not None:
                row = self.base.logits(key) + row
            self._memo[key] = row
        return self._memo[key]

    def new_cache(self, capacity: int | None = None) -> PrefixCache:
        return PrefixCache(capacity or self.max_context)

    def forward(self, tokens, cache: PrefixCache, num_logits: int = 1) -> torch.Tensor:
        if cache.length + len(tokens) > cache.capacity:
            raise ContextOverflowError("prefix cache full")
        self.forward_calls += 1
        start = cache.length
        cache.tokens.extend(int(t) for t in tokens)
        rows = [self.logits(cache.tokens[: start + i + 1]) for i in range(len(tokens))]
        return torch.stack(rows[-num_logits:])


def exact_sequence_distribution(model: PrefixLM, prompt, params: SamplingParams, length: int) -> np.ndarray:
    """P(first `length` tokens) under the target with the sampling transform, over all V^length sequences."""
    v = model.vocab_size
    out = np.zeros([v] * length)
    for seq in itertools.product(range(v), repeat=length):
        prob = 1.0
        for i, token in enumerate(seq):
            prob *= float(probabilities(model.logits(list(prompt) + list(seq[:i])), params)[token])
            if prob == 0.0:
                break
        out[seq] = prob
    return out.reshape(-1)


def sample_sequences(engine, prompt, params: SamplingParams, draws: int, length: int, vocab: int) -> np.ndarray:
    counts = np.zeros(vocab**length, dtype=np.int64)
    for seed in range(draws):
        tokens = engine.generate(prompt, dataclasses.replace(params, seed=seed)).tokens
        assert len(tokens) == length
        counts[np.ravel_multi_index(tokens, [vocab] * length)] += 1
    return counts


def chi_square_p(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    exact = exact / exact.sum()
    assert not ((exact == 0) & (counts > 0)).any(), "a sequence with probability 0 was emitted"
    n = counts.sum()
    expected = exact * n
    big = expected >= 5
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    tv = 0.5 * np.abs(counts / n - exact).sum()
    return float(chisquare(obs, exp).pvalue), tv


SAMPLED = SamplingParams(temperature=0.9, top_k=3, max_tokens=3, ignore_eos=True)
ENGINE_DRAWS = 4000


@pytest.fixture(scope="module")
def prefix_pair():
    target = PrefixLM(vocab=4, seed=11)
    draft = PrefixLM(vocab=4, seed=12, scale=1.2, base=target)  # correlated with the target, not equal
    exact = exact_sequence_distribution(target, [1, 2], SAMPLED, 3)
    return target, draft, exact


def test_speculative_sampling_matches_target_distribution(prefix_pair):
    """First three tokens (k=3, clipped to 2 by max_tokens) jointly follow the target, top-k included."""
    target, draft, exact = prefix_pair
    engine = spec_engine(target, draft, 3)
    counts = sample_sequences(engine, [1, 2], SAMPLED, ENGINE_DRAWS, 3, 4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert tv < 0.06, tv
    stats = engine.total_stats
    assert 0.2 < stats.acceptance_rate < 0.95  # the draft really differs from the target


def test_draft_with_a_smaller_vocabulary_is_lossless(prefix_pair):
    """A draft scoring fewer ids than the target never proposes the missing ids; its q must be treated
    as 0 there, and the output still follows the target. (This mock has no embedding table, so once the
    target emits id 3 the drafter stops drafting for the request; load_pair would refuse such a pair.)"""
    target, _, exact = prefix_pair
    small_draft = PrefixLM(vocab=3, seed=13)
    engine = spec_engine(target, small_draft, 3)
    counts = sample_sequences(engine, [1, 2], SAMPLED, 2000, 3, 4)
    p_value, tv = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, tv)
    assert engine.total_stats.num_accepted_tokens > 0
    greedy = spec_engine(target, small_draft, 3).generate([1, 2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert greedy.tokens == plain_engine(target).generate([1, 2], SamplingParams(max_tokens=6, ignore_eos=True)).tokens


def test_engine_level_negative_control(prefix_pair, monkeypatch):
    """The same test rejects an engine whose verifier always accepts the draft."""
    target, draft, exact = prefix_pair

    def always_accept(tokens, draft_probs, target_probs, generator):
        from specdec.core.sampling import sample_token

        return Verdict(len(tokens), sample_token(target_probs[len(tokens)], generator), True)

    monkeypatch.setattr(engine_module, "verify_sampled", always_accept)
    counts = sample_sequences(spec_engine(target, draft, 3), [1, 2], SAMPLED, 1500, 3, 4)
    p_value, tv = chi_square_p(counts, exact) if not ((exact == 0) & (counts > 0)).any() else (0.0, 1.0)
    assert p_value < 1e-6, (p_value, tv)


def test_mock_greedy_matches_argmax_chain(prefix_pair):
    """On the mock, greedy speculative output is the argmax chain of the target (rollback is exact)."""
    _target, _draft, _ = prefix_pair
    wide_target = PrefixLM(vocab=50, seed=21)
    wide_draft = PrefixLM(vocab=50, seed=22, scale=0.8, base=wide_target)
    prompt = [3, 1, 4]
    expected, context = [], list(prompt)
    for _ in range(30):
        token = int(torch.argmax(wide_target.logits(context)))
        expected.append(token)
        context.append(token)
    for k in (1, 2, 5, 8):
        engine = spec_engine(wide_target, wide_draft, k)
        chunks = collect(engine, prompt, SamplingParams(max_tokens=30))
        assert tokens_of(chunks) == expected, k
        assert 0 < engine.last_stats.num_accepted_tokens < engine.last_stats.num_draft_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_proposals_follow_the_draft_model_after_rollbacks(temperature, monkeypatch):
    """Output is lossless whatever the drafter does, so check the drafter itself: after every partial
    acceptance its cache must be rolled back so that each proposal (and each q row) is exactly what
    the draft model gives on the engine's context."""
    target = PrefixLM(vocab=30, seed=31)
    draft = PrefixLM(vocab=30, seed=32, scale=0.7, base=target)
    engine = spec_engine(target, draft, 4)
    params = SamplingParams(temperature=temperature, max_tokens=40, seed=9, ignore_eos=True)
    calls = []
    original = engine.drafter.propose

    def recording_propose(context, k):
        result = original(context, k)
        calls.append((list(context), list(result.tokens), result.probs))
        return result

    monkeypatch.setattr(engine.drafter, "propose", recording_propose)
    engine.generate([7, 8, 9], params)
    stats = engine.last_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # partial acceptance happened
    assert len(calls) == stats.num_drafts
    for context, tokens, probs in calls:
        prefix = list(context)
        for i, token in enumerate(tokens):
            logits = draft.logits(prefix)
            if temperature == 0.0:
                assert token == int(torch.argmax(logits)), (context, tokens, i)
            else:
                assert torch.equal(probs[i], probabilities(logits, params)), (context, tokens, i)
            prefix.append(token)


def test_draft_with_a_shorter_context_falls_back_to_plain_steps(qwen):
    """When the draft's cache is full the drafter proposes nothing and the engine decodes plainly."""
    prompt = PROMPTS[0]
    target, _ = qwen.backends()
    short_draft = TransformersBackend(qwen.draft, name="short", max_context=12)
    engine = spec_engine(target, short_draft, 3)
    chunks = collect(engine, prompt, GREEDY)
    assert tokens_of(chunks) == qwen.reference(prompt)
    stats = engine.last_stats
    assert stats.num_drafts > 0 and stats.num_target_forwards > stats.num_drafts  # some plain steps at the end
    assert_cache_keeps(engine, prompt, tokens_of(chunks))
    assert engine.drafter.cache.length <= engine.drafter.cache.capacity
