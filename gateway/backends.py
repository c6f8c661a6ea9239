"""What a backend hands the relay: a ``Reply``.

A reply has a status and headers at once, then either a whole body (``read_body``) or a
stream of SSE events (``next_events``: complete events as bytes, ``None`` after a quiet
``ping_interval`` so the relay can send a keep-alive comment, ``b""`` at the end).

- ``UpstreamReply``: a response from an inference server, read through its bounded body.
- ``EngineReply`` (``gateway.edge``): the in-process edge engine.
- ``ReplayReply``: a stored answer from the exact-response cache.
- ``FollowerReply``: the answer another request is fetching right now (single-flight).

Errors from the cache are translated into ``gateway.errors`` here (the engine's in
``gateway.edge``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from cache import Flight, FlightAborted, as_json
from gateway.errors import UpstreamError
from gateway.relay import DONE, EventReader
from gateway.upstream import Upstream, UpstreamResponse
from routing import HealthState

__all__ = ["Reply", "UpstreamReply", "ReplayReply", "FollowerReply", "Paced", "SSE", "JSON"]

SSE = (b"content-type", b"text/event-stream; charset=utf-8")
JSON = (b"content-type", b"application/json")


class Reply:
    status = 200
    headers: list[tuple[bytes, bytes]] = []
    label = "-"  # metrics label: upstream URL, "edge", "cache"
    upstream: Upstream | None = None
    pool_wait = 0.0
    protocol = ""  # what carried an upstream reply: http1 | http2 | http3
    first: bytes | None = None  # events read ahead (hedging waits for the first byte)

    async def read_body(self) -> bytes:
        raise NotImplementedError

    async def next_events(self) -> bytes | None:
        raise NotImplementedError

    @property
    def in_event(self) -> bool:
        return False

    async def aclose(self) -> None:
        pass


class UpstreamReply(Reply):
    """An inference server's response. It reports its end to routing's ``HealthState``
    exactly once: when the relay finishes it (``end``), or else when it is closed (a 4xx, a
    hedge's loser, a client gone), so the endpoint's in-flight count never leaks."""

    __slots__ = (
        "response", "upstream", "status", "headers", "label", "pool_wait", "protocol", "first",
        "_reader", "_limit", "_health", "_started_at", "_ended",
    )

    def __init__(
        self,
        response: UpstreamResponse,
        upstream: Upstream,
        health: HealthState,
        started_at: float,
        ping: float,
        max_event: int,
        limit: int,
    ) -> None:
        self.response = response
        self.upstream = upstream
        self.status = response.status
        self.headers = response.headers
        self.label = upstream.url
        self.pool_wait = response.pool_wait
        self.protocol = response.protocol
        self.first = None
        self._reader = EventReader(response.body, ping, upstream.timeouts.read, max_event)
        self._limit = limit
        self._health = health
        self._started_at = started_at  # time.monotonic() when the request was sent
        self._ended = False

    def end(self, ok: bool, chunks: int, duration: float | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        elapsed = now - self._started_at if duration is None else duration
        self._health.record_end(self.upstream.url, ok, chunks, elapsed, now)

    async def read_body(self) -> bytes:
        return await self.response.body.read_all(self.upstream.timeouts.read, self._limit)

    def next_events(self):
        return self._reader.next()

    @property
    def in_event(self) -> bool:
        return self._reader.in_event

    async def aclose(self) -> None:
        self.end(True, 0)
        self.response.close()


class Paced:
    """Pulls an async iterator one item at a time; ``QUIET`` when ``ping`` seconds pass
    without one (the pending pull is kept, not lost)."""

    QUIET = object()

    def __init__(self, items: AsyncIterator[bytes], ping: float) -> None:
        self._items = items
        self._ping = ping
        self._pending: asyncio.Future | None = None

    async def next(self):
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._items.__anext__())
        done, _ = await asyncio.wait((self._pending,), timeout=self._ping)
        if not done:
            return self.QUIET
        pending, self._pending = self._pending, None
        return pending.result()  # raises StopAsyncIteration at the end

    async def aclose(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            try:
                await self._pending
            except BaseException:
                pass
        aclose = getattr(self._items, "aclose", None)
        if aclose is not None:
            await aclose()


class ReplayReply(Reply):
    """An answer already in hand: a cache hit in the shape asked for (the stored payloads
    as SSE events, or JSON), or a body read ahead (a followed or cascaded answer)."""

    def __init__(self, body: bytes | None, chunks: list[bytes] | None, label: str = "cache") -> None:
        self.headers = [JSON if chunks is None else SSE]
        self.label = label
        self._body = body
        self._chunks = chunks

    async def read_body(self) -> bytes:
        return self._body or b""

    async def next_events(self) -> bytes:
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return b""
        return b"".join([b"data: " + c + b"\n\n" for c in chunks]) + DONE


class FollowerReply(Reply):
    """Following an identical request in flight: its chunks as they arrive, or its
    finished entry. Raises ``FlightAborted`` before the first byte when the leader fails,
    so the caller can go upstream itself."""

    label = "coalesced"

    def __init__(self, flight: Flight, stream: bool, include_usage: bool, ping: float) -> None:
        self._flight = flight
        self._include_usage = include_usage
        self._ping = ping
        self.headers = [SSE if stream else JSON]
        self._chunks: Paced | None = None
        self._done = False
        self.started = False

    async def read_body(self) -> bytes:
        return as_json(await self._flight.wait())

    async def next_events(self) -> bytes | None:
        if self._done:
            return b""
        if self._chunks is None:
            self._chunks = Paced(self._flight.follow(include_usage=self._include_usage), self._ping)
        try:
            chunk = await self._chunks.next()
        except StopAsyncIteration:
            self._done = True
            return DONE
        except FlightAborted:
            self._done = True
            if not self.started:
                raise
            raise UpstreamError("the upstream answer this request was following broke off") from None
        if chunk is Paced.QUIET:
            return None
        self.started = True
        return b"data: " + chunk + b"\n\n"

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()
