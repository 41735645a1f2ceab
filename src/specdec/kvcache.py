"""KV cache protocol (length, capacity, trim) and a preallocated buffer whose rollback only moves a position pointer."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class ContextOverflowError(ValueError):
    """More tokens were asked for than the cache was allocated to hold."""


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
