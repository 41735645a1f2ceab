"""KV cache protocol (length, capacity, trim), a preallocated buffer whose rollback only moves a position pointer, and
the record of what a cache holds between requests (prefix reuse)."""

from __future__ import annotations

import weakref
from typing import Protocol, Sequence, runtime_checkable

import torch

from specdec.errors import ContextOverflowError


@runtime_checkable
class KVCache(Protocol):
    """What the engine needs from any backend's cache."""

    @property
    def length(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def trim(self, n: int) -> int:
        """Forget the last n tokens; returns how many were dropped. Nothing is copied or freed."""
        ...


class PreallocatedKV:
    """One layer's keys and values in fixed buffers [batch, heads, capacity, head_dim].

    Tokens are written at [length, length + n) and readers get a view of [0, length + n):
    rejected draft positions are simply overwritten by the next write.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise ContextOverflowError(f"KV cache holds {self.capacity} tokens; {end} requested")
        if self.keys is None:
            batch, heads, _, dim = keys.shape
            self.keys = torch.empty(batch, heads, self.capacity, dim, dtype=keys.dtype, device=keys.device)
            self.values = torch.empty(
                batch, heads, self.capacity, values.shape[-1], dtype=values.dtype, device=values.device
            )
        self.keys[:, :, self.length : end].copy_(keys)
        self.values[:, :, self.length : end].copy_(values)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        self.length -= n
        return n


class RetainedPrefix:
    """What one owner's cache (an engine's target cache, a draft model's cache) holds between requests.

    A new request keeps the longest common prefix of those tokens and the tokens it needs cached and
    prefills only the rest, as llama-server's slots do. The owner keeps `tokens` equal to what the
    cache holds (or calls drop()); a cache whose length no longer matches `tokens` (someone else
    wrote or trimmed it) is emptied instead of trusted.

    One prefix per backend and group: `claim` empties the caches that idle owners of other groups left on
    the same backend, so a backend holds only the tokens of the group that ran last (and of owners still
    running). llama.cpp's sequences share one KV memory: a prefix kept by one engine would otherwise take
    the room another engine's request needs (and engines that share a backend interleave requests, where
    reuse is rare anyway). The slots of one BatchEngine are one group: the backend's memory is sized for
    all of them at once (`parallel` sequences of max_context each), so they keep their prefixes side by
    side, as llama-server's slots do. An owner with no group is a group of its own. An owner is idle
    from `release` until its next `claim`; an active owner's cache is never touched.
    """

    def __init__(self, group: object | None = None) -> None:
        self.cache = None
        self.backend = None
        self.tokens: list[int] = []
        self.group = group

    def claim(self, backend, cache, wanted: Sequence[int], reuse: bool = True) -> int:
        """Start a request on `cache`: keep the longest common prefix of what it holds and `wanted` (nothing
        unless reuse), trim the rest, and return how many tokens were kept."""
        if self.backend is not None:
            _set_idle(self.backend, self, False)
        _set_idle(backend, self, False)
        release_retained(backend, keep_group=self.group)
        if cache is not self.cache or backend is not self.backend or cache.length != len(self.tokens):
            self.tokens = []  # not ours, or changed behind our back: its contents are unknown
        self.cache, self.backend = cache, backend
        kept = common_prefix_length(self.tokens, wanted) if reuse else 0
        # The rest is about to be replaced by a prompt: a backend that can keep the freed cells taken while it
        # is prefilled (llama.cpp's unified buffer: park_tail) places that prompt in cells of its own.
        backend.park_tail(cache, cache.length - kept)
        del self.tokens[kept:]
        return kept

    def release(self, reuse: bool = True) -> None:
        """End a request: keep the cache's tokens for the next one (or empty it when not reuse)."""
        if self.cache is None:
            return
        if not reuse or self.cache.length != len(self.tokens):
            self.drop()
        elif self.tokens:
            _set_idle(self.backend, self, True)

    def drop(self) -> None:
        """Empty the cache and forget its tokens."""
        if self.cache is not None:
            self.cache.trim(self.cache.length)
        self.tokens = []
        if self.backend is not None:
            _set_idle(self.backend, self, False)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items a and b share (the index where they first differ, or the shorter length)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# backend -> the idle owners that keep tokens in a cache of it (weak both ways: neither is kept alive).
_idle_owners: "weakref.WeakKeyDictionary[object, weakref.WeakSet[RetainedPrefix]]" = weakref.WeakKeyDictionary()
_owners_by_id: dict[int, "weakref.WeakSet[RetainedPrefix]"] = {}  # for backends that take no weak reference


def _owners(backend, create: bool):
    try:
        owners = _idle_owners.get(backend)
        if owners is None and create:
            owners = _idle_owners[backend] = weakref.WeakSet()
    except TypeError:
        owners = _owners_by_id.get(id(backend))
        if owners is None and create:
            owners = _owners_by_id[id(backend)] = weakref.WeakSet()
    return owners


def _set_idle(backend, owner: RetainedPrefix, idle: bool) -> None:
    owners = _owners(backend, create=idle)
    if owners is None:
        return
    if idle:
        owners.add(owner)
    else:
        owners.discard(owner)


def release_retained(backend, keep_group: object | None = None) -> int:
    """Empty every cache that idle owners keep on `backend` (before something needs its memory), except those
    of keep_group when it is not None; returns how many."""
    owners = _owners(backend, create=False)
    if not owners:
        return 0
    dropped = [owner for owner in owners if keep_group is None or owner.group is not keep_group]
    for owner in dropped:
        owners.discard(owner)
        owner.drop()
    return len(dropped)
