"""Answers that come from the cache: a stored answer replayed, and the answer of an
identical request in flight followed (single-flight)."""

from __future__ import annotations

from cache import Flight, FlightAborted, as_json
from gateway.core.errors import UpstreamError
from gateway.core.sse import DONE, sse_event, sse_events
from gateway.replies.base import JSON, SSE, Paced, Reply

__all__ = ["FollowerReply", "ReplayReply"]


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
