"""What answers a request: the ``Reply`` contract, and the ``Answer`` a pipeline hands the relay.

A reply has a status and headers at once, then either a whole body (``read_body``) or a
stream of SSE events (``next_events``: complete events as bytes, ``None`` after a quiet
spell so the relay can send a keep-alive, ``b""`` at the end). The relay tells it when its
first token reached the client (``first_token``) and how it ended (``finish``); ``aclose``
releases it at any point (the upstream request is cancelled, the engine sequence aborted).

The kinds, each in this package:

- ``UpstreamReply`` (``upstream.py``): a response from an inference server, read through
  its bounded body; it reports its first token and its end to a ``HealthSink``.
- ``EngineReply`` / ``EngineStreamReply`` (``engine.py``): the edge engine in-process, or
  its own process's HTTP response.
- ``ReplayReply`` (``cached.py``): an answer already in hand (a cache hit, a followed or
  cascaded body); ``FollowerReply``: the answer an identical request in flight is fetching.
- ``HedgedReply`` (``hedged.py``): a stream raced against a late second attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from cache import Flight
from gateway.core.context import RequestContext
from gateway.core.errors import GatewayError

__all__ = ["JSON", "SSE", "Answer", "HealthSink", "Paced", "Recording", "Reply", "SlotHolder"]

SSE = (b"content-type", b"text/event-stream; charset=utf-8")
JSON = (b"content-type", b"application/json")


class SlotHolder(Protocol):
    """A reply's place at its target (``gateway.pipeline.queue.Slot``), given back at its end."""

    waited: float

    def release(self, ttft: float | None = None) -> None: ...


class Reply:
    status = 200
    headers: list[tuple[bytes, bytes]] = []
    label = "-"  # the metrics' target label: an endpoint URL, "edge", "cache", "coalesced"
    pool_wait = 0.0  # seconds spent getting an upstream connection (connect included)
    protocol = ""  # what carried an upstream reply: http1 | http2 | http3
    slot: SlotHolder | None = None  # its place at its target, given back at its end
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
    """Where an upstream reply reports what happened (``gateway.pipeline.fleet.HealthFeed``)."""

    def first_token(self, endpoint: str, ttft_s: float, now: float) -> None: ...

    def ended(self, endpoint: str, ok: bool, tokens: int, duration_s: float, now: float, ttft_s: float | None) -> None: ...

    def answered_error(self, endpoint: str, status: int, started: float, now: float) -> None: ...


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


class Recording(Protocol):
    """Where the relay records an answer for the cache (``gateway.pipeline.caching.Recorder``)."""

    body: bytes | None

    async def feed(self, events: bytes) -> None: ...

    async def finish(self, ok: bool) -> bool: ...


class Answer:
    """A request's reply, with what the response headers say about how it was found."""

    __slots__ = (
        "reply", "x_cache", "age", "route", "recorder", "flight", "ttft", "failed_mid_stream", "hide_usage", "target_kind",
        "original_id",
    )

    def __init__(self) -> None:
        self.reply: Reply | None = None
        self.x_cache: bytes | None = None
        self.age: int | None = None
        self.route = b""
        self.recorder: Recording | None = None
        self.flight: Flight | None = None
        self.ttft: float | None = None  # seconds from arrival to the first relayed event
        self.failed_mid_stream: GatewayError | None = None
        self.hide_usage = False  # the usage chunk was asked for on the client's behalf
        self.target_kind = "none"  # what serves it: edge | endpoint | cache
        self.original_id: bytes | None = None  # a cache hit: the stored answer's id (the replay has its own)

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-edgegw-route", self.route)]
        if self.x_cache is not None:
            headers.append((b"x-cache", self.x_cache))
        if self.age is not None:
            headers.append((b"age", str(self.age).encode()))
        if self.original_id is not None:
            headers.append((b"x-edgegw-cache-original-id", self.original_id))
        return headers

    def route_of_failure(self, exc: GatewayError) -> bytes:
        """The route header of a failed request: its decision if one was made, else why not."""
        return self.route or f"target=none; why={exc.code or exc.type}".encode("ascii", "replace")

    async def close(self, ctx: RequestContext, exc: BaseException | None = None) -> None:
        if self.reply is not None:
            ctx.served.target_stages = self.reply.stages
            await self.reply.aclose()
        if self.flight is not None:
            await self.flight.release(exc)
