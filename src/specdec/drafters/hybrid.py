"""Hybrid drafter: copy from the context when a long enough n-gram matches (free), otherwise draft with the draft model.

Lookup drafts carry probs=None (one-hot q); model drafts carry the model's q, so the verifier stays
lossless step by step whichever source was used. The draft model's KV cache stays consistent across
lookup steps: only the model's own proposals are reported back to it through accepted(), and on its
next propose() it feeds whatever context it has not seen yet (DraftModelDrafter's catch-up). Across
requests the draft model keeps the prefix its cache shares with the next prompt (DraftModelDrafter).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specdec.config import SamplingParams, SpecConfig
from specdec.drafters.base import Draft, Drafter, register_drafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter


class HybridDrafter(Drafter):
    """Prompt lookup first, draft model as the fallback.

    min_match: the shortest n-gram match that is trusted over the draft model (default 2, kept
    within [spec.lookup_min_ngram, spec.lookup_max_ngram]); a one-token match is usually a coincidence.
    """

    name = "hybrid"
    can_spawn = True

    def __init__(self, draft_backend, spec: SpecConfig | None = None, min_match: int | None = None):
        if draft_backend is None:
            raise ValueError("the hybrid drafter needs a draft model (--draft) for steps where lookup finds nothing")
        self.spec = spec or SpecConfig(drafter=self.name)
        if min_match is None:
            min_match = 2
        self.min_match = max(self.spec.lookup_min_ngram, min(min_match, self.spec.lookup_max_ngram))
        self.lookup = PromptLookupDrafter(self.spec, min_ngram=self.min_match)
        self.model = DraftModelDrafter(draft_backend, self.spec)
        self._last_source: str | None = None  # "lookup" or "model": who made the draft being verified
        self.num_lookup_drafts = 0
        self.num_model_drafts = 0

    def spawn(self) -> "HybridDrafter":
        """A drafter for another sequence running at the same time (its own lookup index and draft cache)."""
        return HybridDrafter(self.model.backend, self.spec, self.min_match)

    @property
    def prefix_cache(self) -> bool:
        """Whether the draft model keeps its cache's shared prefix across requests (the engine sets it)."""
        return self.model.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, value: bool) -> None:
        self.model.prefix_cache = value

    def begin(self, prompt: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self.lookup.begin(prompt, params, generator)
        self.model.begin(prompt, params, generator)
        self._last_source = None

    def next_source(self, context: Sequence[int]) -> str | None:
        """'ngram<n>' when lookup has a trusted match (propose() will copy it), else 'model' (None when the
        context holds an id the draft model cannot embed: a plain step)."""
        self.lookup.index.sync(context)
        _, n = self.lookup.index.match(1, self.min_match)
        if n:
            return f"ngram{n}"
        return "model" if self.model.can_draft(context) else None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        began = time.perf_counter()
        if k <= 0:
            self._last_source = None
            return Draft([], None, time.perf_counter() - began)
        tokens = self.lookup.lookup(context, k)
        if tokens:
            self._last_source = "lookup"
            self.num_lookup_drafts += 1
            return Draft(tokens, None, time.perf_counter() - began)
        draft = self.model.propose(context, k)
        self._last_source = "model" if draft.tokens else None
        self.num_model_drafts += bool(draft.tokens)
        return Draft(draft.tokens, draft.probs, time.perf_counter() - began - draft.catchup_seconds,
                     draft.catchup_seconds)

    def accepted(self, num_accepted: int, num_proposed: int) -> None:
        # Only the model wrote speculative tokens into its cache; a lookup draft left it untouched.
        if self._last_source == "model":
            self.model.accepted(num_accepted, num_proposed)
        self._last_source = None

    def end(self) -> None:
        self.lookup.end()
        self.model.end()
        self._last_source = None


register_drafter(
    "hybrid",
    lambda draft_backend=None, spec=None, **kw: HybridDrafter(draft_backend, spec, **kw),
)

__all__ = ["HybridDrafter"]
