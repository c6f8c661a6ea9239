"""Clients that flood the gateway's listeners (tests/gateway/test_ingress_floods.py and
bench/ingress_floods.py): traffic to 127.0.0.1 only.

``RawH2``: HTTP/2 frames built with hyperframe and hpack, sent as they are (no client state
machine refuses to send a thousand PINGs or an endless header block), over TLS with ALPN h2,
as an asyncio protocol. ``H3Client``: aioquic's QUIC client with its HTTP/3 layer, for the
frames the gateway's own HTTP/3 pool never sends (``h3_connect``).

``RawH2.connect(port, ca_file)`` sends the preface and an empty SETTINGS, returns once the
server's SETTINGS are read and acknowledged (or the connection is lost), and parses what
the server sends: ``goaway`` (the first GOAWAY frame), ``closed`` (the connection lost),
``responses[stream_id]`` (status, headers, body, ended) and ``pings_acked``.
``reading=False`` with ``rcvbuf`` is a client that reads nothing.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from dataclasses import dataclass, field

import hpack
from aioquic.asyncio.client import connect as quic_connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection, encode_frame
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def headers_frame(
    encoder: hpack.Encoder, stream_id: int, path: str = "/healthz", method: str = "GET", extra=(), *,
    end_stream: bool = True, end_headers: bool = True,
) -> bytes:
    """A request's HEADERS frame (``end_headers=False``: CONTINUATION frames must follow)."""
    fields = [(":method", method), (":scheme", "https"), (":authority", "127.0.0.1"), (":path", path), *extra]
    frame = HeadersFrame(stream_id, encoder.encode(fields))
    if end_stream:
        frame.flags.add("END_STREAM")
    if end_headers:
        frame.flags.add("END_HEADERS")
    return frame.serialize()


@dataclass
class Response:
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    ended: bool = False
    reset: int | None = None  # RST_STREAM's error code


class RawH2(asyncio.Protocol):
    """The frames the server sends are parsed as they arrive (``data_received``), so a GOAWAY
    is seen even when the connection is reset right after it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        self.goaway: GoAwayFrame | None = None
        self.closed = asyncio.Event()
        self.greeted = asyncio.Event()  # the server's SETTINGS acknowledged, or the connection lost
        self.responses: dict[int, Response] = {}
        self.pings_acked = 0
        self.next_stream = 1
        self._buffer = bytearray()
        self._ended: dict[int, asyncio.Event] = {}
        self._writable: asyncio.Future | None = None

    @classmethod
    async def connect(cls, port: int, ca_file: str, *, reading: bool = True, rcvbuf: int | None = None) -> RawH2:
        context = ssl.create_default_context(cafile=ca_file)
        context.set_alpn_protocols(["h2"])
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        _, client = await loop.create_connection(cls, sock=sock, ssl=context, server_hostname="127.0.0.1")
        assert client.transport.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        if not reading:
            client.transport.pause_reading()
        client.write(PREFACE + SettingsFrame(0).serialize())
        await client.drain()
        if reading:
            # the ACK of the server's SETTINGS goes out now: sent when they came later, it could
            # fall inside a header block the caller leaves open (a CONTINUATION flood), where
            # any other frame is a connection error (PROTOCOL_ERROR), whatever the flood
            await asyncio.wait_for(client.greeted.wait(), 20)
        return client

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed.set()
        self.greeted.set()
        for event in self._ended.values():
            event.set()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        pos = 0
        while len(buffer) - pos >= 9:
            frame, length = Frame.parse_frame_header(memoryview(buffer)[pos : pos + 9])
            if len(buffer) - pos < 9 + length:
                break
            frame.parse_body(memoryview(bytes(buffer[pos + 9 : pos + 9 + length])))
            pos += 9 + length
            self._on_frame(frame)
        del buffer[:pos]

    # -- sending ---------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> bool:
        """Wait while the socket's buffer is full; False when the connection is closed."""
        if self._writable is not None:
            await asyncio.shield(self._writable)
        return not self.closed.is_set()

    def new_stream(self) -> int:
        stream_id = self.next_stream
        self.next_stream += 2
        return stream_id

    def headers_frame(
        self, stream_id: int, path: str = "/healthz", method: str = "GET", extra=(), *, end_stream: bool = True,
        end_headers: bool = True,
    ) -> bytes:
        return headers_frame(self.encoder, stream_id, path, method, extra, end_stream=end_stream, end_headers=end_headers)

    def request(self, path: str = "/healthz", method: str = "GET", extra=(), body: bytes = b"") -> int:
        stream_id = self.new_stream()
        self.write(self.headers_frame(stream_id, path, method, extra, end_stream=not body))
        if body:
            frame = DataFrame(stream_id, body)
            frame.flags.add("END_STREAM")
            self.write(frame.serialize())
        return stream_id

    async def response(self, stream_id: int) -> Response:
        """The answer on ``stream_id`` once it has ended (or been reset, or the connection lost)."""
        await self._ended.setdefault(stream_id, asyncio.Event()).wait()
        return self.responses.get(stream_id, Response())

    @staticmethod
    def rst(stream_id: int, code: int = 0x8) -> bytes:
        return RstStreamFrame(stream_id, error_code=code).serialize()

    @staticmethod
    def ping(n: int = 0) -> bytes:
        return PingFrame(0, opaque_data=struct.pack(">Q", n)).serialize()

    @staticmethod
    def settings() -> bytes:
        return SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 100}).serialize()

    @staticmethod
    def empty_data(stream_id: int) -> bytes:
        return DataFrame(stream_id, b"").serialize()

    @staticmethod
    def continuation(stream_id: int, payload: bytes, end: bool = False) -> bytes:
        frame = ContinuationFrame(stream_id, payload)
        if end:
            frame.flags.add("END_HEADERS")
        return frame.serialize()

    @staticmethod
    def priority(stream_id: int) -> bytes:
        return PriorityFrame(stream_id, depends_on=0, stream_weight=16).serialize()

    @staticmethod
    def window_update(increment: int = 1) -> bytes:
        return WindowUpdateFrame(0, window_increment=increment).serialize()

    @staticmethod
    def unknown(kind: int = 0x20) -> bytes:
        return struct.pack(">I", 0)[1:] + bytes([kind, 0]) + struct.pack(">I", 0)

    # -- reading ---------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, GoAwayFrame):
            if self.goaway is None:
                self.goaway = frame
        elif isinstance(frame, PingFrame):
            if "ACK" in frame.flags:
                self.pings_acked += 1
        elif isinstance(frame, SettingsFrame):
            if "ACK" not in frame.flags:
                self.write(SettingsFrame(0, flags=["ACK"]).serialize())
                self.greeted.set()
        elif isinstance(frame, (HeadersFrame, DataFrame, RstStreamFrame)):
            response = self.responses.setdefault(frame.stream_id, Response())
            if isinstance(frame, HeadersFrame):
                for name, value in self.decoder.decode(frame.data, raw=True):
                    if name == b":status":
                        response.status = int(value)
                    else:
                        response.headers.append((name, value))
            elif isinstance(frame, DataFrame):
                response.body += frame.data
                if frame.flow_controlled_length:  # give the credit back at once
                    self.write(WindowUpdateFrame(0, window_increment=frame.flow_controlled_length).serialize())
                    self.write(WindowUpdateFrame(frame.stream_id, window_increment=frame.flow_controlled_length).serialize())
            else:
                response.reset = frame.error_code
            if "END_STREAM" in frame.flags or isinstance(frame, RstStreamFrame):
                response.ended = True
                self._ended.setdefault(frame.stream_id, asyncio.Event()).set()

    async def wait_closed(self, timeout: float = 20) -> bool:
        """True once the server has closed the connection (GOAWAY read or not)."""
        try:
            await asyncio.wait_for(self.closed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self.transport.abort()
        await self.closed.wait()


# -- floods ---------------------------------------------------------------------------------


def rapid_reset(client: RawH2):
    def batch(i: int) -> bytes:
        frames = []
        for _ in range(20):
            stream_id = client.new_stream()
            frames.append(client.headers_frame(stream_id) + client.rst(stream_id))
        return b"".join(frames)

    return batch


def empty_data(client: RawH2):
    stream_id = client.new_stream()
    client.write(client.headers_frame(stream_id, "/v1/chat/completions", "POST", end_stream=False))
    return lambda i: client.empty_data(stream_id) * 20


def endless_continuation(client: RawH2, payload: bytes):
    stream_id = client.new_stream()
    client.write(client.headers_frame(stream_id, end_headers=False))
    return lambda i: client.continuation(stream_id, payload) * 4


def hpack_bomb(client: RawH2):
    """A 4 KB header indexed once, then referenced 1,000 times (a byte each): ~4 MB decoded
    from a ~5 KB block."""
    def batch(i: int) -> bytes:
        return client.headers_frame(client.new_stream(), extra=[("x-bomb", "a" * 4000)] * 1000)

    return batch


# name -> make(client) -> batch(i): the bytes of the i-th batch of a flood on ``client``
H2_FLOODS = {
    "rapid-reset": rapid_reset,
    "ping": lambda c: lambda i: b"".join(c.ping(i * 20 + k) for k in range(20)),
    "settings": lambda c: lambda i: c.settings() * 20,
    "empty-data": empty_data,
    "empty-continuation": lambda c: endless_continuation(c, b""),
    "endless-continuation": lambda c: endless_continuation(c, b"\x00" * 4096),
    "hpack-bomb": hpack_bomb,
    "priority": lambda c: lambda i: c.priority(1 + 2 * i) * 20,
    "unknown-frames": lambda c: lambda i: c.unknown() * 20,
    "window-updates": lambda c: lambda i: c.window_update() * 20,
}




# -- HTTP/3 ---------------------------------------------------------------------------------


class H3Client(QuicConnectionProtocol):
    """aioquic's client with its HTTP/3 layer: ``request`` sends a GET's HEADERS,
    ``response`` waits for its answer; ``terminated`` and ``close_code`` tell how the server
    closed the connection."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.terminated = asyncio.Event()
        self.close_code: int | None = None
        self.responses: dict[int, list] = {}
        self.ended: dict[int, asyncio.Event] = {}

    def quic_event_received(self, event) -> None:
        if isinstance(event, ConnectionTerminated):
            self.close_code = event.error_code
            self.terminated.set()
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, (HeadersReceived, DataReceived)):
                answer = self.responses.setdefault(h3_event.stream_id, [None, b""])
                if isinstance(h3_event, HeadersReceived):
                    answer[0] = int(dict(h3_event.headers)[b":status"])
                else:
                    answer[1] += h3_event.data
                if h3_event.stream_ended:
                    self.ended.setdefault(h3_event.stream_id, asyncio.Event()).set()

    def request(self, extra=(), *, end_stream: bool = True, path: bytes = b"/healthz") -> int:
        stream_id = self._quic.get_next_available_stream_id()
        headers = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"127.0.0.1"), (b":path", path)]
        self.h3.send_headers(stream_id, [*headers, *extra], end_stream=end_stream)
        self.transmit()
        return stream_id

    async def response(self, stream_id: int, timeout: float = 20) -> tuple[int, bytes]:
        await asyncio.wait_for(self.ended.setdefault(stream_id, asyncio.Event()).wait(), timeout)
        status, body = self.responses[stream_id]
        return status, body

    def rapid_reset(self) -> None:
        """A request cancelled at once, as HTTP/3 clients cancel: RESET_STREAM and STOP_SENDING."""
        stream_id = self.request(end_stream=False)
        self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)

    def unknown_control_frames(self, count: int = 10) -> None:
        self._quic.send_stream_data(self.h3._local_control_stream_id, encode_frame(0x21, b"") * count)


def h3_connect(port: int, ca_file: str):
    """``async with h3_connect(port, ca_file) as client:`` an ``H3Client`` on 127.0.0.1."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="127.0.0.1")
    configuration.load_verify_locations(ca_file)
    return quic_connect("127.0.0.1", port, configuration=configuration, create_protocol=H3Client)
