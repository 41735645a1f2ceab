"""The ModelBackend protocol: one forward call serves prefill, a draft step and verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from specdec.backends.kvcache import ContextOverflowError, KVCache


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


@dataclass
class BatchRows:
    """One sequence's rows in a flat batch: tokens appended to its cache, logits for the last num_logits of them.

    num_logits = 0 is a prefill chunk (the caller wants the cache filled, nothing back).
    """

    tokens: Sequence[int]
    cache: KVCache
    num_logits: int = 1


def forward_batch(backend, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
    """Run every sequence's rows through the target: one pass where the backend has `forward_batch`, else one
    forward per sequence. Returns float32 logits [num_logits, vocab] per entry, in order ([0, vocab] for 0).

    Every cache appears at most once. On an error every cache is left as it was before the call.
    """
    native = getattr(backend, "forward_batch", None)
    if native is not None:
        return native(batch)
    return forward_each(backend, batch)


def check_batch(batch: Sequence[BatchRows], name: str, owns: Callable[[KVCache], bool]) -> list[int]:
    """forward_batch's checks, all before anything runs (a refused batch leaves every cache as it was): caches
    this backend made (`owns`), each at most once, num_logits >= 0, tokens that fit (forward_rows). Returns
    each entry's logits rows: min(num_logits, its tokens)."""
    seen: set[int] = set()
    wanted: list[int] = []
    for rows in batch:
        cache = rows.cache
        if not owns(cache):
            raise ValueError(f"{name}: forward_batch needs caches made by this backend's new_cache")
        if id(cache) in seen:
            raise ValueError(f"{name}: a cache appears more than once in one forward_batch")
        seen.add(id(cache))
        if int(rows.num_logits) < 0:
            raise ValueError(f"num_logits must be >= 0, got {rows.num_logits}")
        forward_rows(rows.tokens, cache, 1, name)  # tokens and room
        wanted.append(min(int(rows.num_logits), len(rows.tokens)))
    return wanted


def forward_each(backend, batch: Sequence[BatchRows]) -> list[torch.Tensor]:
    """forward_batch's contract by one `backend.forward` per sequence (for backends without a batched pass).

    On an error the caches already run are trimmed back (a failing forward restores its own cache).
    """
    results: list[torch.Tensor] = []
    done: list[tuple[KVCache, int]] = []
    try:
        for rows in batch:
            before = rows.cache.length
            logits = backend.forward(rows.tokens, rows.cache, num_logits=max(1, rows.num_logits))
            done.append((rows.cache, before))
            results.append(logits[len(logits) - rows.num_logits:] if rows.num_logits else logits[:0])
    except BaseException:
        for cache, before in done:
            cache.trim(cache.length - before)
        raise
    return results


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
