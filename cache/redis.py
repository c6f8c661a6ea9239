"""`RedisCache`: the shared tier across replicas and regions (`redis.asyncio`).

Fails open: every command is bounded by a short timeout; a timeout or error is counted,
opens a circuit that skips Redis for `cooldown` seconds, and reads as a miss (or a skipped
write). A request never fails and the event loop never stalls because of Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cache.base import CacheBackend, Entry, fresh_enough
from cache.circuit import Circuit
from cache.metrics import CacheMetrics

logger = logging.getLogger("edgegw.cache")

T = TypeVar("T")

# what a Redis call may fail with: redis errors, our timeout, a refused/reset socket
REDIS_FAILURES: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


def connect(url: str, timeout: float, connect_timeout: float, **kwargs: Any) -> aioredis.Redis:
    """A `redis.asyncio` client with short socket timeouts and no retries (we fail open)."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
        **kwargs,
    )


class RedisCache(CacheBackend):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        timeout: float = 0.05,
        connect_timeout: float = 0.2,
        cooldown: float = 5.0,
        namespace: str = "edgegw",
        max_entry_bytes: int | None = None,
        metrics: CacheMetrics | None = None,
        name: str = "redis",
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.namespace = namespace
        self.max_entry_bytes = max_entry_bytes
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.name = name
        self.circuit = Circuit(cooldown)
        self._client = connect(url, timeout, connect_timeout)

    def __repr__(self) -> str:
        return f"<RedisCache {self.url} namespace={self.namespace!r} circuit={self.circuit.state}>"

    def redis_key(self, key: str) -> str:
        return f"{self.namespace}:c:{key}"

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """Run one Redis round trip under the timeout and the circuit: (ok, result)."""
        if not self.circuit.allow():
            self.metrics.skipped(self.name, op)
            return False, None
        try:
            result = await asyncio.wait_for(fn(), self.timeout)
        except REDIS_FAILURES as exc:
            self.circuit.failure()
            self.metrics.error(self.name, op)
            logger.warning("redis cache %s failed (%s: %s); skipping Redis for %.1fs",
                           op, type(exc).__name__, exc, self.circuit.cooldown)
            return False, None
        except BaseException:
            self.circuit.abandon()  # cancelled (a client gone): no verdict on Redis
            raise
        self.circuit.success()
        return True, result

    async def get(self, key: str, max_age: float | None = None) -> Entry | None:
        started = time.perf_counter()
        rkey = self.redis_key(key)

        async def fetch() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.get(rkey)
                pipe.pttl(rkey)
                return await pipe.execute()

        ok, result = await self._call("get", fetch)
        entry = None
        if ok and result is not None and result[0] is not None:
            data, pttl = result
            now = time.time()
            try:
                entry = Entry.from_bytes(data)
            except (ValueError, KeyError, TypeError):
                self.metrics.error(self.name, "decode")
                entry = None
            if entry is not None:
                entry = entry.with_expiry(now + pttl / 1000 if pttl and pttl > 0 else None)
                if not fresh_enough(entry, max_age, now):
                    entry = None
        self.metrics.looked_up(self.name, entry is not None, started)
        return entry

    async def set(self, key: str, entry: Entry, ttl: float) -> bool:
        if ttl <= 0:
            self.metrics.rejected(self.name, "ttl")
            return False
        if self.max_entry_bytes is not None and entry.size > self.max_entry_bytes:
            self.metrics.rejected(self.name, "oversize")
            return False
        data = entry.to_bytes()
        px = max(1, int(ttl * 1000))
        ok, _ = await self._call("set", lambda: self._client.set(self.redis_key(key), data, px=px))
        if ok:
            self.metrics.stored(self.name, entry.size)
        return ok

    async def ping(self) -> bool:
        """Connect and check Redis (for start-up warm-up and readiness); never raises."""
        ok, _ = await self._call("ping", self._client.ping)
        return ok

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda: self._client.delete(self.redis_key(key)))

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout * 4)
        except REDIS_FAILURES:
            pass
