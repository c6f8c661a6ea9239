"""What answers a request: a ``Reply``, whatever produced it.

A reply has a status and headers at once, then either a whole body (``read_body``) or a
stream of SSE events (``next_events``: complete events as bytes, ``None`` after a quiet
spell so the relay can send a keep-alive, ``b""`` at the end). The relay tells it when its
first token reached the client (``first_token``) and how it ended (``finish``); ``aclose``
releases it at any point (the upstream request is cancelled, the engine sequence aborted).

The kinds:

- ``UpstreamReply``: a response from an inference server, read through its bounded body;
  it reports its first token and its end to the fleet's ``HealthFeed`` (routing's health).
- ``EngineReply`` (``gateway.edge``, imported only with the engine): the in-process engine.
- ``ReplayReply``: an answer already in hand (a cache hit, a followed or cascaded body).
- ``FollowerReply``: the answer an identical request in flight is fetching (single-flight).
- ``HedgedReply`` (``gateway.dispatch``): a stream raced against a late second attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from cache import Flight, FlightAborted, as_json
from gateway.errors import UpstreamError
from gateway.relay import DONE, EventReader, sse_event, sse_events
from gateway.queueing import Slot
from gateway.upstream import Upstream, UpstreamResponse

__all__ = [
    "JSON",
    "SSE",
    "FollowerReply",
    "HealthSink",
    "Paced",
    "Reply",
    "ReplayReply",
    "UpstreamReply",
]

SSE = (b"content-type", b"text/event-stream; charset=utf-8")
JSON = (b"content-type", b"application/json")


class Reply:
    status = 200
    headers: list[tuple[bytes, bytes]] = []
    label = "-"  # the metrics' target label: an endpoint URL, "edge", "cache", "coalesced"
    pool_wait = 0.0  # seconds spent getting an upstream connection (connect included)
    protocol = ""  # what carried an upstream reply: http1 | http2 | http3
    slot: Slot | None = None  # its place at its target (gateway.queueing), given back at its end
    # (name, seconds) the target measured inside itself, known once the answer has ended:
    # the edge engine's engine_queue, engine_prefill and engine_decode
    stages: tuple[tuple[str, float], ...] = ()

    async def read_body(self) -> bytes:
        raise NotImplementedError

    async def next_events(self) -> bytes | None:
        raise NotImplementedError

    @property
    def in_event(self) -> bool:
        """Part of an event has been relayed but not its end (no comment may go in now)."""
        return False

    def hand_over(self, on_events: Callable[[bytes], None] | None) -> bool:
        """Give each run of complete events to ``on_events`` as it arrives instead of
        through ``next_events`` (``gateway.relay.Splice``), or stop (``None``); False when
        this kind of reply cannot, or cannot now."""
        return False

    def first_token(self, now: float) -> None:
        """The first token reached the client at ``now`` (``time.monotonic()``)."""

    def finish(self, ok: bool, chunks: int, now: float) -> None:
        """The relay is done with this reply: complete (``ok``) or broken off."""

    async def aclose(self) -> None:
        pass


class HealthSink(Protocol):
    """Where an upstream reply reports what happened (``gateway.fleet.HealthFeed``)."""

    def first_token(self, endpoint: str, ttft_s: float, now: float) -> None: ...

    def ended(self, endpoint: str, ok: bool, tokens: int, duration_s: float, now: float, ttft_s: float | None) -> None: ...


class UpstreamReply(Reply):
    """An inference server's response. It reports its end exactly once: when the relay
    finishes it, or else when it is closed (a 4xx, a hedge's loser, a client gone), so the
    endpoint's in-flight count never leaks. Its TTFT is measured from when it was sent."""

    __slots__ = (
        "response", "upstream", "status", "headers", "label", "pool_wait", "protocol", "slot", "sent_at", "_reader",
        "_limit", "_health", "_ttft", "_ended",
    )

    def __init__(
        self,
        response: UpstreamResponse,
        upstream: Upstream,
        health: HealthSink,
        sent_at: float,
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
        self.slot = None
        self.sent_at = sent_at  # time.monotonic() when the request was handed to the pool
        self._reader = EventReader(response.body, ping, upstream.timeouts.read, max_event)
        self._limit = limit
        self._health = health
        self._ttft: float | None = None
        self._ended = False

    async def read_body(self) -> bytes:
        return await self.response.body.read_all(self.upstream.timeouts.read, self._limit)

    def next_events(self):
        return self._reader.next()

    def hand_over(self, on_events: Callable[[bytes], None] | None) -> bool:
        return self._reader.hand_over(on_events)

    @property
    def in_event(self) -> bool:
        return self._reader.in_event

    def first_token(self, now: float) -> None:
        if self._ttft is None:
            self._ttft = now - self.sent_at
            self._health.first_token(self.upstream.url, self._ttft, now)

    def finish(self, ok: bool, chunks: int, now: float) -> None:
        if not self._ended:
            self._ended = True
            self._health.ended(self.upstream.url, ok, chunks, now - self.sent_at, now, self._ttft)
            if self.slot is not None:
                self.slot.release(self._ttft)

    async def aclose(self) -> None:
        # closed before the relay finished it: cancelled, not the endpoint's fault
        self.finish(True, 0, time.monotonic())
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
            self._pending = None
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
        return sse_events(chunks) + DONE


class FollowerReply(Reply):
    """Following an identical request in flight: its chunks as they arrive, or its finished
    entry. ``start()`` waits for the first chunk, and raises ``FlightAborted`` when the leader
    failed before it, so the caller can go upstream itself."""

    label = "coalesced"

    def __init__(self, flight: Flight, stream: bool, include_usage: bool, ping: float) -> None:
        self._flight = flight
        self._stream = stream
        self._include_usage = include_usage
        self._ping = ping
        self.headers = [SSE if stream else JSON]
        self._chunks: Paced | None = None
        self._ahead: bytes | None = None
        self._body: bytes | None = None
        self._done = False
        self._started = False

    async def start(self) -> None:
        """Wait for the first chunk (streams) or the whole answer (JSON)."""
        if not self._stream:
            self._body = as_json(await self._flight.wait())
            return
        events = None
        while events is None:
            events = await self.next_events()
        self._ahead = events

    async def read_body(self) -> bytes:
        if self._body is None:
            self._body = as_json(await self._flight.wait())
        return self._body

    async def next_events(self) -> bytes | None:
        if self._ahead is not None:
            events, self._ahead = self._ahead, None
            return events
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
            if not self._started:
                raise
            raise UpstreamError("the upstream answer this request was following broke off") from None
        if chunk is Paced.QUIET:
            return None
        self._started = True
        return sse_event(chunk)

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()
