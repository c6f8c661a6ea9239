"""HTTP/1.1 keep-alive pool: asyncio protocols and httptools, nothing in between.

httpx's own pool spends 1-2.6 ms of CPU per request on this machine (../shared/FACTS.md);
this one spends a few tens of microseconds (BENCHMARKS.md), which is what a relay whose
budget is half a millisecond can afford. ``gateway.upstream.transport`` puts the httpx API
on top of it for everything off the hot path.

One request at a time per connection. Backpressure: the response body is a bounded
``Body``; when it is full the socket is no longer read, so TCP flow control stalls the
server's writes. Cancelling an unfinished response closes its connection, which is how an
HTTP/1.1 inference server (vLLM, SGLang, TGI behind uvicorn) learns to stop generating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import httptools

from gateway.core.errors import (
    GatewayError,
    PoolTimeout,
    UpstreamConnectError,
    UpstreamProtocolError,
)
from gateway.upstream.base import (
    Origin, Timeouts, UpstreamResponse, connect, head_timeout, rewarm_soon, stop_pool, wait_closed,
)
from gateway.upstream.body import Body

__all__ = ["H1Pool"]

logger = logging.getLogger("edgegw.upstream")


class _Stale(Exception):
    """A reused keep-alive connection was closed by the peer before it answered."""


class _H1Connection(asyncio.Protocol):
    def __init__(self, pool: H1Pool) -> None:
        self._pool = pool
        self._loop = pool._loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = self._loop.create_future()  # done once the transport is gone
        self.is_closed = False
        self._paused = False
        self._head: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], Body]] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: Body | None = None
        self._got_bytes = False
        self._keep_alive = True

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        head = self._head
        if head is not None and not head.done():
            head.set_exception(
                _Stale() if not self._got_bytes else UpstreamProtocolError("upstream closed the connection mid-response")
            )
        body = self._body
        if body is not None and not body.is_complete:
            body.feed_error(UpstreamProtocolError("upstream closed the connection mid-response"))
        self._pool._lost(self)
        # the parser and the body call back into this connection, which holds both: let go of
        # them, so that a closed connection is freed at once, not by the garbage collector
        self._parser = None
        self._body = None

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"malformed upstream response: {exc}"))

    # -- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            return  # an interim 1xx response; the real one follows
        self._keep_alive = self._parser.should_keep_alive()
        self._body = Body(self._loop, self._pool._high_water, self._pause, self._drained)
        head = self._head
        if head is not None and not head.done():
            # the body travels with the head: a small response can complete, release this
            # connection and have it taken by the next exchange before our waiter resumes
            head.set_result((status, self._headers, self._body))

    def on_body(self, data: bytes) -> None:
        self._body.feed(data)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        body = self._body
        if body is None:
            return  # end of a 1xx
        body.feed_eof()
        self._head = None
        if self._paused:  # the rest of the socket belongs to the next response
            self._paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self._keep_alive:
            self._pool._release(self)
        else:
            self.transport.close()  # type: ignore[union-attr]

    # -- flow control ----------------------------------------------------------------

    def _pause(self) -> None:
        if not self._paused and not self.is_closed:
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def _drained(self, nbytes: int) -> None:
        if self._paused and self._body is not None and self._body.buffered < self._pool._high_water:
            self._paused = False
            if not self.is_closed:
                self.transport.resume_reading()  # type: ignore[union-attr]

    # -- one exchange ----------------------------------------------------------------

    async def exchange(
        self, data: bytes, timeout: float, within: float | None
    ) -> tuple[int, list[tuple[bytes, bytes]], Body]:
        head = self._head = self._loop.create_future()
        self._got_bytes = False
        self._body = None
        self.transport.write(data)  # type: ignore[union-attr]
        if within is not None and within < timeout:
            handle = self._loop.call_later(within, head_timeout, head, within, True)
        else:
            handle = self._loop.call_later(timeout, head_timeout, head, timeout)
        try:
            status, headers, body = await head
        except BaseException:
            self.cancel()
            raise
        finally:
            handle.cancel()
        return status, headers, body

    def cancel(self) -> None:
        if not self.is_closed and self.transport is not None:
            self.transport.close()
            self.is_closed = True

    def _fail(self, exc: GatewayError) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(exc)
        elif self._body is not None:
            self._body.feed_error(exc)
        self.cancel()


class H1Pool:
    """Keep-alive connections to one origin, at most ``max_connections`` of them."""

    protocol = "http1"

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int,
        warm_connections: int,
        timeouts: Timeouts,
        high_water: int,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._origin = origin
        self._max = max_connections
        self._warm = warm_connections
        self._timeouts = timeouts
        self._high_water = high_water
        self._idle: list[_H1Connection] = []
        self._all: set[_H1Connection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[_H1Connection | None]] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # -- public --------------------------------------------------------------------

    async def request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        head = b"".join(
            [
                method,
                b" ",
                path,
                b" HTTP/1.1\r\nhost: ",
                self._origin.authority,
                b"\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n",
                *[name + b": " + value + b"\r\n" for name, value in headers],
                b"\r\n",
            ]
        )
        data = head + body
        started = time.perf_counter()
        for attempt in (0, 1):
            conn, reused = await self._acquire()
            pool_wait = time.perf_counter() - started
            try:
                status, response_headers, response_body = await conn.exchange(data, self._timeouts.read, head_within)
            except _Stale:
                if reused and attempt == 0:
                    continue  # the server closed an idle connection as we used it: retry once, fresh
                raise UpstreamConnectError("upstream closed the connection before answering") from None
            return UpstreamResponse(status, response_headers, response_body, conn.cancel, pool_wait, protocol="http1")
        raise AssertionError("unreachable")

    async def warm(self) -> None:
        """Open ``warm_connections`` now, so the first requests pay no handshake."""
        missing = self._warm - len(self._all) - self._opening
        if missing <= 0 or self._closed:
            return
        results = await asyncio.gather(*[self._connect() for _ in range(missing)], return_exceptions=True)
        for result in results:
            if isinstance(result, _H1Connection):
                self._release(result)
            elif isinstance(result, GatewayError):
                logger.warning("warm-up of %s failed: %s", self._origin, result.message)

    async def aclose(self) -> None:
        stop_pool(self)
        connections = list(self._all)
        for conn in connections:
            conn.cancel()
        await wait_closed(connections)

    @property
    def num_connections(self) -> int:
        return len(self._all)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def __repr__(self) -> str:
        return (
            f"<H1Pool {self._origin} [{len(self._all)} connections, "
            f"{len(self._idle)} idle, {len(self._waiters)} waiting]>"
        )

    # -- internals -----------------------------------------------------------------

    async def _acquire(self) -> tuple[_H1Connection, bool]:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.is_closed:
                return conn, True
        if self._closed:
            raise UpstreamConnectError("upstream pool closed")
        if len(self._all) + self._opening < self._max:
            return await self._connect(), False
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        handle = self._loop.call_later(self._timeouts.pool, _pool_timeout, waiter, self._timeouts.pool)
        try:
            conn = await waiter
        finally:
            handle.cancel()
            if not waiter.done() or waiter.cancelled():
                self._drop_waiter(waiter)
        if conn is None:  # a slot came free: open a connection ourselves
            return await self._connect(), False
        return conn, True

    def _drop_waiter(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    async def _connect(self) -> _H1Connection:
        self._opening += 1
        try:
            conn = await connect(
                self._loop, lambda: _H1Connection(self), self._origin, self._timeouts.connect
            )
        finally:
            self._opening -= 1
        self._all.add(conn)
        return conn

    def _release(self, conn: _H1Connection) -> None:
        if conn.is_closed or self._closed:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _lost(self, conn: _H1Connection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass
        if self._closed:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break
        if len(self._all) + self._opening < self._warm:
            rewarm_soon(self)


def _pool_timeout(waiter: asyncio.Future, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(PoolTimeout(f"no upstream connection free within {timeout:g} s", retry_after=1.0))
