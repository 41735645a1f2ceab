"""How many cache partitions keep cross-request state: at most so many per owner and so many in all, the least
recently used dropped first, so neither one tenant's salts nor many tenants grow memory without bound."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

Value = TypeVar("Value")

MAX_PARTITIONS = 64
MAX_PARTITIONS_PER_OWNER = 8


def owner_of(partition: Hashable) -> Hashable:
    """Whose share a partition counts against: a (tenant, salt) pair is its tenant's; anything else is its own."""
    return partition[0] if isinstance(partition, tuple) and len(partition) == 2 else partition


class PartitionLRU(Generic[Value]):
    """A value per partition (None, everything shared, is a partition like any other), made on first use; past
    `per_owner` partitions of one owner that owner's least recently used is dropped, past `total` the least
    recently used of all, so one tenant's many salts evict only its own state."""

    def __init__(self, make: Callable[[], Value], total: int = MAX_PARTITIONS,
                 per_owner: int = MAX_PARTITIONS_PER_OWNER):
        if total < 1 or per_owner < 1:
            raise ValueError(f"need total >= 1 and per_owner >= 1, got {total} and {per_owner}")
        self.make, self.total, self.per_owner = make, total, per_owner
        self._values: OrderedDict[Hashable, Value] = OrderedDict()

    def get(self, partition: Hashable) -> Value:
        """The partition's value, made if it has none (or had one dropped); it becomes the most recently used."""
        value = self._values.pop(partition) if partition in self._values else self.make()
        self._values[partition] = value
        owner = owner_of(partition)
        mine = [p for p in self._values if owner_of(p) == owner]
        for dropped in mine[: max(0, len(mine) - self.per_owner)]:
            del self._values[dropped]
        while len(self._values) > self.total:
            self._values.popitem(last=False)
        return value

    def peek(self, partition: Hashable) -> Value | None:
        """The partition's value if it has one, without making it or counting a use."""
        return self._values.get(partition)

    def items(self) -> Iterator[tuple[Hashable, Value]]:
        return iter(list(self._values.items()))

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()
