"""What one HTTP/2 or HTTP/3 connection may cost the gateway (gateway/ingress/guard.py):
floods of resets, PINGs, SETTINGS, empty and control frames end in GOAWAY
(ENHANCE_YOUR_CALM; HTTP/3: H3_EXCESSIVE_LOAD) and a closed connection while the other
listeners keep answering; one connection's frames are handled a turn's worth at a time; a
client that reads nothing is not read either; header limits are answered 431 on the stream;
request bodies that are never read give their flow-control credit back; and
``limits.max_connections`` counts every listener's connections.

Frames are sent raw (tests/raw_h2.py: hyperframe + hpack over TLS, ALPN h2; aioquic's own
client for HTTP/3) to a gateway under ``gateway.ingress.Server`` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path
import weakref

import h2.errors
import hpack
import httpx
import pytest
from aioquic.h3.connection import ErrorCode
from hyperframe.frame import ContinuationFrame, HeadersFrame

from gateway.ingress import H2ServerProtocol
from gateway.ingress.guard import refusal
from gateway.ingress.server import _Connections, should_trim
from gateway.core.settings import LimitSettings, Settings
from tests.conftest import cluster
from tests.fakes import FakeUpstream
from tests.fakes_h3 import IngressGateway, client_pool, fetch, ingress_gateways  # noqa: F401 (fixture)
from loadgen.floods import H2_FLOODS, PREFACE, RawH2, h3_connect, headers_frame
from tests.waiting import eventually

ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
LIMITS = {
    "flood_interval_s": 600,  # refills 1/12 of a limit a minute: a burst is what counts
    "max_stream_resets": 50,
    "max_pings": 50,
    "max_settings": 50,
    "max_empty_frames": 50,
    "max_control_frames": 200,
    "max_header_bytes": 8192,
    "max_header_count": 20,
}


@pytest.fixture(scope="module")
def gw(certificate):
    """One gateway for the flood tests (each floods a connection of its own)."""
    fake = FakeUpstream("http1").start()
    settings = Settings.model_validate({"cache": {"backend": "off"}, "clusters": [cluster(fake)], "limits": LIMITS})
    gateway = IngressGateway(settings, certificate).start()
    yield gateway
    gateway.stop()
    fake.stop()


def error_of(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def flood(client: RawH2, batch, batches: int = 400) -> int:
    """Send ``batch(i)`` until the server closes the connection (or ``batches`` are sent);
    returns the batches sent."""
    for i in range(batches):
        if client.closed.is_set():
            return i
        client.write(batch(i))
        if not await client.drain():
            return i
        await asyncio.sleep(0)  # a loop turn: what the server sent is read meanwhile
    return batches


FLOODS = [pytest.param(make_batch, id=name) for name, make_batch in H2_FLOODS.items()]


@pytest.mark.parametrize("make_batch", FLOODS)
async def test_an_http2_flood_gets_goaway_enhance_your_calm_and_the_connection_closed(gw, certificate, make_batch):
    client = await RawH2.connect(gw.tls_port, certificate[0])
    try:
        sent = await flood(client, make_batch(client))
        assert await client.wait_closed(), f"still open after {sent} batches"
        assert client.goaway is not None, "closed without GOAWAY"
        assert client.goaway.error_code == ENHANCE_YOUR_CALM
    finally:
        await client.close()
    async with httpx.AsyncClient() as http:  # the gateway itself is fine
        assert (await http.get(gw.url + "/healthz")).status_code == 200


async def test_other_listeners_answer_while_a_rapid_reset_flood_runs(gw, certificate):
    """A flood that stays under the reset limit (the client pauses for the others' answers
    between its batches of 20, several hundred streams in all) still leaves the plain
    HTTP/1.1 listener, another HTTP/2 connection and the HTTP/3 listener answering, each
    while the flooding connection is open; the reset limit then closes it."""
    flooder = await RawH2.connect(gw.tls_port, certificate[0])
    other = await RawH2.connect(gw.tls_port, certificate[0])
    h3 = client_pool("h3", gw.h3_port, certificate[0])
    batch = H2_FLOODS["rapid-reset"](flooder)
    answered = 0
    try:
        async with httpx.AsyncClient() as http:
            for i in range(40):
                flooder.write(batch(i))
                if not await flooder.drain() or flooder.closed.is_set():
                    break
                if i % 2:
                    continue
                plain = asyncio.create_task(http.get(gw.url + "/healthz"))
                over_h2 = (await other.response(other.request("/healthz"))).status
                status, _, _ = await fetch(h3, "/healthz", b"")
                assert (await plain).status_code == 200 and over_h2 == 200 and status == 200
                answered += 1
        assert answered >= 1
        assert await flooder.wait_closed()
        assert flooder.goaway is not None and flooder.goaway.error_code == ENHANCE_YOUR_CALM
        assert not other.closed.is_set() and other.goaway is None  # only the flooder was closed
        assert (await other.response(other.request("/healthz"))).status == 200
    finally:
        await h3.aclose()
        await flooder.close()
        await other.close()


async def test_a_stream_over_the_header_limits_gets_431_and_the_connection_lives_on(gw, certificate):
    client = await RawH2.connect(gw.tls_port, certificate[0])
    try:
        many = await client.response(client.request(extra=[(f"x-h{i}", "v") for i in range(25)]))
        assert many.status == 431
        error = error_of(many.body)
        assert error["code"] == "request_header_fields_too_large" and "20 headers" in error["message"]
        large = await client.response(client.request(extra=[("x-big", "a" * 9000)]))
        assert large.status == 431
        assert error_of(large.body)["code"] == "request_header_fields_too_large"
        body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}'
        big_post = await client.response(client.request("/v1/chat/completions", "POST", [("x-big", "a" * 9000)], body))
        assert big_post.status == 431
        fine = await client.response(client.request(extra=[(f"x-h{i}", "v") for i in range(15)]))
        assert fine.status == 200
        assert client.goaway is None and not client.closed.is_set()
    finally:
        await client.close()


async def test_frames_are_handled_a_turn_at_a_time():
    """One read holding a thousand PINGs: a turn's worth is answered, reading pauses, the
    rest follows turn by turn; a large header block makes the connection sit turns out."""
    limits = LimitSettings(max_frames_per_turn=64, max_pings=10_000)
    transport = _Transport()
    state = _ServerState()
    protocol = H2ServerProtocol(_never_called, state, {}, limits=limits)
    protocol.connection_made(transport)
    transport.written.clear()
    pings = b"".join(RawH2.ping(i) for i in range(1000))
    protocol.data_received(PREFACE + RawH2.settings() + pings)
    first = transport.acks()
    assert 0 < first <= 64
    assert transport.paused
    turns = 1
    while transport.acks() < 1000:
        await asyncio.sleep(0)  # the loop's next turn
        turns += 1
        assert turns < 100
    assert turns >= 1000 // 64
    assert not transport.paused
    # a request with a 12 KB header block costs ~400 frames: the next turns are sat out
    block = headers_frame(hpack.Encoder(), 1, extra=[("x-big", "a" * 20_000)])
    before = transport.acks()
    protocol.data_received(block + RawH2.ping(5000))
    assert transport.acks() == before  # the PING waits behind the block's cost
    assert transport.paused
    for _ in range(30):
        await asyncio.sleep(0)
    assert transport.acks() == before + 1
    protocol.connection_lost(None)


async def test_a_closed_connections_half_sent_header_block_is_freed_at_once():
    """h2's connection object refers to itself, so without help only a full run of the
    cyclic garbage collector frees it, and with it the header block a CONTINUATION flood
    left half-sent: a flood of a thousand connections kept ~150 MB until then. Closed, it is
    freed as its last reference goes, the collector off."""
    transport = _Transport()
    protocol = H2ServerProtocol(_never_called, _ServerState(), {}, limits=LimitSettings())
    protocol.connection_made(transport)
    block = HeadersFrame(1, data=b"\x00" * 4096)  # no END_HEADERS: more is to come
    more = [ContinuationFrame(1, data=b"\x00" * 4096).serialize() for _ in range(4)]
    protocol.data_received(PREFACE + RawH2.settings() + block.serialize() + b"".join(more))
    h2_connection = weakref.ref(protocol._h2)
    enabled = gc.isenabled()
    gc.disable()
    try:
        protocol.connection_lost(None)
        del protocol
        for _ in range(3):  # the turn it was to sit out (its block's cost) comes and goes
            await asyncio.sleep(0)
        assert h2_connection() is None
    finally:
        if enabled:
            gc.enable()


async def test_a_client_that_reads_nothing_is_not_read_either(ingress_gateways, certificate):
    """PINGs from a client that never reads the acknowledgements (the PING limit out of the
    way): once the socket's buffer is full, the gateway stops reading the connection, so its
    own buffer stays small instead of growing by what the client sends."""
    gw = ingress_gateways({"limits": {"max_pings": 1_000_000_000}})
    client = await RawH2.connect(gw.tls_port, certificate[0], reading=False, rcvbuf=4096)
    pings = b"".join(RawH2.ping(i) for i in range(4096))  # 68 KiB
    try:
        protocol = await eventually(  # the listener registers the connection when its handshake is done
            lambda: next((c for c in list(gw.server.server_state.connections) if isinstance(c, H2ServerProtocol)), None),
            what="the gateway's side of the connection",
        )
        most = 0
        stopped = False
        for _ in range(400):  # 27 MiB at most
            client.write(pings)
            while not stopped:
                try:
                    await asyncio.wait_for(client.drain(), 2)
                    break
                except asyncio.TimeoutError:
                    # the gateway stopped reading; or it still reads, only slowly (a busy machine): wait on
                    stopped = not protocol._transport.is_reading()
            if stopped:
                break
            most = max(most, protocol._transport.get_write_buffer_size())
            assert most < 2 * 1024 * 1024
        else:
            pytest.fail("the gateway read 27 MiB of PINGs from a client that reads nothing")
        most = max(most, protocol._transport.get_write_buffer_size())
        assert most < 2 * 1024 * 1024
        assert not protocol._transport.is_reading()
    finally:
        await client.close()


async def test_unread_request_bodies_give_their_window_back(ingress_gateways, certificate):
    """The gateway's own HTTP/2 pool in front of an edgegw that answers 401 (and 404)
    without reading the bodies: 40 requests of 16 KB (ten times HTTP/2's initial connection
    window) on one pooled connection, each answered."""
    gw = ingress_gateways({"auth": {"mode": "required"}, "clusters": []})
    pool = client_pool("h2", gw.tls_port, certificate[0], write=5, read=5)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * 16_000 + b'"}]}'
    try:
        first = None
        for i in range(40):
            path = "/v1/chat/completions" if i % 4 else "/no/such/path"
            status, _, answer = await fetch(pool, path, body)
            assert status == (401 if i % 4 else 404), answer
            first = first or pool._conns[0]
        assert pool._conns == [first]  # every request on the one connection
    finally:
        await pool.aclose()


async def test_max_connections_counts_every_listener(ingress_gateways, certificate):
    """``limits.max_connections: 2``: two kept-alive HTTP/1.1 connections leave no room on
    the HTTPS (HTTP/2) and HTTP/3 listeners (503 too_many_connections, Retry-After), and two
    HTTP/2 connections none on the HTTP/1.1 one."""
    gw = ingress_gateways({"limits": {"max_connections": 2}})
    held = [httpx.AsyncClient() for _ in range(2)]
    try:
        for http in held:
            assert (await http.get(gw.url + "/healthz")).status_code == 200
        for kind, port in (("h2", gw.tls_port), ("h3", gw.h3_port)):
            pool = client_pool(kind, port, certificate[0])
            try:
                status, headers, answer = await fetch(pool, "/healthz", b"")
            finally:
                await pool.aclose()
            assert status == 503, kind
            assert dict(headers)[b"retry-after"] == b"1"
            assert error_of(answer)["code"] == "too_many_connections"
    finally:
        for http in held:
            await http.aclose()
    connections = gw.server.server_state.connections
    for _ in range(500):  # the gateway sees the clients above leave
        if not connections:
            break
        await asyncio.sleep(0.01)
    assert not connections
    h2_clients = [await RawH2.connect(gw.tls_port, certificate[0]) for _ in range(2)]
    try:
        for client in h2_clients:
            assert (await client.response(client.request())).status == 200
        async with httpx.AsyncClient() as http:
            refused = await http.get(gw.url + "/healthz")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
    finally:
        for client in h2_clients:
            await client.close()


async def test_idle_tls_and_http2_connections_are_closed_after_the_header_timeout(ingress_gateways, certificate):
    """A connection to the HTTPS port that never finishes its TLS handshake, and an HTTP/2
    connection that never opens a stream, are closed after ``limits.header_timeout_s`` (as
    an HTTP/1.1 connection that sends no request head), not kept for the keep-alive."""
    gw = ingress_gateways({"limits": {"header_timeout_s": 0.5}})
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.tls_port)  # no ClientHello
    idle = await RawH2.connect(gw.tls_port, certificate[0])
    try:
        assert await asyncio.wait_for(reader.read(), 20) == b""  # closed by the gateway
        assert await idle.wait_closed()
        assert idle.goaway is not None and idle.goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    finally:
        writer.close()
        await idle.close()


# -- HTTP/3 ------------------------------------------------------------------------------


async def test_http3_header_limits_are_answered_431_on_the_stream(gw, certificate):
    async with h3_connect(gw.h3_port, certificate[0]) as client:
        status, body = await client.response(client.request([(b"x-h%d" % i, b"v") for i in range(25)]))
        assert status == 431 and "20 headers" in error_of(body)["message"]
        # 2,000 headers / 40 KB: over max_header_bytes before decoding, refused undecoded
        status, body = await client.response(client.request([(b"x-h%d" % i, b"v" * 16) for i in range(2000)]))
        assert status == 431 and error_of(body)["code"] == "request_header_fields_too_large"
        status, body = await client.response(client.request([(b"x-big", b"a" * 9000)], end_stream=False))
        assert status == 431
        status, _ = await client.response(client.request([(b"x-h%d" % i, b"v") for i in range(15)]))
        assert status == 200
        assert not client.terminated.is_set()


@pytest.mark.parametrize(
    "send",
    [
        pytest.param(lambda client, i: client.rapid_reset(), id="rapid-reset"),
        pytest.param(lambda client, i: client._quic.send_ping(i), id="ping"),
        pytest.param(lambda client, i: client.unknown_control_frames(), id="unknown-control-frames"),
    ],
)
async def test_an_http3_flood_is_closed_with_h3_excessive_load(gw, certificate, send):
    async with h3_connect(gw.h3_port, certificate[0]) as client:
        for i in range(400):
            if client.terminated.is_set():
                break
            send(client, i)
            client.transmit()
            await asyncio.sleep(0)
            if i % 20 == 19:
                try:
                    await client.ping()  # a round trip: what was sent has been handled
                except ConnectionError:
                    break  # closed meanwhile
        await asyncio.wait_for(client.terminated.wait(), 20)
        assert client.close_code == ErrorCode.H3_EXCESSIVE_LOAD
    async with httpx.AsyncClient() as http:
        assert (await http.get(gw.url + "/healthz")).status_code == 200


# -- a fake transport for the protocol-level test -------------------------------------------


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def acks(self) -> int:
        data = b"".join(self.written)
        count = pos = 0
        while pos + 9 <= len(data):
            length = int.from_bytes(data[pos : pos + 3], "big")
            if data[pos + 3] == 0x6 and data[pos + 4] & 0x1:
                count += 1
            pos += 9 + length
        return count

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _ServerState:
    def __init__(self) -> None:
        self.connections: set = set()
        self.tasks: set = set()
        self.default_headers: list = []


_never_called = refusal(500, "unexpected", "the protocol-level test sends no request")


@pytest.mark.parametrize(
    "gone, freed, settled, trims",
    [
        pytest.param(150, 0, False, True, id="150 connections gone since the last trim"),
        pytest.param(60, 0, False, False, id="fewer gone, still closing"),
        pytest.param(60, 0, True, True, id="fewer gone, and none in the last look: the tail of a flood"),
        pytest.param(3, 0, True, False, id="a few gone"),
        pytest.param(3, 40 << 20, False, True, id="free lists grew 40 MB"),
        pytest.param(3, 8 << 20, False, False, id="free lists grew 8 MB"),
    ],
)
def test_freed_memory_is_given_back_after_many_closes_or_a_grown_free_list(gone, freed, settled, trims):
    assert should_trim(gone, freed, settled) is trims


def test_the_connections_that_close_are_counted_for_the_trimmer():
    """A flood of connections that each live for milliseconds never raises the count of open
    ones: the trimmer counts those that close instead."""
    connections = _Connections()
    for n in range(250):
        connections.add(n)
        connections.discard(n)
        connections.discard(n)  # a second discard of one connection is not a second close
    connections.add("kept")
    assert len(connections) == 1 and connections.gone == 250
    assert should_trim(connections.gone, 0)


def test_mallocs_free_bytes_are_read_from_glibc():
    """What ``should_trim`` is fed: malloc's free bytes grow when objects are freed (glibc's
    ``mallinfo2``; this machine's C library has it). In a fresh interpreter: in one that ran
    the rest of the suite, the heap already holds free chunks that new objects fill and that a
    free may consolidate into the top and hand back, so the count moves either way."""
    script = textwrap.dedent(
        """
        from gateway.ingress.server import _free_heap_bytes
        free_bytes = _free_heap_bytes()
        assert free_bytes is not None, "no mallinfo2"
        # ~50 MB in small chunks between ones that stay, as connections' buffers lie between
        # longer-lived objects (nothing at the heap's top to hand back by itself)
        pairs = [(bytearray(1000), bytearray(600)) for _ in range(50_000)]
        kept = [small for _, small in pairs]
        allocated = free_bytes()
        del pairs
        print(free_bytes() - allocated)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 32 << 20
