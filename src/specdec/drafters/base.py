"""The Drafter protocol, the Draft it returns, and the public name -> drafter registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

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


@runtime_checkable
class Drafter(Protocol):
    """Proposes continuations and learns from how many were accepted.

    The engine owns the sequence; a drafter only reads it. `begin` is called once per request with
    the prompt, `propose(context, k)` sees every token so far (prompt + emitted), and `accepted`
    reports how many of the last draft survived so the drafter can roll its own state back.

    Optionally, `next_source(context) -> str | None` names the source the next propose() will draft
    from (e.g. "ngram3" for a 3-gram copy, "model"); the engine keeps one k policy per source, since
    their acceptance and cost differ. None means nothing to propose: the engine takes a plain step.
    Without the method, the drafter is one source named after itself.

    Optionally, a deterministic drafter (its draft a function of the context alone) has
    `plan(context) -> list[int]`: the draft propose() would return at the largest k. The engine scores each
    step's plan against the tokens that follow (plan_ledger.py), so its k policy learns acceptance without
    drafting to explore. A stochastic drafter (a draft model sampling q) must not have it.

    A drafter with a cache of its own (a draft model) may keep it across requests: `begin` then keeps
    the part it shares with the new prompt (the longest common prefix, at most prompt[:-1]) instead of
    starting empty, and `end` leaves it holding what it holds, which the drafter records. Such a drafter
    has a `prefix_cache: bool` attribute, which the engine sets from its own switch before `begin`
    (False: empty at `begin` and at `end`, as a cold run wants). `end` is called once a request stops,
    however it stops; after an error inside `propose`, the drafter empties its cache itself. Optionally,
    `observe(context)` is called just before `end` with the whole context (prompt + every token emitted),
    for a drafter that learns from outputs across requests (the suffix drafter's cache).
    """

    name: str

    def begin(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None: ...

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def accepted(self, num_accepted: int, num_proposed: int) -> None: ...

    def end(self) -> None: ...


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
