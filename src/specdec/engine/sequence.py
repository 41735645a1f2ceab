"""What the scheduler keeps per request: a slot (a target cache and a drafter that outlive requests), the running
sequence (context, prefill progress, policies, text, counters), and one sequence's part of a step (StepPlan)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.backends.base import BatchRows
from specdec.backends.kvcache import RetainedPrefix
from specdec.config import SamplingParams
from specdec.core.processors import LogitsProcessor
from specdec.core.stats import SpecStats
from specdec.drafters.base import Draft, Drafter
from specdec.engine.textstream import TextStream
from specdec.kpolicy.base import KPolicy
from specdec.kpolicy.plan_ledger import PlanLedger


class Slot:
    """A place for one sequence: a target cache, what it holds between requests, and a drafter of its own.

    Slots outlive requests, so a slot's cache keeps the last request's tokens for a next one that shares their
    prefix (llama-server's slots), and a draft model's cache does the same inside the slot's drafter.
    """

    def __init__(self, drafter: Drafter | None):
        self.cache = None
        self.retained = RetainedPrefix()  # its group is set at each admission (BatchEngine.add)
        self.drafter = drafter
        self.sequence: RunningSequence | None = None
        self.partition: object = None  # the cache partition (tenant, salt) whose tokens its caches hold


@dataclass
class RunningSequence:
    """One request inside the engine: its context, state of prefill, policies, text and counters."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    slot: Slot
    generator: torch.Generator
    eos: frozenset
    text: TextStream
    stats: SpecStats
    began: float
    context: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the target cache (the last chunk's logits give the first token)
    passed_over: int = 0  # prompt rows prefilled for others while this one waited (ages its prefill priority)
    generated: int = 0
    policies: dict = field(default_factory=dict)  # per draft source
    plans: PlanLedger = field(default_factory=PlanLedger)  # a deterministic drafter's plans awaiting their tokens
    finish_reason: str | None = None
    tag: object = None  # the caller's handle (a server job)
    partition: object = None  # who may share its caches: a request reuses only what its own partition left
    processor: LogitsProcessor | None = None  # penalties, logit_bias (a grammar): applied at every verified row
    pending_logprobs: list | None = None  # the last verdict's tokens' log-probabilities, until _emit takes them
    prompt_logprobs: list | None = None  # the prompt tokens' log-probabilities (params.prompt_logprobs), as prefilled

    @property
    def scores_prompt(self) -> bool:
        """Whether every prefill row's logits are wanted (the prompt's log-probabilities)."""
        return self.params.prompt_logprobs is not None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepPlan:
    """One sequence's part of a step: its rows, and for a decode step the draft behind them. A prefill chunk
    (decode False) that ends the prompt asks for its last row's logits: the sequence's first token."""

    sequence: RunningSequence
    rows: BatchRows
    decode: bool
    proposed: list[int] = field(default_factory=list)
    draft: Draft | None = None
    policy: KPolicy | None = None
    offered: int = 0  # draft tokens the drafter proposed for this step (a processor may let fewer through)
    forced: int = 0  # how many of the proposed tokens a grammar forced (they come first; the drafter's follow)
