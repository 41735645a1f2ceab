"""The Drafter protocol, the Draft it returns, and the public name -> drafter registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdec.config import SamplingParams, SpecConfig


@dataclass
class Draft:
    """Proposed tokens [k] and, for a stochastic drafter, their distributions q [k, V] (None = deterministic)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    seconds: float = 0.0  # wall time spent proposing these tokens, for the cost model
    # Wall time spent first feeding a draft model the context it had not seen (the prompt, or tokens decoded
    # while drafting was off): real time, but a one-off, so it is kept out of the per-token cost model.
    catchup_seconds: float = 0.0


class Drafter(ABC):
    """Proposes continuations and learns from how many were accepted.

    The engine owns the sequence; a drafter only reads it. `begin` is called once per request with the prompt,
    `propose(context, k)` sees every token so far (prompt + emitted), `accepted` reports how many of the last
    draft survived so the drafter can roll its own state back, and `end` is called once a request stops, however
    it stops (after an error inside `propose`, the drafter empties its own cache). The rest has defaults:

    - `next_source(context)` names the source the next propose() drafts from ("ngram3" for a 3-gram copy,
      "model"); the engine keeps one k policy per source, since their acceptance and cost differ. None: nothing
      to propose, a plain step. By default the drafter is one source named after itself.
    - `plan(context)`, for a deterministic drafter (its draft a function of the context alone): the draft
      propose() would return at the largest k. The engine scores each step's plan against the tokens that follow
      (plan_ledger.py), so its k policy learns acceptance without drafting to explore. A stochastic drafter (a
      draft model sampling q) returns None, the default.
    - `prefix_cache`: the engine sets it from its own switch before `begin`. A drafter with a cache of its own (a
      draft model) then keeps, at `begin`, the part it shares with the new prompt (at most prompt[:-1]) and at
      `end` what it holds; False: empty at both, as a cold run wants.
    - `observe(context)` is called just before `end` with the whole context, for a drafter that learns from
      outputs across requests (the suffix drafter's cache); `set_partition` (before `begin`) names the request's
      cache partition, so what it learnt from one partition's outputs never drafts for another's.
    - `can_spawn` and `spawn()`: a fresh drafter of the same kind for another slot of a batching engine,
      sharing what may be shared (the draft model's weights, the suffix cache).
    - `batch_key()` and `propose_batch`: drafters with equal keys (one draft model) draft together, their
      forwards sharing passes; None (the default): each drafts alone.
    """

    name: str
    prefix_cache = True
    can_spawn = False

    @abstractmethod
    def begin(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None: ...

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    @abstractmethod
    def accepted(self, num_accepted: int, num_proposed: int) -> None: ...

    @abstractmethod
    def end(self) -> None: ...

    def next_source(self, context: Sequence[int]) -> str | None:
        return self.name

    def plan(self, context: Sequence[int]) -> list[int] | None:
        return None

    def observe(self, context: Sequence[int]) -> None:
        return None

    def set_partition(self, partition: object) -> None:
        """The cache partition (tenant and salt) of the request about to begin: a drafter that keeps state across
        requests (the suffix cache) uses only that partition's."""

    def forget(self) -> None:
        """Drop what it learnt across requests (a repeated measurement must not draft from its own earlier runs)."""

    def spawn(self) -> "Drafter":
        raise NotImplementedError(f"the {self.name} drafter cannot serve several sequences at once")

    def batch_key(self) -> object | None:
        return None

    @staticmethod
    def propose_batch(requests: Sequence[tuple["Drafter", Sequence[int], int]]) -> list[Draft]:
        """Drafts for several (drafter, context, k) of equal batch_key, in order; by default one by one."""
        return [drafter.propose(context, k) for drafter, context, k in requests]


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make a drafter available by name (CLI --drafter, server, bench)."""
    _REGISTRY[name] = factory


def available_drafters() -> list[str]:
    return sorted(_REGISTRY)


def create_drafter(name: str, *, draft_backend=None, spec: SpecConfig | None = None, **kwargs) -> Drafter:
    """Build a registered drafter; draft_backend is passed to drafters that need a model."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _REGISTRY[name](draft_backend=draft_backend, spec=spec or SpecConfig(drafter=name), **kwargs)
