"""The HTTP/1.1 pool against a scripted server: each test says what the server sends, byte
for byte, and checks what the pool makes of it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.core.errors import PoolTimeout, UpstreamConnectError, UpstreamProtocolError
from gateway.upstream.base import Origin, Timeouts
from gateway.upstream.http1 import H1Pool
from tests.waiting import eventually

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class Server:
    """A TCP server on 127.0.0.1 answering each connection with ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection was closed by the pool

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    def pool(self, **options) -> H1Pool:
        settings = dict(max_connections=2, warm_connections=0, timeouts=Timeouts(1.0, 2.0, 1.0, 0.3), high_water=1024)
        settings.update(options)
        origin = Origin("127.0.0.1", self.port, None, f"127.0.0.1:{self.port}".encode(), b"http")
        return H1Pool(origin, **settings)


async def test_keep_alive_reuses_one_connection():
    async def script(reader, writer):
        for _ in range(3):
            await server.read_request(reader)
            writer.write(OK)

    async with Server(script) as server:
        pool = server.pool()
        for _ in range(3):
            response = await pool.request(b"POST", b"/v1/completions", [(b"x-a", b"1")], b"{}")
            assert response.status == 200 and await response.body.read_all(1, 100) == b"ok"
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"\r\nx-a: 1\r\n" in server.requests[0] and server.requests[0].endswith(b"\r\n\r\n{}")
        await pool.aclose()


async def test_a_stale_keep_alive_connection_is_retried_once_on_a_fresh_one():
    async def script(reader, writer):
        await server.read_request(reader)
        if server.connections == 1:
            writer.write(OK)
            await writer.drain()
            await server.read_request(reader)  # the second request on it: close without answering
            return
        writer.write(OK)

    async with Server(script) as server:
        pool = server.pool()
        first = await pool.request(b"POST", b"/x", [], b"{}")
        await first.body.read_all(1, 100)
        second = await pool.request(b"POST", b"/x", [], b"{}")
        assert second.status == 200 and await second.body.read_all(1, 100) == b"ok"
        assert server.connections == 2
        await pool.aclose()


async def test_interim_responses_and_chunked_bodies():
    async def script(reader, writer):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-Up: 1\r\n\r\n")
        writer.write(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    async with Server(script) as server:
        pool = server.pool()
        response = await pool.request(b"POST", b"/x", [], b"{}")
        assert response.status == 200 and response.header(b"x-up") == b"1"
        assert await response.body.read_all(1, 100) == b"hello world"
        await pool.aclose()


async def test_a_malformed_response_is_a_protocol_error():
    async def script(reader, writer):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nbroken header line without colon\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with Server(script) as server:
        pool = server.pool()
        with pytest.raises(UpstreamProtocolError):
            await pool.request(b"POST", b"/x", [], b"{}")
        await pool.aclose()


async def test_pool_timeout_when_every_connection_is_busy_and_connect_errors():
    async def script(reader, writer):
        await server.read_request(reader)
        await asyncio.sleep(2)

    async with Server(script) as server:
        pool = server.pool(max_connections=1)
        busy = asyncio.ensure_future(pool.request(b"POST", b"/x", [], b"{}"))
        await eventually(lambda: server.connections == 1, what="the first request's connection")
        with pytest.raises(PoolTimeout):
            await pool.request(b"POST", b"/x", [], b"{}")
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await pool.aclose()
    closed = server.pool()  # the server is gone now
    with pytest.raises(UpstreamConnectError):
        await closed.request(b"POST", b"/x", [], b"{}")
    await closed.aclose()


async def test_backpressure_stops_reading_and_cancel_closes_the_connection():
    sent = asyncio.Event()
    written = {"bytes": 0}

    async def script(reader, writer):
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        chunk = b"x" * 65536
        try:
            while True:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 0.5)  # stalls once nothing is read
                written["bytes"] += len(chunk)
        except asyncio.TimeoutError:
            sent.set()
        try:
            await reader.read()  # until the pool closes the connection (FIN, or RST: unread data)
        finally:
            server.closed.set()

    async with Server(script) as server:
        pool = server.pool(high_water=65536)
        response = await pool.request(b"POST", b"/x", [], b"{}")
        await asyncio.wait_for(sent.wait(), 10)
        # the server stalled with far less than the body written: socket buffers plus one
        # high-water of ours, not 100 MB
        assert written["bytes"] < 40 * 1024 * 1024
        assert response.body.buffered <= 2 * 65536 + 65536
        response.close()  # the client went away
        await asyncio.wait_for(server.closed.wait(), 5)
        assert pool.num_connections == 0
        await pool.aclose()


async def test_warm_connections_are_opened_and_kept():
    async def script(reader, writer):
        await reader.read()

    async with Server(script) as server:
        pool = server.pool(max_connections=4, warm_connections=3)
        await pool.warm()
        assert pool.num_connections == 3 and pool.num_idle == 3
        await pool.aclose()


async def test_a_connection_the_server_closed_is_freed_without_the_garbage_collector():
    """Its parser and its last body call back into it, and it holds both: once the server
    has closed it, it lets go of them, so nothing of it waits for the collector (beside a
    busy machine, an upstream closing kept-alive connections left them in every window)."""
    import gc
    import weakref

    async def script(reader, writer):
        await server.read_request(reader)
        writer.write(OK)
        await writer.drain()  # then the server closes the connection

    async with Server(script) as server:
        pool = server.pool()
        response = await pool.request(b"POST", b"/x", [], b"{}")
        assert await response.body.read_all(1, 100) == b"ok"
        connection = weakref.ref(pool._all.copy().pop())
        del response
        enabled = gc.isenabled()
        gc.disable()
        try:
            await eventually(lambda: connection() is None or connection().is_closed, what="the server's close")
            for _ in range(3):
                await asyncio.sleep(0)
            assert connection() is None
        finally:
            if enabled:
                gc.enable()
        await pool.aclose()
