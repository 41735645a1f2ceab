"""core.partitions: per-owner and total caps on kept per-partition state, least recently used first."""

from __future__ import annotations

import pytest

from specdec.core.partitions import PartitionLRU, owner_of


def test_one_owners_salts_evict_only_its_own_state():
    made = []
    lru = PartitionLRU(lambda: made.append(1) or len(made), total=6, per_owner=2)
    victim = lru.get("alice")
    for salt in range(50):  # mallory churns through salts
        lru.get(("mallory", f"s{salt}"))
    assert lru.peek("alice") == victim  # untouched by another owner's churn
    assert sum(owner_of(p) == "mallory" for p, _ in lru.items()) == 2  # only its 2 newest kept
    assert lru.peek(("mallory", "s49")) is not None and lru.peek(("mallory", "s0")) is None


def test_the_total_cap_drops_the_least_recently_used_and_a_use_refreshes():
    lru = PartitionLRU(dict, total=3, per_owner=3)
    for tenant in ("a", "b", "c"):
        lru.get(tenant)["x"] = tenant
    lru.get("a")  # used again: now the newest
    lru.get("d")
    assert [p for p, _ in lru.items()] == ["c", "a", "d"]
    assert lru.get("b") == {}  # dropped, so made anew
    assert len(lru) == 3


def test_none_is_a_partition_and_peek_makes_nothing():
    lru = PartitionLRU(list, total=2, per_owner=1)
    assert lru.peek(None) is None and len(lru) == 0
    lru.get(None).append(1)
    assert lru.peek(None) == [1] and owner_of(("t", "s")) == "t" and owner_of("t") == "t"
    with pytest.raises(ValueError):
        PartitionLRU(list, total=0)
