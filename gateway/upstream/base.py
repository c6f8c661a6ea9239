"""What every upstream pool shares: where it connects (``Origin``), its timeouts, the
response it hands back (``UpstreamResponse``, whose body is a ``Body``: ``body.py``), and
the pool of multiplexed connections that HTTP/2 and HTTP/3 have in common.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import ssl as ssl_module

from gateway.core.errors import DeadlineExceeded, PoolTimeout, UpstreamConnectError, UpstreamReadTimeout
from gateway.upstream.body import Body

__all__ = [
    "MultiplexedPool", "Origin", "Pool", "Refused", "Timeouts", "UpstreamResponse",
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
