"""One request at a time: the speculative decode loop (draft, verify in one target pass, roll back, emit) as the batch-of-one case of scheduler.BatchEngine, and the plain baseline on the same backend."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from specdec.config import SamplingParams, SpecConfig
from specdec.core.stats import SpecStats
from specdec.drafters.base import Drafter
from specdec.engine.output import Chunk, Generation, StepOutput
from specdec.engine.scheduler import BatchEngine


class SpeculativeEngine:
    """Runs one request at a time over a target backend and an optional drafter: the batch-of-one case of
    BatchEngine (engine/scheduler.py), the same step code that serves many sequences at once.

    With no drafter (or k = 0) each step is one target forward on the last token: plain
    autoregressive decoding through exactly the same code, cache and weights.

    Prefix reuse (prefix_cache, on by default; None reads `spec.prefix_cache` when SpecConfig has it):
    after a request the target cache keeps its tokens (prompt + generated, minus the last), and the next
    request keeps their longest common prefix with its prompt minus the last token and prefills only
    the rest, as llama-server's slots do (a shared system prompt, a conversation's earlier turns). The
    draft model's cache does the same (drafters/draft_model.py). Never on a batch-invariant target:
    see reuses_prefix.

    A new stream started while an earlier one is still open ends the earlier one first (resumed, the
    earlier one yields nothing more), since the engine has one slot.
    """

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        spec: SpecConfig | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        prefix_cache: bool | None = None,
    ):
        self.batch = BatchEngine(target, drafter, spec, decode, prefix_cache, max_running=1)

    @classmethod
    def on(cls, batch: BatchEngine) -> "SpeculativeEngine":
        """One request at a time on an existing batch engine (its slots, caches and learnt policies)."""
        engine = cls.__new__(cls)
        engine.batch = batch
        return engine

    @property
    def target(self):
        return self.batch.target

    @property
    def spec(self) -> SpecConfig:
        return self.batch.spec

    @property
    def decode(self) -> Callable[[Sequence[int]], str]:
        return self.batch.decode

    @property
    def drafter(self) -> Drafter | None:
        return self.batch.drafter

    @property
    def prefix_cache(self) -> bool:
        return self.batch.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, value: bool) -> None:
        self.batch.prefix_cache = bool(value)  # read per request

    @property
    def last_stats(self) -> SpecStats | None:
        """The statistics of the latest request started on this engine (also on its Generation)."""
        sequence = self.batch.last_sequence
        return sequence.stats if sequence is not None else None

    @property
    def cache(self):
        return self.batch.slots[0].cache

    @property
    def retained(self):
        return self.batch.slots[0].retained

    @property
    def total_stats(self) -> SpecStats:
        return self.batch.total_stats

    @property
    def adaptive_policies(self) -> dict:
        return self.batch.adaptive_policies

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
        return self.batch.reuses_prefix

    def calibrate(self, sizes=None) -> dict[int, float]:
        """Measure the target's pass cost per row count on this engine's cache (calibration.py) and keep it on
        the backend, where every adaptive policy made afterwards reads it. Sizes: 1 to k + 1 by default."""
        return self.batch.calibrate(sizes)

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request that cannot fit, before any work is done."""
        self.batch.check_request(prompt, params)

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        tokens: list[int] = []
        from_draft: list[bool] = []
        logprobs = [] if params.logprobs is not None else None
        texts: list[str] = []
        finish = "length"
        prompt_logprobs = None
        stream = self.stream(prompt, params)
        for chunk in stream:
            prompt_logprobs = chunk.prompt_logprobs if chunk.prompt_logprobs is not None else prompt_logprobs
            tokens += chunk.tokens
            from_draft += chunk.from_draft
            if logprobs is not None:
                logprobs += chunk.logprobs or []
            texts.append(chunk.text)
            finish = chunk.finish_reason or finish
        return Generation(tokens, "".join(texts), finish, self.last_stats, from_draft, logprobs, prompt_logprobs)

    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Yield the request's StepOutputs until EOS, a stop string or max_tokens (the last one says which);
        stats land in self.last_stats. An error inside the engine is raised here."""
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        return self._run(prompt, params)

    def _run(self, prompt: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        batch = self.batch
        for earlier in list(batch.running):
            batch.abort(earlier)  # one slot: a stream left open by its caller ends here
        sequence = batch.add(prompt, params)
        try:
            while not sequence.finished:
                for output in batch.step():
                    if output.error is not None:
                        raise output.error
                    yield output
        finally:
            # Closed at a yield (the caller stopped reading): between steps, where the cache invariant holds.
            batch.abort(sequence)


def plain_engine(target, decode=None, prefix_cache: bool | None = None) -> SpeculativeEngine:
    """The autoregressive baseline: the same loop and backend with no drafter."""
    return SpeculativeEngine(target, None, SpecConfig(), decode, prefix_cache)


__all__ = ["Chunk", "Generation", "SpeculativeEngine", "StepOutput", "plain_engine"]
