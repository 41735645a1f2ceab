"""The ModelBackend protocol: one forward call serves prefill, a draft step and verification."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from ..kvcache import ContextOverflowError, KVCache


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


def forward_rows(tokens: Sequence[int], cache: KVCache, num_logits: int, name: str) -> int:
    """Check a forward call against the cache (every backend's one rule) and return the logits rows to give.

    Raises ValueError for no tokens and ContextOverflowError when the tokens do not fit in the cache.
    """
    n = len(tokens)
    if n == 0:
        raise ValueError("forward needs at least one token")
    if cache.length + n > cache.capacity:
        raise ContextOverflowError(
            f"{cache.length + n} tokens exceed the context of {cache.capacity} tokens for {name}"
        )
    return max(1, min(num_logits, n))


def embeddable_ids(backend) -> int:
    """How many token ids a model can read: its embedding rows (llama.cpp: its vocabulary, one row per id)."""
    return int(getattr(backend, "num_embeddings", None) or backend.vocab_size)
