"""A response body in flight: a bounded buffer between the connection and the relay.

The body of a response is filled by the connection's protocol (``data_received``) and
drained by the relay. When more than ``high_water`` bytes wait unread, the protocol stops
taking data from the peer: HTTP/1.1 pauses reading the socket (TCP flow control pushes
back), HTTP/2 withholds WINDOW_UPDATE for the stream (HTTP/2 flow control pushes back).
So a slow client slows the upstream, and memory per stream stays bounded. A consumer that
takes arrivals as they come (``Body.hand_over``: the relay's splice) answers for that bound
itself while it does: it hands the stream back once its client is behind.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from gateway.core.errors import PayloadTooLarge, UpstreamReadTimeout

__all__ = ["Body"]


class Body:
    """A response body in flight: a deque of chunks with a byte bound.

    Silence is timed with one timer per quiet spell, not one per read: arrivals only note
    the time, and the timer, when it fires early, re-arms itself for the remainder."""

    __slots__ = (
        "_loop", "_chunks", "_size", "_flow", "_eof", "_exc", "_waiter", "_high", "_on_full", "_on_drain",
        "_last", "_timer", "_timeout", "_expired", "_consumer",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        high_water: int,
        on_full: Callable[[], None] | None,
        on_drain: Callable[[int], None],
    ) -> None:
        self._loop = loop
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._flow = 0  # flow-controlled bytes not yet given back to the peer
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._high = high_water
        self._on_full = on_full
        self._on_drain = on_drain
        self._last = loop.time()  # when data last arrived (or the last quiet spell ended)
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._expired = False
        self._consumer: Callable[[bytes], None] | None = None

    # -- producer side (the protocol) --------------------------------------------------

    def feed(self, data: bytes, flow: int | None = None) -> None:
        self._last = self._loop.time()
        if self._consumer is not None and not self._chunks:
            self._consumer(data)  # taken at once: given back to the peer at once
            self._on_drain(len(data) if flow is None else flow)
            return
        self._chunks.append(data)
        self._size += len(data)
        self._flow += len(data) if flow is None else flow
        if self._size >= self._high and self._on_full is not None:
            self._on_full()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._stop_timer()
        self._wake()

    def feed_error(self, exc: BaseException) -> None:
        if not self._eof and self._exc is None:
            self._exc = exc
            self._stop_timer()
            self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timer(self) -> None:
        self._timer = None
        if self._eof or self._exc is not None:
            return
        now = self._loop.time()
        due = self._last + self._timeout
        if now < due:  # data came in meanwhile: the quiet spell started later
            self._timer = self._loop.call_at(due, self._on_timer)
            return
        if self._waiter is None:
            return  # nobody is waiting; the next read arms a timer again
        self._last = now  # the next quiet spell starts now
        self._expired = True
        self._timer = self._loop.call_at(now + self._timeout, self._on_timer)
        self._wake()

    @property
    def is_complete(self) -> bool:
        return self._eof

    def hand_over(self, consumer: Callable[[bytes], None] | None) -> bool:
        """From now on give each arrival to ``consumer`` as it comes, inside the protocol's
        callback, instead of keeping it for ``read`` (which then wakes only at the end, on
        an error, or after a quiet spell); ``None`` goes back to keeping arrivals. Refused
        (False) while something is kept unread or the body has ended: read that first."""
        if consumer is not None and (self._chunks or self._eof or self._exc is not None):
            return False
        self._consumer = consumer
        return True

    @property
    def buffered(self) -> int:
        return self._size

    # -- consumer side (the relay) -----------------------------------------------------

    async def read(self, timeout: float | None) -> bytes | None:
        """All bytes buffered so far (waiting for some); ``b""`` at the end; ``None`` if
        nothing arrived for ``timeout`` seconds (the caller decides what that means)."""
        if not self._chunks and not self._eof and self._exc is None:
            waiter = self._waiter = self._loop.create_future()
            if timeout is not None and (self._timer is None or timeout != self._timeout):
                if self._timer is not None:
                    self._timer.cancel()
                self._timeout = timeout
                self._timer = self._loop.call_at(self._last + timeout, self._on_timer)
            try:
                await waiter
            finally:
                self._waiter = None
        if self._expired:
            self._expired = False
            if not self._chunks and not self._eof and self._exc is None:
                return None
        chunks = self._chunks
        if chunks:
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._size = 0
            flow, self._flow = self._flow, 0
            self._on_drain(flow)
            return data
        if self._exc is not None:
            raise self._exc
        if self._eof:
            return b""
        return None

    async def read_all(self, timeout: float, limit: int) -> bytes:
        parts = []
        total = 0
        while True:
            data = await self.read(timeout)
            if data is None:
                raise UpstreamReadTimeout(f"upstream sent nothing for {timeout:g} s")
            if not data:
                return b"".join(parts)
            total += len(data)
            if total > limit:
                raise PayloadTooLarge(f"upstream response exceeds {limit} bytes", code="upstream_response_too_large")
            parts.append(data)
