"""An inference server's response as a ``Reply``."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.core.sse import EventReader
from gateway.replies.base import HealthSink, Reply
from gateway.upstream import Upstream, UpstreamResponse

__all__ = ["UpstreamReply"]


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

    def answered_error(self) -> None:
        """The upstream answered with a 5xx status: its end, reported as what it says of the
        endpoint (``HealthSink.answered_error``), no TTFT measured."""
        if not self._ended:
            self._ended = True
            self._health.answered_error(self.upstream.url, self.status, self.sent_at, time.monotonic())
            if self.slot is not None:
                self.slot.release(None)

    async def aclose(self) -> None:
        # closed before the relay finished it: cancelled, not the endpoint's fault
        self.finish(True, 0, time.monotonic())
        if self.slot is not None:  # ended before it had its slot (an error status): give it back now
            self.slot.release(self._ttft)
        self.response.close()
