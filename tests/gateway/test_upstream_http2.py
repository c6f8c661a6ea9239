"""The HTTP/2 pool against a scripted h2 server: warm connections kept warm, refused streams
sent again, flow control that follows the reader, cancellation as RST_STREAM."""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest

from gateway.upstream.base import Origin, Timeouts
from gateway.upstream.http2 import H2Pool
from tests.waiting import eventually


class H2Server:
    """An h2c server on 127.0.0.1; ``answer(server, conn, stream_id)`` decides each reply."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections: list[_Conn] = []
        self.resets: list[tuple[int, int]] = []  # (stream id, error code) the client reset
        self.requests = 0
        self.changed = asyncio.Event()

    async def __aenter__(self) -> H2Server:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for conn in self.connections:
            conn.transport.close()
        await self.server.wait_closed()

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self.connections if not c.closed)

    def pool(self, **options) -> H2Pool:
        settings = dict(max_connections=4, warm_connections=0, timeouts=Timeouts(1.0, 2.0, 1.0, 0.5), high_water=65535)
        settings.update(options)
        origin = Origin("127.0.0.1", self.port, None, f"127.0.0.1:{self.port}".encode(), b"http")
        return H2Pool(origin, **settings)


class _Conn(asyncio.Protocol):
    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.closed = False
        self.pending: dict[int, bytes] = {}  # stream id -> data waiting for window

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        self.flush()
        self.server.connections.append(self)
        self.server.changed.set()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.changed.set()

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.server.requests += 1
                self.server.answer(self.server, self, event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.server.resets.append((event.stream_id, event.error_code))
                self.server.changed.set()
            elif isinstance(event, h2.events.WindowUpdated):
                self.send_pending()
        self.flush()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.closed:
            self.transport.write(data)

    def respond(self, stream_id: int, body: bytes, end: bool = True) -> None:
        self.h2.send_headers(stream_id, [(b":status", b"200"), (b"content-length", str(len(body)).encode())])
        self.pending[stream_id] = body
        self.send_pending(end)

    def send_pending(self, end: bool = True) -> None:
        for stream_id, body in list(self.pending.items()):
            try:
                window = self.h2.local_flow_control_window(stream_id)
            except h2.exceptions.StreamClosedError:
                del self.pending[stream_id]
                continue
            size = min(window, self.h2.max_outbound_frame_size, len(body))
            while size > 0:
                self.h2.send_data(stream_id, body[:size])
                body = body[size:]
                size = min(self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size, len(body))
            if body:
                self.pending[stream_id] = body
            else:
                del self.pending[stream_id]
                if end:
                    self.h2.end_stream(stream_id)
        self.flush()


def answer_ok(server, conn, stream_id) -> None:
    conn.respond(stream_id, b"ok")


async def wait_until(server: H2Server, predicate, timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            server.changed.clear()
            await server.changed.wait()


async def test_warm_connections_are_opened_and_kept_after_goaway():
    async with H2Server(answer_ok) as server:
        pool = server.pool(warm_connections=3)
        await pool.warm()
        assert pool.num_connections == 3
        await wait_until(server, lambda: server.open_connections == 3)
        goner = server.connections[0]
        goner.h2.close_connection()  # GOAWAY, then the server hangs up
        goner.flush()
        goner.transport.close()
        await wait_until(server, lambda: len(server.connections) == 4 and server.open_connections == 3)
        for _ in range(50):
            if pool.num_connections == 3:
                break
            await asyncio.sleep(0.02)
        assert pool.num_connections == 3
        await pool.aclose()


async def test_a_refused_stream_is_sent_again():
    def refuse_first(server, conn, stream_id) -> None:
        if server.requests == 1:
            conn.h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        else:
            conn.respond(stream_id, b"second try")

    async with H2Server(refuse_first) as server:
        pool = server.pool()
        response = await pool.request(b"POST", b"/v1/chat/completions", [], b"{}")
        assert response.status == 200 and await response.body.read_all(1, 100) == b"second try"
        assert server.requests == 2
        await pool.aclose()


async def test_goaway_past_a_stream_sends_it_again_on_a_new_connection():
    def goaway_first(server, conn, stream_id) -> None:
        if server.requests == 1:
            conn.h2.close_connection(last_stream_id=0)  # "I processed nothing"
        else:
            conn.respond(stream_id, b"on a new connection")

    async with H2Server(goaway_first) as server:
        pool = server.pool()
        response = await pool.request(b"POST", b"/x", [], b"{}")
        assert await response.body.read_all(1, 100) == b"on a new connection"
        assert len(server.connections) == 2
        await pool.aclose()


async def test_flow_control_follows_the_reader_and_cancel_resets_the_stream():
    body = b"x" * (1024 * 1024)

    def big(server, conn, stream_id) -> None:
        conn.respond(stream_id, body)

    async with H2Server(big) as server:
        pool = server.pool(high_water=16384)
        response = await pool.request(b"POST", b"/x", [], b"{}")
        await asyncio.sleep(0.2)
        conn = server.connections[0]
        stream_id = next(iter(conn.pending))
        # the server may send one stream window (high_water) and no more while nobody reads
        assert len(body) - len(conn.pending[stream_id]) <= 16384
        assert response.body.buffered <= 16384
        first = await response.body.read(1)
        assert first and len(first) <= 16384
        # reading gave the window back: the server sends more
        await eventually(lambda: len(body) - len(conn.pending[stream_id]) > 16384, what="the server to send more")
        response.close()
        await wait_until(server, lambda: server.resets)
        assert server.resets[0][1] == h2.errors.ErrorCodes.CANCEL
        await pool.aclose()


@pytest.mark.parametrize("count", [3])
async def test_streams_share_connections(count):
    async with H2Server(answer_ok) as server:
        pool = server.pool(max_connections=1)
        responses = await asyncio.gather(*[pool.request(b"POST", b"/x", [], b"{}") for _ in range(count)])
        assert [await r.body.read_all(1, 10) for r in responses] == [b"ok"] * count
        assert len(server.connections) == 1
        await pool.aclose()
