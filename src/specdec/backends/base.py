"""The ModelBackend protocol: one forward call serves prefill, a draft step and verification."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from ..kvcache import KVCache


@runtime_checkable
class ModelBackend(Protocol):
    """A causal LM behind a uniform, cache-carrying forward."""

    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int

    def new_cache(self, capacity: int) -> KVCache: ...

    def forward(self, tokens: Sequence[int], cache: KVCache, num_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache and return logits [num_logits, vocab] for the last num_logits positions."""
        ...
