"""`MemoryCache`: a byte-bounded LRU with per-entry TTL; the embedded default and the test fake."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from cache.base import CacheBackend, Entry, fresh_enough
from cache.metrics import CacheMetrics


class MemoryCache(CacheBackend):
    """LRU bounded by `max_bytes` (entry sizes plus key lengths). Entries larger than
    `max_entry_bytes` are not stored. Expired entries are dropped when met."""

    def __init__(
        self,
        max_bytes: int,
        max_entry_bytes: int,
        *,
        metrics: CacheMetrics | None = None,
        clock: Callable[[], float] = time.time,
        name: str = "memory",
    ) -> None:
        if max_bytes <= 0 or max_entry_bytes <= 0:
            raise ValueError("max_bytes and max_entry_bytes must be positive")
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self.metrics = metrics if metrics is not None else CacheMetrics()
        self.name = name
        self._clock = clock
        self._items: OrderedDict[str, tuple[Entry, int]] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __repr__(self) -> str:
        return (
            f"<MemoryCache entries={len(self._items)} bytes={self._bytes}/{self.max_bytes}>"
        )

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]

    def _report(self) -> None:
        self.metrics.memory_usage(self._bytes, len(self._items))

    async def get(self, key: str, max_age: float | None = None) -> Entry | None:
        return self.get_nowait(key, max_age)

    def get_nowait(self, key: str, max_age: float | None = None) -> Entry | None:
        started = time.perf_counter()
        now = self._clock()
        item = self._items.get(key)
        entry = None
        if item is not None:
            candidate = item[0]
            if candidate.expires_at is not None and candidate.expires_at <= now:
                self._drop(key)
                self._report()
            elif fresh_enough(candidate, max_age, now):
                self._items.move_to_end(key)
                entry = candidate
        self.metrics.looked_up(self.name, entry is not None, started)
        return entry

    async def set(self, key: str, entry: Entry, ttl: float) -> bool:
        return self.set_nowait(key, entry, ttl)

    def set_nowait(self, key: str, entry: Entry, ttl: float) -> bool:
        if ttl <= 0:
            self.metrics.rejected(self.name, "ttl")
            return False
        size = entry.size + len(key)
        if entry.size > self.max_entry_bytes or size > self.max_bytes:
            self._drop(key)  # the newest answer is too big; do not keep serving an older one
            self._report()
            self.metrics.rejected(self.name, "oversize")
            return False
        self._drop(key)
        self._items[key] = (entry.with_expiry(self._clock() + ttl), size)
        self._bytes += size
        evicted = 0
        while self._bytes > self.max_bytes:
            _, (_, old_size) = self._items.popitem(last=False)
            self._bytes -= old_size
            evicted += 1
        if evicted:
            self.metrics.evicted(self.name, evicted)
        self.metrics.stored(self.name, entry.size)
        self._report()
        return True

    async def delete(self, key: str) -> None:
        self._drop(key)
        self._report()

    async def close(self) -> None:
        self._items.clear()
        self._bytes = 0
        self._report()
