from __future__ import annotations

import asyncio
import time

import pytest
import redis

from cache.base import Entry
from cache.memory import MemoryCache
from cache.metrics import CacheMetrics
from cache.redis import RedisCache
from cache.tiered import TieredCache

CLOSED_URL = "redis://127.0.0.1:1/0"


@pytest.fixture
async def rcache(redis_url: str, namespace: str):
    cache = RedisCache(redis_url, namespace=namespace, timeout=0.5)
    yield cache
    await cache.close()


async def test_round_trip(rcache: RedisCache, chat_chunks: list[bytes], chat_body: bytes) -> None:
    assert await rcache.ping()
    assert await rcache.get("k1") is None
    streamed = Entry(kind="chat", chunks=chat_chunks, created_at=time.time())
    assert await rcache.set("k1", streamed, ttl=30)
    assert await rcache.set("k2", Entry(kind="chat", body=chat_body), ttl=30)
    hit = await rcache.get("k1")
    assert hit == streamed and hit.chunks == chat_chunks  # byte-faithful through Redis
    assert hit.expires_at is not None and 25 < hit.expires_at - time.time() <= 30
    assert (await rcache.get("k2")).body == chat_body
    assert rcache.metrics.counts["hits:redis"] == 2 and rcache.metrics.counts["misses:redis"] == 1
    assert rcache.metrics.counts["errors"] == 0


async def test_keys_live_under_the_namespace(
    rcache: RedisCache, namespace: str, raw_redis: redis.Redis
) -> None:
    await rcache.set("k", Entry(kind="chat", body=b"{}"), ttl=30)
    assert raw_redis.exists(f"{namespace}:c:k") == 1
    assert 0 < raw_redis.pttl(f"{namespace}:c:k") <= 30_000
    await rcache.delete("k")
    assert raw_redis.exists(f"{namespace}:c:k") == 0


async def test_ttl_expiry_and_max_age(rcache: RedisCache) -> None:
    await rcache.set("short", Entry(kind="chat", body=b"{}"), ttl=0.2)
    assert await rcache.get("short") is not None
    await asyncio.sleep(0.3)
    assert await rcache.get("short") is None
    old = Entry(kind="chat", body=b"{}", created_at=time.time() - 100)
    await rcache.set("old", old, ttl=30)
    assert await rcache.get("old", max_age=50) is None
    assert await rcache.get("old", max_age=150) is not None


async def test_oversize_and_corrupt_entries(
    redis_url: str, namespace: str, raw_redis: redis.Redis
) -> None:
    cache = RedisCache(redis_url, namespace=namespace, max_entry_bytes=10, timeout=0.5)
    try:
        assert not await cache.set("big", Entry(kind="chat", body=b"x" * 11), ttl=30)
        assert raw_redis.exists(f"{namespace}:c:big") == 0
        raw_redis.set(f"{namespace}:c:bad", b"not an entry")
        assert await cache.get("bad") is None
        assert cache.metrics.counts["errors:redis:decode"] == 1
        assert cache.metrics.counts["rejected:redis:oversize"] == 1
    finally:
        await cache.close()


async def test_unreachable_redis_degrades_to_misses() -> None:
    metrics = CacheMetrics()
    cache = RedisCache(CLOSED_URL, timeout=0.2, cooldown=60, metrics=metrics)
    try:
        # each bounded by the timeout (a generous bound here: a hang fails)
        assert await asyncio.wait_for(cache.get("k"), 10) is None
        assert await asyncio.wait_for(cache.set("k", Entry(kind="chat", body=b"{}"), ttl=30), 10) is False
        assert await asyncio.wait_for(cache.ping(), 10) is False
        assert metrics.counts["errors:redis:get"] == 1
        assert cache.circuit.state == "open"
        # while the circuit is open, Redis is skipped outright
        assert await cache.get("k") is None
        assert metrics.counts["skipped:redis:set"] == 1
        assert metrics.counts["skipped:redis:get"] == 1
        assert metrics.counts["misses:redis"] == 2
    finally:
        await cache.close()


async def test_hung_redis_times_out_without_stalling_the_loop(silent_server: str) -> None:
    cache = RedisCache(silent_server, timeout=0.1, cooldown=0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        assert await asyncio.wait_for(cache.get("k"), 10) is None  # the timeout, not a hang
        assert ticks >= 1  # the event loop kept running while Redis hung
        assert await asyncio.wait_for(cache.set("k", Entry(kind="chat", body=b"{}"), ttl=30), 10) is False
        assert cache.metrics.counts["errors:redis:get"] == 1
        assert cache.metrics.counts["errors:redis:set"] == 1
    finally:
        task.cancel()
        await cache.close()


async def test_circuit_recovers_after_cooldown(redis_url: str, namespace: str) -> None:
    cache = RedisCache(redis_url, namespace=namespace, timeout=0.5, cooldown=0.1)
    try:
        cache.circuit.failure()  # as after an error
        assert await cache.get("k") is None
        assert cache.metrics.counts["skipped:redis:get"] == 1
        await asyncio.sleep(0.15)
        assert await cache.set("k", Entry(kind="chat", body=b"{}"), ttl=30)  # the probe
        assert cache.circuit.state == "closed"
    finally:
        await cache.close()


async def test_tiered_fills_front_from_back(redis_url: str, namespace: str) -> None:
    metrics = CacheMetrics()
    front = MemoryCache(10_000, 1_000, metrics=metrics)
    back = RedisCache(redis_url, namespace=namespace, timeout=0.5, metrics=metrics)
    cache = TieredCache(front, back)
    try:
        entry = Entry(kind="chat", body=b'{"a":1}')
        assert await cache.set("k", entry, ttl=30)
        assert "k" in front and await back.get("k") == entry
        await front.delete("k")  # e.g. another replica stored it
        assert await cache.get("k") == entry  # from Redis
        assert "k" in front  # and now in memory, for about the remaining TTL
        assert 25 < front.get_nowait("k").expires_at - time.time() <= 30
        hits = metrics.counts["hits:redis"]
        assert await cache.get("k") == entry
        assert metrics.counts["hits:redis"] == hits  # served by the front
        assert await cache.get("missing") is None
    finally:
        await cache.close()


async def test_tiered_keeps_working_without_redis() -> None:
    cache = TieredCache(MemoryCache(10_000, 1_000), RedisCache(CLOSED_URL, timeout=0.2))
    try:
        entry = Entry(kind="chat", body=b"{}")
        assert await cache.set("k", entry, ttl=30)  # stored in memory at least
        assert await cache.get("k") == entry
        assert await cache.get("other") is None
        assert cache.back.metrics.counts["errors"] >= 1
    finally:
        await cache.close()


async def test_a_cancelled_probe_does_not_keep_the_circuit_open(silent_server: str) -> None:
    """Clients that give up while the half-open probe is under way must not leave the
    circuit open for good: the next call probes again."""
    cache = RedisCache(silent_server, timeout=5.0, cooldown=0.05)
    try:
        cache.circuit.failure()
        await asyncio.sleep(0.1)  # half-open: the next call is the probe
        probe = asyncio.create_task(cache.get("k"))
        await asyncio.sleep(0.1)
        probe.cancel()  # the client went away while the probe waited on Redis
        with pytest.raises(asyncio.CancelledError):
            await probe
        assert cache.circuit.state == "half-open"
        assert cache.circuit.allow()  # a new call may probe
    finally:
        await cache.close()
