from __future__ import annotations

import pytest

from cache.base import CHUNK_OVERHEAD, Entry
from cache.memory import MemoryCache
from cache.metrics import CacheMetrics


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def body_entry(n: int, created_at: float = 1000.0) -> Entry:
    return Entry(kind="chat", body=b"x" * n, created_at=created_at)


def test_entry_size_counts_payload_and_chunk_overhead() -> None:
    assert body_entry(100).size == 100
    assert Entry(kind="chat", chunks=[b"ab", b"cde"]).size == 5 + 2 * CHUNK_OVERHEAD


async def test_round_trip_and_metrics() -> None:
    metrics = CacheMetrics()
    cache = MemoryCache(10_000, 1_000, metrics=metrics)
    assert await cache.get("k") is None
    assert await cache.set("k", body_entry(10), ttl=60)
    hit = await cache.get("k")
    assert hit is not None and hit.body == b"x" * 10 and hit.expires_at is not None
    assert metrics.counts["hits"] == 1 and metrics.counts["misses"] == 1
    assert metrics.counts["stored_bytes"] == 10 and metrics.counts["lookups"] == 2
    assert repr(cache) == "<MemoryCache entries=1 bytes=11/10000>"


async def test_ttl_expiry() -> None:
    clock = Clock()
    cache = MemoryCache(10_000, 1_000, clock=clock)
    await cache.set("k", body_entry(10), ttl=5)
    clock.now += 4.9
    assert await cache.get("k") is not None
    clock.now += 0.2
    assert await cache.get("k") is None
    assert len(cache) == 0 and cache.nbytes == 0  # dropped when met


async def test_max_age_rejects_older_entries_but_keeps_them() -> None:
    clock = Clock()
    cache = MemoryCache(10_000, 1_000, clock=clock)
    await cache.set("k", body_entry(10, created_at=clock.now), ttl=60)
    clock.now += 30
    assert await cache.get("k", max_age=10) is None
    assert await cache.get("k", max_age=30) is not None
    assert (await cache.get("k")).age(clock.now) == 30


async def test_lru_byte_bound_and_eviction() -> None:
    metrics = CacheMetrics()
    cache = MemoryCache(300, 200, metrics=metrics)  # each entry: 99 bytes + 1-byte key
    for key in "abc":
        assert await cache.set(key, body_entry(99), ttl=60)
    assert cache.nbytes == 300 and len(cache) == 3
    await cache.get("a")  # a is now most recently used; b is the LRU
    await cache.set("d", body_entry(99), ttl=60)
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.nbytes <= 300
    # a bigger entry evicts as many as needed
    await cache.set("e", body_entry(199), ttl=60)
    assert cache.nbytes <= 300 and "e" in cache
    assert len(cache) == 2
    assert metrics.counts["evictions"] == 3


async def test_overwrite_keeps_accounting_exact() -> None:
    cache = MemoryCache(1000, 500)
    await cache.set("k", body_entry(100), ttl=60)
    await cache.set("k", body_entry(50), ttl=60)
    assert cache.nbytes == 51 and len(cache) == 1
    await cache.delete("k")
    assert cache.nbytes == 0


async def test_oversize_entries_are_not_stored() -> None:
    metrics = CacheMetrics()
    cache = MemoryCache(1000, 100, metrics=metrics)
    assert await cache.set("small", body_entry(100), ttl=60)
    assert not await cache.set("big", body_entry(101), ttl=60)
    assert not await cache.set("chunks", Entry(kind="chat", chunks=[b"x"] * 3), ttl=60)
    assert "big" not in cache and "chunks" not in cache and "small" in cache
    assert metrics.counts["rejected:memory:oversize"] == 2
    # a too-big fresh answer replaces (drops) the old one rather than leaving it served
    assert not await cache.set("small", body_entry(500), ttl=60)
    assert "small" not in cache and cache.nbytes == 0


async def test_zero_ttl_is_not_stored() -> None:
    cache = MemoryCache(1000, 100)
    assert not await cache.set("k", body_entry(1), ttl=0)
    assert len(cache) == 0


def test_bad_bounds() -> None:
    with pytest.raises(ValueError):
        MemoryCache(0, 10)
