"""Prefix reuse across requests: a request keeps what the caches hold in common with its prompt and prefills the rest.

- Counts: with a backend that records every forward, a request that shares a prefix with the last one runs
  the target (and the draft model) over exactly the tokens a cold run would, minus the kept prefix.
- Outputs: every request gives what a cold engine gives (a chat continued, a shared system prompt, an
  identical prompt, a strict prefix of the cache, nothing shared, after an abandoned or failed stream);
  on a tiny torch model and on a counting LM whose logits depend on the whole prefix, so a cache that
  holds one wrong token changes the output.
- Exactness: a batch-invariant llama.cpp target never reuses (the full prompt is prefilled each time);
  the same model in fast mode does.
- Negative controls: a reuse that keeps one token too many is caught by both the counts and the outputs;
  a prefix kept by one engine on a llama.cpp backend would take the room another engine needs.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_cache_keeps
from markov_backend import MarkovBackend, MarkovCache
from specdec.backends import kvcache
from specdec.backends.base import ModelBackend, forward_rows
from specdec.backends.kvcache import ContextOverflowError, common_prefix_length
from specdec.backends.pytorch.backend import TransformersBackend
from specdec.config import SamplingParams, SpecConfig
from specdec.drafters import create_drafter
from specdec.engine.single import SpeculativeEngine, plain_engine

VOCAB = 40


class HashCache(MarkovCache):
    """A token-list cache that also keeps a running hash of every prefix."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.hashes: list[int] = []

    def trim(self, n: int) -> int:
        n = super().trim(n)
        del self.hashes[len(self.tokens):]
        return n


class HashLM(ModelBackend):
    """Next-token logits = a Markov table row + a pseudo-random row chosen by a hash of the whole prefix.

    A cache that holds a wrong token (or misses one) changes every later hash and so the output; every
    forward is recorded (calls and their tokens), which is what prefix reuse must reduce.
    """

    def __init__(self, seed: int, mix: float = 2.0, max_context: int = 256, base: "HashLM | None" = None):
        g = torch.Generator().manual_seed(seed)
        self.table = base.table if base is not None else torch.randn(VOCAB, VOCAB, generator=g) * 3
        self.rows = torch.randn(997, VOCAB, generator=g) * mix
        self.vocab_size = VOCAB
        self.max_context = max_context
        self.eos_token_ids = frozenset()
        self.calls: list[list[int]] = []

    @property
    def forward_tokens(self) -> int:
        return sum(len(c) for c in self.calls)

    def new_cache(self, capacity: int | None = None) -> HashCache:
        return HashCache(capacity or self.max_context)

    def forward(self, tokens, cache: HashCache, num_logits: int = 1) -> torch.Tensor:
        tokens = [int(t) for t in tokens]
        num_logits = forward_rows(tokens, cache, num_logits, "hash-lm")
        self.calls.append(tokens)
        rows = []
        for token in tokens:
            h = ((cache.hashes[-1] if cache.hashes else 17) * 1_000_003 + token) % 2_147_483_647
            cache.tokens.append(token)
            cache.hashes.append(h)
            rows.append(self.table[token] + self.rows[h % len(self.rows)])
        return torch.stack(rows[-num_logits:])


def hash_pair(max_context: int = 256):
    target = HashLM(seed=0, max_context=max_context)
    draft = HashLM(seed=1, mix=1.0, max_context=max_context, base=target)  # agrees with the target often
    return target, draft


def make_engine(target, draft, drafter: str, k: int = 4, prefix_cache: bool | None = None) -> SpeculativeEngine:
    if drafter == "none":
        return SpeculativeEngine(target, None, SpecConfig(drafter="none"), prefix_cache=prefix_cache)
    spec = SpecConfig(num_speculative_tokens=k, drafter=drafter)
    return SpeculativeEngine(target, create_drafter(drafter, draft_backend=draft, spec=spec), spec,
                             prefix_cache=prefix_cache)


def draft_model_of(engine):
    return getattr(engine.drafter, "model", engine.drafter)


GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=7)
SYSTEM = [1] + [(i * 7 + 5) % VOCAB for i in range(30)]  # a shared "system prompt"


def conversation(run) -> list[tuple[list[int], object]]:
    """Requests as a chat client sends them; `run(prompt)` returns a Generation. Returns (prompt, result) pairs."""
    out = []

    def ask(prompt):
        result = run(prompt)
        out.append((list(prompt), result))
        return result

    first = ask(SYSTEM + [20, 21, 22])
    second = ask(SYSTEM + [20, 21, 22] + first.tokens + [23, 24])  # the chat continues
    ask(SYSTEM + [20, 21, 22] + first.tokens + [23, 24] + second.tokens + [25])
    ask(SYSTEM + [30, 31])  # same system prompt, new conversation
    ask(SYSTEM + [30, 31])  # identical prompt
    ask(SYSTEM[:12])  # a strict prefix of what the cache holds
    ask([33, 34, 35, 36])  # nothing shared
    ask([33])  # one token: nothing to prefill at all
    ask(SYSTEM + [30, 31] + [2] * 5)
    return out


def check_reuse(drafter: str, params: SamplingParams) -> list[str]:
    """Run the conversation on a reusing engine and on a cold one (prefix_cache=False, on backends of its own
    with the same weights); return what went wrong: outputs differ, or the target or draft model forwards
    other tokens than the cold run's minus the kept prefix."""
    target, draft = hash_pair()
    cold_target, cold_draft = hash_pair()
    warm = make_engine(target, draft, drafter)
    cold = make_engine(cold_target, cold_draft, drafter, prefix_cache=False)
    requests = [p for p, _ in conversation(lambda p: make_engine(*hash_pair(), drafter).generate(p, params))]
    problems = []
    held: list[int] = []  # what the warm engine's target cache should hold
    for i, prompt in enumerate(requests):
        for backend in (target, draft, cold_target, cold_draft):
            backend.calls.clear()
        expected = cold.generate(prompt, params)
        result = warm.generate(prompt, params)
        cached = warm.last_stats.num_cached_prompt_tokens
        if result.tokens != expected.tokens:
            problems.append(f"request {i}: output {result.tokens} != cold {expected.tokens}")
            continue
        shared = common_prefix_length(held, prompt[:-1])
        if cached != shared:
            problems.append(f"request {i}: kept {cached} tokens, shared {shared}")
        if target.forward_tokens != cold_target.forward_tokens - cached:
            problems.append(f"request {i}: target forwarded {target.forward_tokens} tokens, cold "
                            f"{cold_target.forward_tokens} - kept {cached}")
        first_call = target.calls[0] if target.calls else []
        if first_call != prompt[cached:]:
            problems.append(f"request {i}: prefill {first_call} != the new suffix {prompt[cached:]}")
        model = draft_model_of(warm)
        if getattr(model, "retained", None) is not None:
            kept = model.num_cached_prompt_tokens
            if draft.forward_tokens != cold_draft.forward_tokens - kept:
                problems.append(f"request {i}: draft forwarded {draft.forward_tokens}, cold "
                                f"{cold_draft.forward_tokens} - kept {kept}")
        held = (prompt + result.tokens)[:-1]
        # The cold engine leaves nothing behind; the warm one keeps the request's tokens.
        if cold.cache.length != 0 or warm.cache.length != len(held) or warm.retained.tokens != held:
            problems.append(f"request {i}: caches after the request: cold {cold.cache.length}, "
                            f"warm {warm.cache.length} (expected {len(held)})")
    return problems


# ------------------------------------------------------------------------------------- counts (HashLM)


@pytest.mark.parametrize("drafter", ["none", "draft_model", "hybrid", "prompt_lookup"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_reuse_prefills_only_the_new_suffix_and_changes_no_output(drafter, params):
    assert check_reuse(drafter, params) == []


def test_a_continued_chat_prefills_only_what_follows_the_kept_tokens():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "none")
    prompt = SYSTEM + [20, 21, 22]
    first = engine.generate(prompt, GREEDY)
    assert first.stats.num_cached_prompt_tokens == 0 and target.calls[0] == prompt
    target.calls.clear()
    follow_up = prompt + first.tokens + [23, 24, 25]
    second = engine.generate(follow_up, GREEDY)
    # The cache held prompt + first.tokens[:-1]: the prefill is the last generated token and the new
    # text (its last row's logits give the first token), nothing else.
    assert second.stats.num_cached_prompt_tokens == len(prompt) + len(first.tokens) - 1
    assert target.calls[0] == [first.tokens[-1], 23, 24, 25]
    assert target.calls[1] == [second.tokens[0]]
    assert target.forward_tokens == 4 + len(second.tokens) - 1  # prefill, then one token per plain step
    assert second.stats.num_prompt_tokens == len(follow_up)
    assert engine.total_stats.num_cached_prompt_tokens == second.stats.num_cached_prompt_tokens


def test_the_draft_model_keeps_its_own_prefix():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "draft_model", k=3)
    prompt = SYSTEM + [20, 21, 22]
    first = engine.generate(prompt, GREEDY)
    model = engine.drafter
    assert model.num_cached_prompt_tokens == 0 and draft.calls[0] == prompt  # cold: the prompt's catch-up
    # What the draft cache holds is recorded exactly (the prompt, accepted tokens, unverified draft tail).
    assert model.cache.tokens == model.retained.tokens
    assert model.retained.tokens[: len(prompt)] == prompt
    held = list(model.retained.tokens)
    draft.calls.clear()
    follow_up = prompt + first.tokens + [23, 24, 25]
    engine.generate(follow_up, GREEDY)
    kept = model.num_cached_prompt_tokens
    assert kept == common_prefix_length(held, follow_up[:-1]) and len(prompt) < kept < len(follow_up)
    # The first catch-up fed only what follows the kept prefix, then the draft went on from there.
    fed = [t for c in draft.calls for t in c]
    assert fed[: len(follow_up) - kept] == follow_up[kept:]
    assert model.cache.tokens == model.retained.tokens
    # Off: the draft model starts from empty like the target.
    cold = make_engine(target, draft, "draft_model", k=3, prefix_cache=False)
    cold.generate(prompt, GREEDY)
    assert cold.drafter.cache.length == 0 and cold.drafter.prefix_cache is False
    draft.calls.clear()
    cold.generate(follow_up, GREEDY)
    assert cold.drafter.num_cached_prompt_tokens == 0 and draft.calls[0] == follow_up


def test_hybrid_passes_the_switch_to_its_draft_model():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "hybrid", prefix_cache=False)
    engine.generate(SYSTEM, GREEDY)
    assert engine.drafter.prefix_cache is False and engine.drafter.model.prefix_cache is False
    assert engine.drafter.model.cache is None or engine.drafter.model.cache.length == 0
    engine.prefix_cache = True  # the engine's switch is read per request
    engine.generate(SYSTEM, GREEDY)
    engine.generate(SYSTEM, GREEDY)
    assert engine.last_stats.num_cached_prompt_tokens == len(SYSTEM) - 1
    assert engine.drafter.model.num_cached_prompt_tokens > 0


def test_spec_field_turns_reuse_off():
    """SpecConfig's `prefix_cache` (when the config has it) is read by the engine; the argument wins."""
    target, _ = hash_pair()

    class Spec:
        prefix_cache = False
        num_speculative_tokens = 1
        k_policy = "fixed"
        drafter = "none"

    assert SpeculativeEngine(target, None, Spec()).prefix_cache is False
    assert SpeculativeEngine(target, None, Spec(), prefix_cache=True).prefix_cache is True
    assert SpeculativeEngine(target, None).prefix_cache is True


# ------------------------------------------------------------------------------------- abandoned / failed


@pytest.mark.parametrize("drafter", ["none", "draft_model"])
def test_abandoned_stream_then_a_request_that_extends_it(drafter):
    target, draft = hash_pair()
    engine = make_engine(target, draft, drafter)
    cold = make_engine(*hash_pair(), drafter, prefix_cache=False)  # backends of its own
    prompt = SYSTEM + [20, 21]
    stream = engine.stream(prompt, GREEDY)
    emitted = next(stream).tokens + next(stream).tokens
    stream.close()
    assert_cache_keeps(engine, prompt, emitted)
    follow_up = prompt + emitted + [5, 6]
    expected = cold.generate(follow_up, GREEDY).tokens
    result = engine.generate(follow_up, GREEDY)
    assert result.tokens == expected
    assert result.stats.num_cached_prompt_tokens == len(prompt) + len(emitted) - 1


def test_a_failed_forward_empties_the_cache_and_the_next_request_is_right():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "draft_model")
    cold = make_engine(*hash_pair(), "draft_model", prefix_cache=False)  # backends of its own
    engine.generate(SYSTEM, GREEDY)
    real_forward, calls = target.forward, [0]

    def failing(tokens, cache, num_logits=1):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("device lost")
        return real_forward(tokens, cache, num_logits)

    target.forward = failing
    with pytest.raises(RuntimeError):
        engine.generate(SYSTEM + [9, 9, 9], GREEDY)
    target.forward = real_forward
    assert engine.cache.length == 0 and engine.retained.tokens == []  # not certain: emptied
    result = engine.generate(SYSTEM + [9, 9, 9], GREEDY)
    assert result.stats.num_cached_prompt_tokens == 0
    assert result.tokens == cold.generate(SYSTEM + [9, 9, 9], GREEDY).tokens


def test_a_stream_collected_after_a_newer_request_leaves_its_caches_alone():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "draft_model")
    stale = engine.stream(SYSTEM, GREEDY)
    next(stale)  # abandoned without close(): its finally runs whenever it is collected
    result = engine.generate(SYSTEM + [4, 4], GREEDY)
    held = list(engine.retained.tokens)
    assert held == (SYSTEM + [4, 4] + result.tokens)[:-1]
    stale.close()  # now, after the newer request
    assert engine.retained.tokens == held and engine.cache.length == len(held)
    follow_up = SYSTEM + [4, 4] + result.tokens + [7]
    cold = make_engine(*hash_pair(), "draft_model", prefix_cache=False)  # backends of its own
    assert engine.generate(follow_up, GREEDY).tokens == cold.generate(follow_up, GREEDY).tokens


def test_calibration_and_outside_writes_are_not_trusted():
    target, draft = hash_pair()
    engine = make_engine(target, draft, "none")
    engine.generate(SYSTEM, GREEDY)
    engine.cache.trim(3)  # someone else rolled the cache back: the record no longer matches
    target.calls.clear()
    result = engine.generate(SYSTEM, GREEDY)
    assert result.stats.num_cached_prompt_tokens == 0 and target.calls[0] == SYSTEM
    engine.calibrate(sizes=[1, 2])
    assert engine.cache.length == 0 and engine.retained.tokens == []
    assert engine.generate(SYSTEM, GREEDY).stats.num_cached_prompt_tokens == 0


def test_engines_sharing_a_backend_keep_one_prefix_at_a_time():
    target, draft = hash_pair()
    a, b = make_engine(target, draft, "none"), make_engine(target, draft, "none")
    a.generate(SYSTEM, GREEDY)
    assert a.cache.length > 0
    b.generate(SYSTEM, GREEDY)  # b's request drops what idle a kept on the same backend
    assert a.cache.length == 0 and a.retained.tokens == [] and b.cache.length > 0
    assert a.generate(SYSTEM, GREEDY).stats.num_cached_prompt_tokens == 0
    # an active engine's cache is never touched: interleaved streams on one backend both finish right
    cold = make_engine(*hash_pair(), "none", prefix_cache=False)  # backends of its own
    sa, sb = a.stream(SYSTEM + [1], GREEDY), b.stream(SYSTEM + [2], GREEDY)
    ta, tb = list(next(sa).tokens), list(next(sb).tokens)
    for chunk in sa:
        ta += chunk.tokens
    for chunk in sb:
        tb += chunk.tokens
    assert ta == cold.generate(SYSTEM + [1], GREEDY).tokens
    assert tb == cold.generate(SYSTEM + [2], GREEDY).tokens


def run_together(batch, prompts):
    """Admit every prompt at once into a BatchEngine and step until all end; the sequences, in order."""
    sequences = [batch.add(p, GREEDY) for p in prompts]
    tokens = {s.request_id: [] for s in sequences}
    while batch.running:
        for output in batch.step():
            tokens[output.request_id] += output.tokens
    return sequences, [tokens[s.request_id] for s in sequences]


@pytest.mark.parametrize("parallel, siblings_kept", [(None, True), (2, True), (1, False)])
def test_the_slots_of_one_batch_engine_keep_their_prefixes_side_by_side(parallel, siblings_kept):
    """Two conversations served together, then continued together: each continuation reuses its own slot's
    prefix (llama-server's slots), unless the target's memory holds fewer sequences than there are slots
    (parallel 1: the old one-prefix-per-backend rule, the control that the counts can tell the difference)."""
    from specdec.engine.scheduler import BatchEngine

    target, _ = hash_pair()
    if parallel is not None:
        target.parallel = parallel
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=2)
    firsts = [SYSTEM + [1], SYSTEM + [2, 3]]
    _, outputs = run_together(batch, firsts)
    follow_ups = [first + out + [4, 5] for first, out in zip(firsts, outputs)]
    sequences, got = run_together(batch, follow_ups)
    cold = make_engine(*hash_pair(), "none", prefix_cache=False)
    assert got == [cold.generate(p, GREEDY).tokens for p in follow_ups]
    kept = [s.stats.num_cached_prompt_tokens for s in sequences]
    whole = [len(first) + len(out) - 1 for first, out in zip(firsts, outputs)]  # all but the last emitted token
    assert kept[0] == whole[0]  # the first admission always finds its slot's tokens
    assert kept[1] == (whole[1] if siblings_kept else 0)


# ------------------------------------------------------------------------------------- negative control


def test_negative_control_one_token_too_many_is_caught(monkeypatch):
    """A reuse that keeps one token past the common prefix: the checks above must fail."""
    real = kvcache.common_prefix_length

    def one_too_many(a, b):
        n = real(a, b)
        return n + 1 if n < min(len(a), len(b)) else n

    monkeypatch.setattr(kvcache, "common_prefix_length", one_too_many)
    problems = check_reuse("none", GREEDY)
    assert any("output" in p for p in problems), problems  # a wrong token in the cache changes the output
    problems = check_reuse("draft_model", GREEDY)
    assert problems, "keeping one token too many went unnoticed"


def test_negative_control_a_batch_invariant_target_never_reuses():
    target, draft = hash_pair()
    target.batch_invariant = True
    engine = make_engine(target, draft, "draft_model")
    assert not engine.reuses_prefix
    engine.generate(SYSTEM, GREEDY)
    assert engine.cache.length == 0
    target.calls.clear()
    result = engine.generate(SYSTEM + [3], GREEDY)
    assert result.stats.num_cached_prompt_tokens == 0 and target.calls[0] == SYSTEM + [3]  # the whole prompt
    assert engine.drafter.num_cached_prompt_tokens > 0  # the draft model still reuses: its tokens are verified
    target.batch_invariant = False  # the control: the same backend without the flag does reuse
    engine.generate(SYSTEM, GREEDY)
    assert engine.generate(SYSTEM + [3], GREEDY).stats.num_cached_prompt_tokens == len(SYSTEM)


# ------------------------------------------------------------------------------------- tiny torch model


@pytest.mark.parametrize("drafter", ["none", "draft_model", "hybrid"])
def test_torch_greedy_outputs_equal_cold_runs(target_model, draft_model, drafter):
    def pair():
        return (TransformersBackend(target_model, name="target", max_context=256),
                TransformersBackend(draft_model, name="draft", max_context=256))

    warm = make_engine(*pair(), drafter, k=3)
    cold = make_engine(*pair(), drafter, k=3, prefix_cache=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kept = []
    counted = {"target": 0}
    real_forward = warm.target.forward

    def counting(tokens, cache, num_logits=1):
        counted["target"] += len(tokens)
        return real_forward(tokens, cache, num_logits)

    warm.target.forward = counting
    prompts = []

    def run(prompt):
        result = warm.generate(prompt, params)
        assert result.tokens == cold.generate(prompt, params).tokens, prompt
        prompts.append(prompt)
        kept.append(result.stats.num_cached_prompt_tokens)
        assert_cache_keeps(warm, prompt, result.tokens)
        return result

    conversation(run)
    assert kept[1] > len(SYSTEM) and kept[4] == len(SYSTEM) + 1 and kept[5] == 11 and kept[6] == kept[7] == 0
    # The target forwarded each prompt minus its kept prefix (the prefill's last row gives the first token),
    # then one token per step plus the draft tokens it verified.
    stats = warm.total_stats
    prefill = sum(len(p) - k for p, k in zip(prompts, kept))
    assert counted["target"] == prefill + stats.num_target_forwards + stats.num_draft_tokens
    assert stats.num_cached_prompt_tokens == sum(kept)


# ------------------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("gguf-prefix")
    return {"target": write_tiny_gguf(root / "target.gguf", seed=0, layers=3),
            "draft": write_tiny_gguf(root / "draft.gguf", seed=1, layers=1)}


def _llama(path, **kwargs):
    from specdec.backends.llamacpp.backend import LlamaCppBackend

    return LlamaCppBackend(path, threads=1, **kwargs)


def _recording(backend):
    calls = []
    real = backend.forward

    def forward(tokens, cache, num_logits=1):
        calls.append(list(tokens))
        return real(tokens, cache, num_logits)

    backend.forward = forward
    real_batch = backend.forward_batch

    def forward_batch(batch):  # the engine's path: one entry per running sequence
        calls.extend(list(rows.tokens) for rows in batch)
        return real_batch(batch)

    backend.forward_batch = forward_batch
    return calls


LLAMA_PROMPT = [(i * 37) % 250 + 5 for i in range(30)]
LLAMA_GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_llama_cpp_exact_target_prefills_the_whole_prompt_every_time(gguf):
    target = _llama(gguf["target"], name="exact", max_context=256)
    draft = _llama(gguf["draft"], name="draft", max_context=256, batch_invariant=False)
    assert target.batch_invariant
    engine = make_engine(target, draft, "draft_model", k=3)
    assert not engine.reuses_prefix
    calls = _recording(target)
    first = engine.generate(LLAMA_PROMPT, LLAMA_GREEDY)
    follow_up = LLAMA_PROMPT + first.tokens + [40, 41, 42]
    calls.clear()
    second = engine.generate(follow_up, LLAMA_GREEDY)
    assert second.stats.num_cached_prompt_tokens == 0
    assert calls[0] == follow_up  # the full prompt, as a cold run prefills it
    assert engine.cache.length == 0
    assert engine.drafter.num_cached_prompt_tokens > 0  # the draft model reuses: its tokens are verified
    # ... and the output is bit-for-bit plain decoding from a cold cache
    assert second.tokens == plain_engine(target).generate(follow_up, LLAMA_GREEDY).tokens


def test_llama_cpp_fast_target_reuses(gguf):
    target = _llama(gguf["target"], name="fast", max_context=256, batch_invariant=False)
    engine = plain_engine(target)
    assert engine.reuses_prefix
    calls = _recording(target)
    first = engine.generate(LLAMA_PROMPT, LLAMA_GREEDY)
    follow_up = LLAMA_PROMPT + first.tokens + [40, 41, 42]
    calls.clear()
    second = engine.generate(follow_up, LLAMA_GREEDY)
    assert second.stats.num_cached_prompt_tokens == len(LLAMA_PROMPT) + len(first.tokens) - 1
    assert calls[0] == [first.tokens[-1], 40, 41, 42]
    assert_cache_keeps(engine, follow_up, second.tokens)


@pytest.mark.parametrize("evict", [True, False], ids=["evicts", "negative-control"])
def test_llama_cpp_engines_sharing_a_backend_do_not_run_out_of_kv_cells(gguf, monkeypatch, evict):
    """llama.cpp's sequences share one KV memory (max_context cells, rounded up to 256 by llama.cpp): what an
    idle engine keeps must make way for another engine's request on the same backend."""
    target = _llama(gguf["target"], name="small", max_context=256, batch_invariant=False)
    a, b = plain_engine(target), plain_engine(target)
    prompt = [(i * 37) % 250 + 5 for i in range(100)]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    a.generate(prompt, params)
    assert a.cache.length == 199
    if not evict:
        monkeypatch.setattr(kvcache, "release_retained", lambda backend, keep_group=None: 0)
        with pytest.raises(ContextOverflowError):
            b.generate(prompt[::-1], params)
        return
    b.generate(prompt[::-1], params)
    assert a.cache.length == 0 and b.cache.length == 199


def test_llama_cpp_slots_of_one_engine_keep_full_prefixes_in_a_parallel_backend(gguf):
    """With parallel=2 the KV memory holds two full contexts: two conversations that fill most of max_context
    each are kept side by side between requests and both continue from their own slot, with no overflow."""
    from specdec.engine.scheduler import BatchEngine

    target = _llama(gguf["target"], name="small", max_context=256, batch_invariant=False, parallel=2)
    batch = BatchEngine(target, None, SpecConfig(drafter="none"), max_running=2)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    firsts = [[(i * 37) % 250 + 5 for i in range(100)], [(i * 41) % 250 + 3 for i in range(100)]]
    sequences = [batch.add(p, params) for p in firsts]
    outputs = {s.request_id: [] for s in sequences}
    while batch.running:
        for output in batch.step():
            outputs[output.request_id] += output.tokens
    follow_ups = [first + outputs[s.request_id][:40] for first, s in zip(firsts, sequences)]
    again = [batch.add(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in follow_ups]
    while batch.running:
        assert all(o.error is None for o in batch.step())
    assert [s.stats.num_cached_prompt_tokens for s in again] == [len(p) - 1 for p in follow_ups]


def test_claim_parks_the_replaced_tail_on_a_backend_that_can():
    """The tail a new request replaces goes through the backend's park_tail (llama.cpp's unified buffer keeps those
    cells taken while the new prompt is written; the protocol's default trims)."""

    class Parking(MarkovBackend):
        def __init__(self):
            super().__init__(torch.zeros(4, 4))
            self.parked = []

        def park_tail(self, cache, n):
            self.parked.append(n)
            return cache.trim(n)

    for backend in (Parking(), MarkovBackend(torch.zeros(4, 4))):
        cache, owner = MarkovCache(64), kvcache.RetainedPrefix()
        owner.claim(backend, cache, [])
        cache.tokens += [1, 2, 3, 4, 5]
        owner.tokens = [1, 2, 3, 4, 5]
        assert owner.claim(backend, cache, [1, 2, 9]) == 2 and cache.tokens == [1, 2]
        if isinstance(backend, Parking):
            assert backend.parked == [0, 3]
