"""A raw HTTP/2 client for flood tests: frames built with hyperframe and hpack, sent as
they are (no client state machine refuses to send a thousand PINGs or an endless header
block), over TLS with ALPN h2, as an asyncio protocol.

``RawH2.connect(port, ca_file)`` sends the preface and an empty SETTINGS, and parses what
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
        return client

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed.set()
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
