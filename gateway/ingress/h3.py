"""HTTP/3 ingress: any ASGI app served over QUIC on aioquic's QUIC and HTTP/3 layers; here
one connection (``H3ServerConnection``), the listener in ``h3_listener.py``.

The same state machines as the HTTP/3 pool (``gateway.upstream.http3``), on the server
side: aioquic's ``QuicServer`` (``H3Listener``) routes datagrams to one
``QuicConnectionProtocol`` per connection, whose HTTP/3 events become ``RequestStream``s
(``gateway.ingress.asgi``).

Backpressure: aioquic's stream sender buffers whatever it is given, so a writer is never
slowed by it. Here the app's ``send`` returns only while the stream's bytes not yet
acknowledged by the client stay under ``high_water`` (``limits.stream_buffer_bytes``); a
client that stops reading withholds stream credit, the bytes stop leaving, and the app
(the gateway's relay) stops too. That count is read from aioquic's stream sender (its
``_buffer_start``/``_buffer_stop`` offsets: private, checked against aioquic 1.7).

Cancellation: a client that resets the request stream or sends STOP_SENDING (HTTP/3's
way of cancelling a request), or whose connection goes, is an ``http.disconnect`` for the
app at once.

Resumption: session tickets are kept in memory (``TicketStore``), so returning clients
resume; a client that sends 0-RTT early data on resumption is served (aioquic accepts
early data whenever it resumes). Clients decide whether to send requests early (the pool
only does with ``early_data: true``).

Draining (``shutdown``, called by the server on SIGTERM): no new connections, GOAWAY on
existing ones, new streams refused with H3_REQUEST_REJECTED (a client retries them
elsewhere), each connection closed once its last stream ends.

What one connection may cost (``gateway.ingress.guard``), as for HTTP/2:

- a ``FloodGuard`` counts the client's stream resets (RESET_STREAM, STOP_SENDING), QUIC
  PINGs, HTTP/3 SETTINGS, empty frames (STREAM frames without data or FIN, empty DATA
  frames) and other control frames (QUIC's *_BLOCKED, connection-id and path frames,
  unknown HTTP/3 frame types) per ``limits.flood_interval_s``; past a limit the connection
  is closed with H3_EXCESSIVE_LOAD. QUIC frames are counted by wrapping aioquic's frame
  handlers, HTTP/3 frames by ``_GuardedH3`` as aioquic parses their headers (private
  hooks, checked against aioquic 1.7);
- the work per loop turn: at most ``_DATAGRAMS_PER_TURN`` datagrams of one client address
  are handled per turn, the rest set aside for the next turns (``H3Listener``), so one
  client's flood is read off the socket quickly and cannot hold the loop, nor the other
  clients' datagrams queued behind it;
- header limits: a HEADERS frame over ``limits.max_header_bytes`` is answered 431 on its
  stream without being decoded (its payload is discarded as it arrives, never buffered);
  a decoded list over ``max_header_bytes`` or ``max_header_count``, 431 too. The listener
  offers no QPACK dynamic table, so a header block cannot decode to more than the static
  table's largest entry per byte (a QPACK "bomb" of 1-byte references to a 4 KiB entry);
- at most ``_MAX_STREAMS`` request handlers per connection (a new stream while the handlers
  of reset ones still run: H3_REQUEST_REJECTED, counted as a reset);
- ``limits.max_connections`` counts HTTP/3 connections with the other listeners': over it,
  a connection's first request is answered 503 ``too_many_connections`` and it drains.
"""

from __future__ import annotations

import logging

import pylsqpack
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.buffer import BufferReadError, encode_uint_var
from aioquic.h3.connection import (
    ErrorCode,
    FrameType,
    H3Connection,
    H3Stream,
    HeadersState,
    Setting,
    encode_frame,
)
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events as quic_events

from gateway.ingress.asgi import RequestStream, build_scope, response_headers
from gateway.ingress.guard import (
    CONTROL,
    EMPTY,
    PINGS,
    RESETS,
    SETTINGS,
    FloodGuard,
    error_body,
    header_problem,
    too_many_bytes,
    too_many_connections,
)

__all__ = ["H3ServerConnection"]

logger = logging.getLogger("edgegw.ingress")

_MAX_STREAMS = 100  # request handlers running per connection
_BLOCKED_STREAMS = 16  # QPACK streams that may wait for encoder instructions (aioquic's default)
_SKIP = 0x21  # a reserved frame type (RFC 9114 7.2.8): aioquic discards its payload as it arrives

# QUIC frames counted against the guard (the others do a request's work, or are ACKs)
_QUIC_COUNTED = {
    0x01: PINGS,  # PING
    0x14: CONTROL,  # DATA_BLOCKED
    0x15: CONTROL,  # STREAM_DATA_BLOCKED
    0x16: CONTROL,  # STREAMS_BLOCKED (bidi)
    0x17: CONTROL,  # STREAMS_BLOCKED (uni)
    0x18: CONTROL,  # NEW_CONNECTION_ID
    0x19: CONTROL,  # RETIRE_CONNECTION_ID
    0x1A: CONTROL,  # PATH_CHALLENGE (each one is answered)
    0x1B: CONTROL,  # PATH_RESPONSE
}


class _GuardedH3(H3Connection):
    """aioquic's HTTP/3 layer that counts the frames it parses against a ``FloodGuard`` (as
    soon as their type and length are known, before any payload is buffered), refuses
    header blocks over the limit undecoded, and offers no QPACK dynamic table."""

    def __init__(self, quic, guard: FloodGuard, clock, max_block: int) -> None:
        super().__init__(quic)
        self._decoder = pylsqpack.Decoder(0, _BLOCKED_STREAMS)  # as the SETTINGS sent say: no dynamic table
        self._guard = guard
        self._clock = clock
        self._max_block = max_block
        self.refused: set[int] = set()  # request streams answered by the listener: their frames are discarded
        self.oversized: list[int] = []  # streams whose HEADERS frame was over the limit, to answer 431

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings[Setting.QPACK_MAX_TABLE_CAPACITY] = 0
        del settings[Setting.ENABLE_CONNECT_PROTOCOL]  # extended CONNECT is not served
        return settings

    def _check_control_frame_type(self, frame_type: int) -> None:
        super()._check_control_frame_type(frame_type)
        self._guard.spend(SETTINGS if frame_type == FrameType.SETTINGS else CONTROL, self._clock())

    def _check_request_or_push_frame_type(self, frame_type: int, stream: H3Stream) -> None:
        super()._check_request_or_push_frame_type(frame_type, stream)
        if stream.stream_id in self.refused:
            stream.frame_type = _SKIP
        elif frame_type == FrameType.DATA:
            if stream.frame_size == 0:
                self._guard.spend(EMPTY, self._clock())
        elif frame_type == FrameType.HEADERS:
            if stream.frame_size > self._max_block:
                self.refused.add(stream.stream_id)
                self.oversized.append(stream.stream_id)
                stream.frame_type = _SKIP
                stream.headers_recv_state = HeadersState.AFTER_HEADERS  # its end is no "incomplete request"
        elif frame_type != FrameType.PUSH_PROMISE:  # PUSH_PROMISE: aioquic refuses it
            self._guard.spend(CONTROL, self._clock())


def _count_quic_frames(quic, guard: FloodGuard, clock) -> None:
    """Wrap aioquic's handlers of the frames in ``_QUIC_COUNTED``, and of STREAM frames (an
    empty one without FIN is counted), so that each counts against ``guard``."""
    handlers = quic._QuicConnection__frame_handlers  # aioquic keeps them per connection

    def counted(handler, kind):
        def handle(context, frame_type, buf) -> None:
            guard.spend(kind, clock())
            handler(context, frame_type, buf)

        return handle

    def stream_frame(handler):
        def handle(context, frame_type, buf) -> None:
            if not frame_type & 0x01:  # no FIN
                start = buf.tell()
                try:
                    buf.pull_uint_var()  # stream id
                    if frame_type & 0x04:
                        buf.pull_uint_var()  # offset
                    length = buf.pull_uint_var() if frame_type & 0x02 else buf.capacity - buf.tell()
                except BufferReadError:
                    length = 1  # the handler reports the malformed frame
                buf.seek(start)
                if length == 0:
                    guard.spend(EMPTY, clock())
            handler(context, frame_type, buf)

        return handle

    for frame_type, kind in _QUIC_COUNTED.items():
        handler, epochs = handlers[frame_type]
        handlers[frame_type] = (counted(handler, kind), epochs)
    for frame_type in range(0x08, 0x10):
        handler, epochs = handlers[frame_type]
        handlers[frame_type] = (stream_frame(handler), epochs)


class H3ServerConnection(QuicConnectionProtocol):
    def __init__(self, quic, stream_handler=None, *, listener) -> None:
        super().__init__(quic)
        self._listener = listener
        self._app = listener.app
        self._server_state = listener.server_state
        self._high_water = listener.high_water
        self._limits = limits = listener.limits
        clock = self._loop.time
        self._guard = FloodGuard(limits, clock())
        _count_quic_frames(quic, self._guard, clock)
        self._h3 = _GuardedH3(quic, self._guard, clock, limits.max_header_bytes)
        self._streams: dict[int, RequestStream] = {}
        self._blocked: dict[int, RequestStream] = {}  # writers waiting for acknowledgements
        self._draining = False
        self._close_when_sent = False  # draining, and no stream left: close once all is acknowledged
        self._closing = False
        self._server: tuple[str, int] | None = None
        self._server_state.connections.add(self)
        limit = listener.max_connections
        self._overloaded = limit is not None and len(self._server_state.connections) > limit  # this one included
        if self._overloaded:
            logger.warning("over limits.max_connections (%d): answering 503 on an HTTP/3 connection", limit)

    # -- datagrams -------------------------------------------------------------------

    def transmit(self) -> None:
        if not self._transport.is_closing():
            super().transmit()

    def datagram_received(self, data: bytes, addr) -> None:
        if self._closing:  # closed by the guard: aioquic answers with CONNECTION_CLOSE, nothing else runs
            super().datagram_received(data, addr)
            return
        super().datagram_received(data, addr)
        if self._guard.exceeded is not None:
            self._calm()
            return
        if self._close_when_sent:
            self._close_if_sent()
        if self._blocked:  # acknowledgements may have made room
            low = self._high_water // 2
            for stream_id, stream in list(self._blocked.items()):
                if self._unacked(stream_id) <= low:
                    del self._blocked[stream_id]
                    stream.wake_writer()

    # -- QUIC and HTTP/3 events ------------------------------------------------------

    def quic_event_received(self, event: quic_events.QuicEvent) -> None:
        if self._closing:
            return
        kind = type(event)
        if kind is quic_events.StreamDataReceived:
            h3 = self._h3
            for h3_event in h3.handle_event(event):
                h3_kind = type(h3_event)
                if h3_kind is HeadersReceived:
                    self._on_headers(h3_event)
                elif h3_kind is DataReceived:
                    stream = self._streams.get(h3_event.stream_id)
                    if stream is not None:
                        if h3_event.data:
                            stream.feed(h3_event.data, 0)
                        if h3_event.stream_ended:
                            stream.feed_eof()
            while h3.oversized:
                self._answer(h3.oversized.pop(), 431, "request_header_fields_too_large", too_many_bytes(self._limits.max_header_bytes))
            if event.end_stream:
                h3.refused.discard(event.stream_id)
        elif kind is quic_events.StopSendingReceived or kind is quic_events.StreamReset:
            self._h3.handle_event(event)
            stream_id = event.stream_id
            stream = self._streams.get(stream_id)
            if stream_id in self._h3.refused:  # a request the listener answered: its client stops sending
                self._h3.refused.discard(stream_id)
            elif stream_id % 4 == 0 and (stream is None or not stream.disconnected):  # once per request
                self._guard.spend(RESETS, self._loop.time())
            if stream is not None and (kind is quic_events.StopSendingReceived or event.error_code != ErrorCode.H3_NO_ERROR):
                self._gone(stream)
        elif kind is quic_events.ConnectionTerminated:
            for stream in list(self._streams.values()):
                self._gone(stream)
            self._server_state.connections.discard(self)
        else:
            self._h3.handle_event(event)

    def _on_headers(self, event: HeadersReceived) -> None:
        stream_id = event.stream_id
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers
            if event.stream_ended:
                stream.feed_eof()
            return
        if self._draining:
            self._refuse(stream_id, ErrorCode.H3_REQUEST_REJECTED)
            return
        if self._server is None:
            sock = self._transport.get_extra_info("sockname")
            self._server = (sock[0], sock[1]) if sock else None
        peer = self._quic.get_peer_address()
        client = (peer[0], peer[1]) if peer else None
        scope = build_scope(event.headers, "3", client, self._server, self._listener.app_state)
        if scope is None:
            self._refuse(stream_id, ErrorCode.H3_REQUEST_REJECTED)
            return
        if len(self._streams) >= _MAX_STREAMS:  # the handlers of streams reset meanwhile still run
            self._refuse(stream_id, ErrorCode.H3_REQUEST_REJECTED)
            self._guard.spend(RESETS, self._loop.time())
            return
        problem = header_problem(event.headers, self._limits)
        if problem is not None:
            self._answer(stream_id, 431, "request_header_fields_too_large", problem)
            return
        app = self._app
        if self._overloaded:
            app = too_many_connections(self._limits)
        stream = self._streams[stream_id] = RequestStream(
            self, stream_id, scope, event.stream_ended, self._server_state.default_headers
        )
        task = stream.task = self._loop.create_task(stream.run(app))
        self._server_state.tasks.add(task)
        task.add_done_callback(self._server_state.tasks.discard)
        if self._overloaded:
            self.shutdown()  # this stream is answered, later ones refused, then the connection closed

    def _answer(self, stream_id: int, status: int, code: str, message: str) -> None:
        """Answer a request with an error of the listener's own, and stop reading it (its
        frames are discarded as they arrive: STOP_SENDING, RFC 9114 4.1.1)."""
        self._h3.refused.add(stream_id)
        body = error_body(status, code, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        try:
            self._h3.send_headers(stream_id, response_headers(status, headers, self._server_state.default_headers))
            self._h3.send_data(stream_id, body, end_stream=True)
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        except Exception:  # the stream is gone (reset meanwhile): nothing to answer
            logger.debug("could not answer stream %d", stream_id, exc_info=True)
        self._transmit_soon()

    def _calm(self) -> None:
        """Over a limit: end every stream and close with H3_EXCESSIVE_LOAD."""
        reason = self._guard.describe(self._limits)
        peer = self._quic.get_peer_address()
        logger.warning("closing the HTTP/3 connection of %s: %s", f"{peer[0]}:{peer[1]}" if peer else "a client", reason)
        for stream in list(self._streams.values()):
            self._gone(stream)
        self._closing = True
        self._quic.close(error_code=ErrorCode.H3_EXCESSIVE_LOAD, reason_phrase=reason)
        self.transmit()
        self._server_state.connections.discard(self)

    def _gone(self, stream: RequestStream) -> None:
        self._blocked.pop(stream.id, None)
        stream.disconnect()

    def _refuse(self, stream_id: int, code: int) -> None:
        try:
            self._quic.reset_stream(stream_id, code)
            self._quic.stop_stream(stream_id, code)
        except ValueError:
            pass
        self._transmit_soon()

    # -- what a RequestStream calls ----------------------------------------------------

    def send_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        if self._closing:
            return
        self._h3.send_headers(stream_id, headers, end_stream=end)
        self._transmit_soon()

    async def send_data(self, stream: RequestStream, data: bytes, end: bool) -> None:
        if stream.disconnected or self._closing:
            return
        self._h3.send_data(stream.id, data, end_stream=end)
        self._transmit_soon()
        while not end and not stream.disconnected and self._unacked(stream.id) > self._high_water:
            self._blocked[stream.id] = stream
            await stream.wait_writable()

    def reset(self, stream_id: int) -> None:
        self._blocked.pop(stream_id, None)
        if not self._closing:
            self._refuse(stream_id, ErrorCode.H3_INTERNAL_ERROR)

    def ack(self, stream_id: int, nbytes: int) -> None:
        pass  # request bodies: aioquic extends receive credit as they arrive

    def stream_closed(self, stream: RequestStream) -> None:
        self._streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        stream.discard_body()  # aioquic gave the credit back as the bytes arrived
        if self._draining and not self._streams:
            self._close_when_sent = True
            self._close_if_sent()

    # -- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful: GOAWAY, refuse new streams, close when the last stream ends."""
        if self._draining or self._closing:
            return
        self._draining = True
        control = self._h3._local_control_stream_id  # aioquic has no GOAWAY API
        if control is not None:
            last = max(self._streams, default=-4) + 4
            self._quic.send_stream_data(control, encode_frame(FrameType.GOAWAY, encode_uint_var(last)))
            self._transmit_soon()
        if not self._streams:
            self._close_when_sent = True
            self._close_if_sent()

    def _close_if_sent(self) -> None:
        """Close once every response has been acknowledged: CONNECTION_CLOSE would
        discard stream data still queued or in flight."""
        for stream_id, stream in self._quic._streams.items():
            if stream_id % 4 == 0 and not stream.sender.is_finished:
                return
        self._close()

    def _close(self) -> None:
        if not self._closing:
            self._closing = True
            self._quic.close(error_code=ErrorCode.H3_NO_ERROR)
            self.transmit()
            self._server_state.connections.discard(self)

    def _unacked(self, stream_id: int) -> int:
        stream = self._quic._streams.get(stream_id)
        if stream is None:
            return 0
        sender = stream.sender
        return sender._buffer_stop - sender._buffer_start
