"""The speculative decode loop (draft, verify in one target pass, roll back, emit) and the plain baseline on the same backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .config import SamplingParams, SpecConfig
from .drafters.base import Draft, Drafter
from .kvcache import ContextOverflowError, RetainedPrefix
from .metrics import SpecStats
from .policy import make_policy
from .sampling import greedy_tokens, make_generator, probabilities
from .textstream import TextStream
from .verify import verify_greedy, verify_sampled


@dataclass
class Chunk:
    """What one engine step emits: tokens, whether each came from the draft, and the safe text delta."""

    tokens: list[int]
    from_draft: list[bool]
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"


@dataclass
class Generation:
    """A finished request: all tokens, the text, why it ended, and its statistics.

    After a stop string the tokens end at the one in which the stop string ends and the text ends
    where it begins (vLLM's convention); plain and speculative runs agree on both.
    """

    tokens: list[int]
    text: str
    finish_reason: str
    stats: SpecStats
    from_draft: list[bool] = field(default_factory=list)


class SpeculativeEngine:
    """Runs one request at a time over a target backend and an optional drafter.

    With no drafter (or k = 0) each step is one target forward on the last token: plain
    autoregressive decoding through exactly the same code, cache and weights.

    Prefix reuse (prefix_cache, on by default; None reads `spec.prefix_cache` when SpecConfig has it):
    after a request the target cache keeps its tokens (prompt + generated, minus the last), and the next
    request keeps their longest common prefix with its prompt minus the last token and prefills only
    the rest, as llama-server's slots do (a shared system prompt, a conversation's earlier turns). The
    draft model's cache does the same (drafters/draft_model.py). Never on a batch-invariant target:
    see reuses_prefix.
    """

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        prefix_cache: bool | None = None,
    ):
        self.target = target
        self.drafter = drafter
        self.spec = spec or SpecConfig()
        self.decode = decode or _default_decoder(target)
        self.cache = None
        if prefix_cache is None:
            prefix_cache = getattr(self.spec, "prefix_cache", True)
        self.prefix_cache = bool(prefix_cache)
        self.retained = RetainedPrefix()  # the tokens self.cache holds between requests
        self._runs = 0  # requests started (a stream collected after a newer one began leaves the caches alone)
        self.total_stats = SpecStats()
        self.adaptive_policies: dict[str | None, object] = {}  # per draft source, for the engine's lifetime

    @property
    def reuses_prefix(self) -> bool:
        """Whether a request may keep the part of the target cache it shares with the previous request.

        Not on a batch-invariant target (llama.cpp's exact mode, `target.batch_invariant`): there greedy
        output must be bit-identical to plain decoding of the same prompt from a cold cache, and a kept
        prefix was computed in other row splits (the previous prompt's prefill batches, one-row steps,
        verification slices) than a cold prefill of the new prompt would use, which may round differently.
        The torch backends have no such flag and no such promise: no torch weight format is
        batch-invariant (docs/how-it-works.md), so a verification pass already rounds each row slightly
        differently from a one-row pass, and their greedy contract is "plain greedy output except at
        near-ties within that rounding". A kept prefix's keys and values come from exactly such passes,
        so reuse stays within that contract (tests/test_prefix_cache.py checks outputs against cold runs).
        """
        return self.prefix_cache and not getattr(self.target, "batch_invariant", False)

    def _policy(self, source: str | None, request_policies: dict):
        """The k policy of one draft source (a drafter may have several: see Drafter.next_source).

        The adaptive cost model measures the hardware and that source's acceptance, which outlive a
        request, so it is kept for the engine's lifetime; the other policies start fresh per request.
        """
        if self.spec.k_policy == "adaptive":
            owner = self.adaptive_policies
        else:
            owner = request_policies
        if source not in owner:
            owner[source] = make_policy(self.spec.k_policy, self.spec.num_speculative_tokens,
                                        getattr(self.target, "pass_costs", None))
        return owner[source]

    def calibrate(self, sizes=None) -> dict[int, float]:
        """Measure the target's pass cost per row count on this engine's cache (calibration.py) and keep it on
        the backend, where every adaptive policy made afterwards reads it. Sizes: 1 to k + 1 by default."""
        from .calibration import DEFAULT_SIZES, cached_pass_costs, measure_pass_costs

        if self.cache is None:
            self.cache = self.target.new_cache(self.target.max_context)
        k = self.spec.num_speculative_tokens
        sizes = sizes or sorted({s for s in DEFAULT_SIZES if s <= k + 1} | {1, k + 1})
        options = getattr(self.target, "calibration_options", {})

        def measure(wanted):
            self.retained.drop()  # the measurement empties the cache
            return measure_pass_costs(self.target, wanted, cache=self.cache, **options)

        costs = cached_pass_costs(self.target, sizes, measure)
        self.target.pass_costs = costs
        return costs

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request that cannot fit, before any work is done."""
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        limit = self.target.max_context
        if len(prompt) + params.max_tokens > limit:
            raise ContextOverflowError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model context "
                f"of {limit} tokens"
            )
        vocab = self.target.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        tokens: list[int] = []
        from_draft: list[bool] = []
        texts: list[str] = []
        finish = "length"
        stream = self.stream(prompt, params)
        for chunk in stream:
            tokens += chunk.tokens
            from_draft += chunk.from_draft
            texts.append(chunk.text)
            finish = chunk.finish_reason or finish
        return Generation(tokens, "".join(texts), finish, self.last_stats, from_draft)

    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[Chunk]:
        """Yield Chunks until EOS, a stop string or max_tokens; stats land in self.last_stats."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        return self._run(prompt, params)

    def _run(self, prompt: list[int], params: SamplingParams) -> Iterator[Chunk]:
        stats = SpecStats(num_prompt_tokens=len(prompt))
        self.last_stats = stats
        began = time.perf_counter()
        generator = make_generator(params.seed, getattr(self.target, "device", "cpu"))
        eos = frozenset() if params.ignore_eos else self.target.eos_token_ids
        text = TextStream(self.decode, params.stop)
        request_policies: dict = {}
        if self.cache is None:
            self.cache = self.target.new_cache(self.target.max_context)
        if self.spec.k_policy == "adaptive" and getattr(self.target, "calibrate_on_first_use", False) \
                and getattr(self.target, "pass_costs", None) is None:
            self.calibrate()  # a GPU's nearly free rows, a CPU's kinked curve: no line through two sizes shows them
        self._runs += 1
        run = self._runs
        cache = self.cache
        reuse = self.reuses_prefix
        # Keep the longest common prefix of what the cache holds and prompt[:-1]; prefill only the rest.
        cached = self.retained.claim(self.target, cache, prompt[:-1], reuse)
        stats.num_cached_prompt_tokens = cached
        drafter = self.drafter
        if drafter is not None and hasattr(drafter, "prefix_cache"):
            drafter.prefix_cache = self.prefix_cache  # one switch for both caches
        context = list(prompt)
        generated = 0
        clean = False  # ended (or was abandoned) between steps, where the cache invariant holds
        try:
            if len(prompt) - 1 > cached:
                self.target.forward(prompt[cached:-1], cache, num_logits=1)
            if drafter is not None:
                drafter.begin(prompt, params, generator)
            for kept in self.adaptive_policies.values():
                kept.begin_request()  # acceptance is the request's content: old evidence fades, exploration restarts
            stats.prefill_seconds = time.perf_counter() - began
            while True:
                # Invariant: the target cache holds every context token except the last.
                remaining = params.max_tokens - generated
                room = cache.capacity - len(context)
                policy, k = None, 0
                if drafter is not None:
                    # Sources differ in acceptance and cost (an n-gram copy vs a draft model), so each has its
                    # own policy; None means the drafter has nothing to propose: a plain step.
                    source = drafter.next_source(context) if hasattr(drafter, "next_source") else drafter.name
                    if source is not None:
                        policy = self._policy(source, request_policies)
                        k = min(policy.next_k(), remaining - 1, room - 1)
                draft = drafter.propose(context, k) if k > 0 else Draft([])
                proposed = draft.tokens[: max(k, 0)]
                stats.draft_seconds += draft.seconds
                target_began = time.perf_counter()
                logits = self.target.forward([context[-1]] + proposed, cache, num_logits=len(proposed) + 1)
                if params.greedy:
                    verdict = verify_greedy(proposed, greedy_tokens(logits).tolist())
                else:
                    target_probs = probabilities(logits, params)
                    draft_probs = draft.probs[: len(proposed)] if draft.probs is not None else None
                    if draft_probs is not None and draft_probs.shape[-1] < target_probs.shape[-1]:
                        # A draft may score fewer ids than the target (a pruned head over an embedding table
                        # that still reads every target id); it never proposes the ids it lacks: q = 0 there.
                        draft_probs = torch.nn.functional.pad(
                            draft_probs, (0, target_probs.shape[-1] - draft_probs.shape[-1])
                        )
                    verdict = verify_sampled(proposed, draft_probs, target_probs, generator)
                target_seconds = time.perf_counter() - target_began
                stats.target_seconds += target_seconds
                if drafter is not None and proposed:
                    drafter.accepted(verdict.num_accepted, len(proposed))
                if policy is not None:
                    policy.update(len(proposed), verdict.num_accepted, draft.seconds, target_seconds,
                                  draft.catchup_seconds)
                stats.record_step(len(proposed), verdict.num_accepted)

                new_tokens = proposed[: verdict.num_accepted] + [verdict.next_token]
                new_from_draft = [True] * verdict.num_accepted + [False]
                finish = None
                for i, token in enumerate(new_tokens):
                    if token in eos:
                        new_tokens, new_from_draft, finish = new_tokens[: i + 1], new_from_draft[: i + 1], "stop"
                        break
                if len(new_tokens) >= remaining:
                    new_tokens, new_from_draft = new_tokens[:remaining], new_from_draft[:remaining]
                    finish = finish or "length"
                visible = [t for t in new_tokens if t not in eos]  # EOS can only be the last token
                pushed_before = len(text.tokens)
                delta = text.push(visible)
                if text.stopped:
                    # The tokens end at the one that completes the stop string, as in plain decoding: the tokens
                    # after it in this step (and an EOS behind them) are not generated.
                    kept = len(text.tokens) - pushed_before
                    new_tokens, new_from_draft, finish = new_tokens[:kept], new_from_draft[:kept], "stop"
                elif finish is not None:
                    delta += text.flush()
                context += new_tokens
                generated += len(new_tokens)
                # One rollback restores the invariant (cache = context minus its last token): it drops the
                # rejected draft tokens and, when EOS, a stop string or max_tokens cut the accepted ones, those too.
                cache.trim(cache.length - (len(context) - 1))
                stats.num_generated_tokens = generated
                stats.total_seconds = time.perf_counter() - began
                yield Chunk(new_tokens, new_from_draft, delta, finish)
                if finish is not None:
                    clean = True
                    return
        except GeneratorExit:  # the caller closed the stream at a yield: the invariant holds there
            clean = True
            raise
        finally:
            stats.total_seconds = time.perf_counter() - began
            self.total_stats.merge(stats)
            # A stream abandoned without close() may be collected after a newer request began on this
            # engine: the caches are that request's then.
            if run == self._runs:
                if clean and cache.length == len(context) - 1:
                    # Keep prompt + generated tokens for the next request (emptied when reuse is off).
                    self.retained.tokens = context[:-1]
                    self.retained.release(reuse)
                else:
                    self.retained.drop()  # an error mid-step: what the cache holds is not certain
                if drafter is not None:
                    if hasattr(drafter, "observe"):
                        drafter.observe(context)  # everything emitted, for a drafter that learns from outputs
                    drafter.end()


def _default_decoder(backend) -> Callable[[Sequence[int]], str]:
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is not None:
        return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    return lambda ids: " ".join(str(i) for i in ids)


def plain_engine(target, decode=None, prefix_cache: bool | None = None) -> SpeculativeEngine:
    """The autoregressive baseline: the same loop and backend with no drafter."""
    return SpeculativeEngine(target, None, SpecConfig(), decode, prefix_cache)


__all__ = ["Chunk", "Generation", "SpeculativeEngine", "plain_engine"]
