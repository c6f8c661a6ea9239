"""`Entry` (a stored response) and `CacheBackend` (the one async interface of every tier).

A backend never raises for an infrastructure failure: it maps it to a miss (`get` returns
None) or a skipped write (`set` returns False), and counts it in its `CacheMetrics`.
"""

from __future__ import annotations

import abc
import struct
import time
from dataclasses import dataclass, field, replace

import orjson

from cache.metrics import CacheMetrics

_MAGIC = b"EGW1"
_HEADER_LEN = struct.Struct("<I")
# approximate per-chunk memory overhead (a bytes object plus its list slot)
CHUNK_OVERHEAD = 40


@dataclass(slots=True)
class Entry:
    """One stored response, kept as received: the JSON body, or the SSE chunk payloads."""

    kind: str  # "chat" | "completions"
    chunks: list[bytes] | None = None  # JSON payloads of the SSE data events, no [DONE]
    body: bytes | None = None  # the JSON response body
    created_at: float = field(default_factory=time.time)  # wall clock when produced
    # when the entry stops being served; set by a backend on `get`, never serialised
    expires_at: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.chunks is None and self.body is None:
            raise ValueError("an Entry needs chunks or a body")

    @property
    def size(self) -> int:
        """Bytes this entry accounts for in a byte-bounded tier."""
        size = len(self.body) if self.body is not None else 0
        if self.chunks is not None:
            size += sum(len(c) for c in self.chunks) + CHUNK_OVERHEAD * len(self.chunks)
        return size

    def age(self, now: float | None = None) -> float:
        """Seconds since the response was produced (for the `Age` header)."""
        return max(0.0, (time.time() if now is None else now) - self.created_at)

    def with_expiry(self, expires_at: float | None) -> Entry:
        return replace(self, expires_at=expires_at)

    def to_bytes(self) -> bytes:
        """Compact, byte-faithful serialisation: an orjson header, then the raw payloads."""
        header = orjson.dumps(
            {
                "k": self.kind,
                "t": self.created_at,
                "b": None if self.body is None else len(self.body),
                "c": None if self.chunks is None else [len(c) for c in self.chunks],
            }
        )
        parts = [_MAGIC, _HEADER_LEN.pack(len(header)), header]
        if self.body is not None:
            parts.append(self.body)
        if self.chunks is not None:
            parts.extend(self.chunks)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> Entry:
        """Inverse of `to_bytes`; raises ValueError on anything malformed."""
        if len(data) < 8 or data[:4] != _MAGIC:
            raise ValueError("not a serialised cache entry")
        (header_len,) = _HEADER_LEN.unpack_from(data, 4)
        pos = 8 + header_len
        try:
            header = orjson.loads(data[8:pos])
        except orjson.JSONDecodeError as exc:
            raise ValueError("corrupt cache entry header") from exc
        body = None
        if header["b"] is not None:
            body = data[pos : pos + header["b"]]
            pos += header["b"]
        chunks = None
        if header["c"] is not None:
            chunks = []
            for n in header["c"]:
                chunks.append(data[pos : pos + n])
                pos += n
        if pos != len(data) or pos < 8 + header_len:
            raise ValueError("cache entry length mismatch")
        return cls(kind=header["k"], chunks=chunks, body=body, created_at=header["t"])


class CacheBackend(abc.ABC):
    """The async interface every cache tier implements."""

    name: str = "backend"
    metrics: CacheMetrics

    @abc.abstractmethod
    async def get(self, key: str, max_age: float | None = None) -> Entry | None:
        """The live entry for `key` no older than `max_age` seconds, or None (a miss)."""

    @abc.abstractmethod
    async def set(self, key: str, entry: Entry, ttl: float) -> bool:
        """Store `entry` for `ttl` seconds; False when it was not stored (too big, error)."""

    async def delete(self, key: str) -> None:
        """Drop `key` if present."""

    async def close(self) -> None:
        """Release connections; the backend is not used afterwards."""

    async def __aenter__(self) -> CacheBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def fresh_enough(entry: Entry, max_age: float | None, now: float) -> bool:
    return max_age is None or entry.age(now) <= max_age
