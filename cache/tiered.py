"""`TieredCache`: a fast tier (memory) in front of a shared one (Redis).

Reads try the front, then the back; a back hit fills the front for the entry's remaining
TTL. Writes go to both at once. Each tier counts its own hits and misses, so overall hits
are hits:front + hits:back and overall misses are misses:back.
"""

from __future__ import annotations

import asyncio
import time

from cache.base import CacheBackend, Entry


class TieredCache(CacheBackend):
    name = "tiered"

    def __init__(self, front: CacheBackend, back: CacheBackend, *, fill_ttl: float = 60.0):
        self.front = front
        self.back = back
        self.fill_ttl = fill_ttl  # front TTL for a back hit whose remaining TTL is unknown
        self.metrics = front.metrics

    def __repr__(self) -> str:
        return f"<TieredCache front={self.front!r} back={self.back!r}>"

    async def get(self, key: str, max_age: float | None = None) -> Entry | None:
        entry = await self.front.get(key, max_age)
        if entry is not None:
            return entry
        entry = await self.back.get(key, max_age)
        if entry is not None:
            ttl = self.fill_ttl
            if entry.expires_at is not None:
                ttl = entry.expires_at - time.time()
            if ttl > 0:
                await self.front.set(key, entry, ttl)
        return entry

    async def set(self, key: str, entry: Entry, ttl: float) -> bool:
        stored = await asyncio.gather(self.front.set(key, entry, ttl), self.back.set(key, entry, ttl))
        return any(stored)

    async def delete(self, key: str) -> None:
        await asyncio.gather(self.front.delete(key), self.back.delete(key))

    async def close(self) -> None:
        await asyncio.gather(self.front.close(), self.back.close())
