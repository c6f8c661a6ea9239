"""What every upstream pool hands back: a response whose body is a bounded buffer.

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
from typing import Protocol

import ssl as ssl_module

from gateway.core.errors import DeadlineExceeded, PayloadTooLarge, PoolTimeout, UpstreamConnectError, UpstreamReadTimeout

__all__ = [
    "Body", "MultiplexedPool", "Origin", "Pool", "Refused", "Timeouts", "UpstreamResponse",
    "connect", "head_timeout", "rewarm_soon", "split_status", "stop_pool", "wait_closed",
]


class Timeouts:
    __slots__ = ("connect", "read", "write", "pool")

    def __init__(self, connect: float, read: float, write: float, pool: float) -> None:
        self.connect = connect
        self.read = read
        self.write = write
        self.pool = pool


class Origin:
    """Where a pool connects: host and port, TLS context (None for cleartext), and the
    ``Host`` / ``:authority`` and scheme its requests carry; or, with ``uds``, the path of a
    Unix socket (the node's engine process: ``gateway.engine.process``)."""

    __slots__ = ("host", "port", "ssl", "authority", "scheme", "uds")

    def __init__(
        self,
        host: str,
        port: int,
        ssl: ssl_module.SSLContext | None,
        authority: bytes,
        scheme: bytes,
        *,
        uds: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.ssl = ssl
        self.authority = authority
        self.scheme = scheme
        self.uds = uds

    def __str__(self) -> str:
        return f"unix:{self.uds}" if self.uds is not None else f"{self.host}:{self.port}"


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




class UpstreamResponse:
    """Status and headers of an upstream response, and its body as it arrives."""

    __slots__ = ("status", "headers", "body", "pool_wait", "protocol", "_cancel", "_closed")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: Body,
        cancel: Callable[[], None],
        pool_wait: float,
        *,
        protocol: str = "",
    ) -> None:
        self.status = status
        self.headers = headers  # names lower-cased
        self.body = body
        self.pool_wait = pool_wait  # seconds spent getting a connection (connect included)
        self.protocol = protocol  # http1 | http2 | http3: what carried it (an HTTP/3 endpoint may fall back)
        self._cancel = cancel
        self._closed = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def close(self) -> None:
        """Release the response; an unfinished body is cancelled (RST_STREAM / connection close),
        which is how the inference server learns the client has gone."""
        if not self._closed:
            self._closed = True
            if not self.body.is_complete:
                self._cancel()

    async def aclose(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<UpstreamResponse [{self.status}] buffered={self.body.buffered}>"


class Refused(Exception):
    """The server did not process the stream (GOAWAY or REQUEST_REJECTED past it,
    REFUSED_STREAM, or the connection went before any answer): safe to send again on
    another connection."""


class MultiplexedPool:
    """What the HTTP/2 and HTTP/3 pools share: up to ``max_connections`` connections to one
    origin, each carrying many streams. A request takes the least busy connection with room
    for a stream; below the maximum and with none free it opens one (one opening at a time,
    the others wait for it), else it waits up to the pool timeout for a stream to end. A
    refused stream is sent again, on another connection, up to three times.

    A subclass opens a connection (``_connect``: a protocol with ``streams``,
    ``has_capacity``, ``exchange`` and ``cancel``, which calls ``_stream_done`` when a stream
    ends and ``_lost`` when it goes), keeps its pool warm (``warm``) and says when a lost
    connection is replaced (``_lost``)."""

    protocol: str

    def __init__(self, origin: Origin, *, max_connections: int, warm_connections: int, timeouts: Timeouts, high_water: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._origin = origin
        self._max = max_connections
        self._warm = warm_connections
        self._timeouts = timeouts
        self._high_water = high_water
        self._conns: list = []
        self._opening: asyncio.Future | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        request_headers = [
            (b":method", method),
            (b":scheme", self._origin.scheme),
            (b":authority", self._origin.authority),
            (b":path", path),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]
        started = time.perf_counter()
        for attempt in range(3):
            conn = await self._acquire()
            pool_wait = time.perf_counter() - started
            try:
                status, response_headers, response_body, stream_id = await conn.exchange(
                    request_headers, body, self._timeouts, head_within
                )
            except Refused:
                if attempt < 2:
                    continue  # never processed: again, on another connection
                raise UpstreamConnectError(f"{self._origin} refused the stream three times") from None
            return UpstreamResponse(
                status, response_headers, response_body, lambda: conn.cancel(stream_id), pool_wait, protocol=self.protocol
            )
        raise AssertionError("unreachable")

    async def warm(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        stop_pool(self)
        connections = list(self._conns)
        self._conns.clear()
        for conn in connections:
            conn.close()
        await self._closed_all(connections)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    @property
    def num_streams(self) -> int:
        return sum(len(c.streams) for c in self._conns)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._origin} [{len(self._conns)} connections, {self.num_streams} streams]>"

    # -- for the subclasses ------------------------------------------------------------

    async def _connect(self):
        raise NotImplementedError

    async def _closed_all(self, connections: list) -> None:
        """After ``aclose`` closed ``connections``: wait for what must finish closing."""

    def _lost(self, conn) -> None:
        raise NotImplementedError

    def _forget(self, conn) -> bool:
        """Drop a connection that went away; whether it was still in the pool."""
        try:
            self._conns.remove(conn)
        except ValueError:
            return False
        self._stream_done()
        return True

    # -- internals -----------------------------------------------------------------------

    async def _acquire(self):
        deadline = self._loop.time() + self._timeouts.pool
        while True:
            if self._closed:
                raise UpstreamConnectError("upstream pool closed")
            best = None
            for conn in self._conns:
                if conn.has_capacity and (best is None or len(conn.streams) < len(best.streams)):
                    best = conn
            if best is not None:
                return best
            if len(self._conns) < self._max:
                if self._opening is None:
                    return await self._open()
                await asyncio.shield(self._opening)
                continue
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                raise PoolTimeout(f"no {self.protocol.upper().replace('HTTP', 'HTTP/')} stream free within {self._timeouts.pool:g} s", retry_after=1.0)
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            handle = self._loop.call_later(remaining, _wake, waiter)
            try:
                await waiter
            finally:
                handle.cancel()

    async def _open(self):
        opening = self._opening = self._loop.create_future()
        try:
            conn = await self._connect()
        except BaseException as exc:
            if isinstance(exc, Exception):
                opening.set_exception(exc)
                opening.exception()  # mark retrieved: other waiters re-raise their own copy
            else:
                opening.cancel()
            raise
        finally:
            self._opening = None
        if self._closed:
            conn.close()
            raise UpstreamConnectError("upstream pool closed")
        self._conns.append(conn)
        opening.set_result(conn)
        return conn

    def _stream_done(self, conn=None) -> None:
        """A stream ended (or a connection came or went): the first waiter may try again."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def stop_pool(pool) -> None:
    """The first step of a pool's ``aclose``: no new request, its background tasks
    (``pool._tasks``) cancelled, every request waiting for a connection (``pool._waiters``)
    failed."""
    pool._closed = True
    for task in list(pool._tasks):
        task.cancel()
    for waiter in pool._waiters:
        if not waiter.done():
            waiter.set_exception(UpstreamConnectError("upstream pool closed"))


def split_status(headers) -> tuple[int, list[tuple[bytes, bytes]]]:
    """(``:status``, the regular headers) of an HTTP/2 or HTTP/3 response head."""
    status = 0
    regular = []
    for name, value in headers:
        if name == b":status":
            status = int(value)
        elif not name.startswith(b":"):
            regular.append((name, value))
    return status, regular


class Pool(Protocol):
    async def request(
        self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, head_within: float | None = None
    ) -> UpstreamResponse:
        """``head_within``: seconds the response headers may take (default: the read timeout)."""
        ...

    async def warm(self) -> None: ...

    async def aclose(self) -> None: ...


async def connect(
    loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.Protocol], origin: Origin, timeout: float
) -> asyncio.Protocol:
    """Open a TCP (+TLS) or Unix socket connection to ``origin`` with ``factory``'s protocol,
    mapping failures to ``UpstreamConnectError``."""
    host, port, ssl = origin.host, origin.port, origin.ssl
    if origin.uds is not None:
        opening = loop.create_unix_connection(factory, origin.uds)
    else:
        opening = loop.create_connection(factory, host, port, ssl=ssl, server_hostname=host if ssl else None)
    try:
        _, protocol = await asyncio.wait_for(opening, timeout)
    except asyncio.TimeoutError:
        raise UpstreamConnectError(f"connect to {origin} timed out after {timeout:g} s") from None
    except (OSError, ssl_module.SSLError) as exc:
        raise UpstreamConnectError(f"cannot connect to {origin}: {exc}") from None
    return protocol


def rewarm_soon(pool) -> None:
    """Re-open the pool's warm connections shortly (``pool.warm()``), in a task the pool
    keeps (``pool._tasks``) and cancels when it closes: servers close idle keep-alives, and
    a GOAWAY or a lost connection must not leave the pool below ``warm_connections``."""
    task = pool._loop.create_task(_rewarm(pool))
    pool._tasks.add(task)
    task.add_done_callback(pool._tasks.discard)


async def _rewarm(pool) -> None:
    await asyncio.sleep(0.05)
    await pool.warm()


async def wait_closed(connections, timeout: float = 1.0) -> None:
    """Wait until each closed connection's transport has reported it lost (a TLS connection
    closes in a few round trips), aborting those still open after ``timeout`` seconds, so
    that nothing is left to the event loop's shutdown."""
    waiting = [c.lost for c in connections if not c.lost.done()]
    if waiting:
        await asyncio.wait(waiting, timeout=timeout)
    for conn in connections:
        if not conn.lost.done() and conn.transport is not None:
            conn.transport.abort()


def head_timeout(head: asyncio.Future, timeout: float, budget: bool = False) -> None:
    """``call_later`` target: fail a response-headers future that waited too long (``budget``:
    the limit was what was left of the request's latency budget)."""
    if not head.done():
        if budget:
            error = DeadlineExceeded(
                f"no response headers from the upstream within the request's latency budget ({timeout * 1000:.0f} ms left)"
            )
        else:
            error = UpstreamReadTimeout(f"no response headers from the upstream within {timeout:g} s")
        head.set_exception(error)
