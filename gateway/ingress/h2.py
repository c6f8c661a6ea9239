"""HTTP/2 ingress: any ASGI app served over h2 (the state machine the HTTP/2 pool uses).

Serves the ``h2`` ALPN protocol on the TLS listener (``gateway.ingress.server``); each
request stream is a ``RequestStream`` (``gateway.ingress.asgi``).

Backpressure, the point of not using hypercorn here: the app's ``send`` hands bytes to h2
only as far as the client's flow-control windows (stream and connection) allow, and waits
for WINDOW_UPDATE for the rest; it also waits while the socket's write buffer is over its
high-water mark (``pause_writing``). A client that stops reading therefore stops the app.
Request bodies are acknowledged (WINDOW_UPDATE) as the app takes them.

Cancellation: RST_STREAM from the client, or the connection lost, is an
``http.disconnect`` for the app at once.

Idle connections close after ``keep_alive`` seconds without a stream (a new one that opens
none, after ``limits.header_timeout_s``); ``shutdown()`` (the server draining) refuses new
streams and closes (GOAWAY) once the last one ends.

What one connection may cost (``gateway.ingress.guard``; the gateway is one event loop per
worker, so a connection that takes the loop takes every listener with it):

- frames are counted before h2 sees them (a scan of the 9-byte frame headers): stream
  resets, PINGs, SETTINGS, empty frames and other control frames per
  ``limits.flood_interval_s`` (a ``FloodGuard``); past a limit, GOAWAY(ENHANCE_YOUR_CALM)
  and the connection is closed;
- the work one connection's frames do is metered per event-loop turn: a frame costs 1, a
  new stream ``_STREAM_COST`` more, a header block 1 per ``_HEADER_BYTES_PER_UNIT`` bytes
  (HPACK decoding is the costliest thing a frame can ask). A connection may spend
  ``limits.max_frames_per_turn`` a turn; the rest of what it sent waits, reading paused,
  for the next turn, after the other connections and listeners have had theirs (nginx caps
  the streams one read may open). What a turn overspends (one large header block) is paid
  back by sitting out turns, so over time no connection takes more than its share;
- a header block (HEADERS and its CONTINUATIONs) over ``header_block_cap`` or of more than
  ``_MAX_CONTINUATIONS`` frames closes the connection the same way; one within it but over
  ``limits.max_header_bytes`` or ``max_header_count`` is answered 431 on its stream;
- at most ``_MAX_STREAMS`` request handlers run per connection: a stream opened while the
  handlers of reset streams are still finishing is refused (REFUSED_STREAM, counted as a
  reset): resetting streams cannot pile up work;
- while the socket's write buffer is over its high-water mark (a client that does not read
  its PING and SETTINGS acknowledgements), the connection is not read: what it sends waits
  in the kernel's buffers, not in the gateway's memory;
- request body bytes are given back to the connection's flow-control window whether the
  app reads them or not (``RequestStream.discard_body`` when a stream ends);
- ``limits.max_connections`` counts this connection with every other listener's: over it,
  its first request is answered 503 ``too_many_connections`` and the connection drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from gateway.ingress.asgi import RequestStream, build_scope
from gateway.ingress.guard import (
    CONTROL,
    EMPTY,
    PINGS,
    RESETS,
    SETTINGS,
    FloodGuard,
    header_block_cap,
    header_problem,
    refusal,
    too_many_connections,
)
from gateway.core.settings import LimitSettings

__all__ = ["H2ServerProtocol"]

logger = logging.getLogger("edgegw.ingress")

_MAX_STREAMS = 100  # streams a client may have open, and request handlers running per connection
_REQUEST_WINDOW = 1024 * 1024  # per-stream receive window for request bodies
_CONNECTION_WINDOW = 1024 * 1024  # the connection's receive window (HTTP/2's default is 64 KiB - 1)
_PREFACE = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", before the first frame
_STREAM_COST = 8  # a new stream (scope, task, the app's first steps) against max_frames_per_turn
_HEADER_BYTES_PER_UNIT = 32  # header block bytes that cost as much as a frame (HPACK: ~1 us a byte)
_SETTINGS_COST = 4  # a SETTINGS frame against max_frames_per_turn
_MAX_CONTINUATIONS = 32  # CONTINUATION frames per header block (h2 itself stops at 64, as PROTOCOL_ERROR)
_UPDATES_PER_DATA = 2  # WINDOW_UPDATEs (stream and connection) each DATA frame sent earns the client
_MAX_UPDATE_CREDIT = 10_000
_CLOSE_GRACE = 5.0  # seconds a closed connection may take to flush its GOAWAY before it is aborted
_LINGER = 1.0  # seconds a connection closed for a flood is still read (and what it sends dropped)
_PAUSED_TURN = 1  # reading paused: this turn's frames are used up
_PAUSED_WRITE = 2  # reading paused: the write buffer is over its high-water mark


class H2ServerProtocol(asyncio.Protocol):
    def __init__(
        self,
        app,
        server_state: Any,
        app_state: dict[str, Any],
        *,
        keep_alive: float = 75.0,
        limits: LimitSettings | None = None,
        max_connections: int | None = None,
    ) -> None:
        self._app = app
        self._server_state = server_state
        self._app_state = app_state
        self._keep_alive = keep_alive
        self._limits = limits = limits if limits is not None else LimitSettings()
        self._max_connections = max_connections
        self._loop = asyncio.get_running_loop()
        self._h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=False,
                header_encoding=None,
                # the app builds its own response headers; requests from the network are checked
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self._block_cap = header_block_cap(limits)
        self._h2.decoder.max_header_list_size = self._block_cap  # HPACK's own bound (h2's default: 64 KiB)
        self._guard = FloodGuard(limits, self._loop.time())
        self._inbox = bytearray()  # received, not yet handed to h2
        self._preface = _PREFACE  # bytes of the client preface not yet seen
        self._block = 0  # bytes of the header block being received
        self._continuations = 0
        self._excess: str | None = None  # a header block over the cap
        self._last_stream = 0  # the highest stream id a HEADERS frame named
        self._update_credit = 0
        self._credit = limits.max_frames_per_turn  # what this turn may still spend (negative: in debt)
        self._paused = 0  # _PAUSED_* bits: why reading is paused
        self._turn_scheduled = False
        self._overloaded = False
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, RequestStream] = {}
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._draining = False
        self._closed = False
        self._lost = False

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._server_state.connections.add(self)
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("sockname")
        self._client = (peer[0], peer[1]) if peer else None
        self._server = (sock[0], sock[1]) if sock else None
        h2conn = self._h2
        h2conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _REQUEST_WINDOW,
                h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 0,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self._block_cap,
            },
        )
        h2conn.initiate_connection()
        h2conn.increment_flow_control_window(_CONNECTION_WINDOW - h2conn.inbound_flow_control_window)
        self._flush()
        self._arm_idle()
        limit = self._max_connections
        if limit is not None and len(self._server_state.connections) > limit:  # this one included
            logger.warning("over limits.max_connections (%d): answering 503 on an HTTP/2 connection", limit)
            self._overloaded = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._lost = True
        self._inbox.clear()
        # h2's connection refers to itself (its frame dispatch table holds its own bound
        # methods), so only a full collection of the cyclic garbage collector would free it,
        # with whatever it buffered: a flood's half-sent header block (up to the block cap),
        # its streams, its HPACK tables. Emptied now, it is freed as the last reference goes;
        # nothing calls it after this (every caller checks ``_closed`` first).
        vars(self._h2).clear()
        self._server_state.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        for stream in list(self._streams.values()):
            stream.disconnect()
        _wake(self._drained)

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        self._inbox += data
        if not self._paused:
            self._turn()

    def _turn(self) -> None:
        """This connection's turn of the event loop (a read, or the turn after a paused one)."""
        budget = self._limits.max_frames_per_turn
        credit = self._credit + budget
        self._credit = budget if credit > budget else credit
        if self._credit > 0:
            self._process()
        elif self._inbox:
            self._sit_out()

    def _process(self) -> None:
        """Count the complete frames received (while this turn's credit lasts) and hand
        them to h2; when frames are left over, pause reading until the next loop turn."""
        inbox = self._inbox
        size = len(inbox)
        pos = 0
        if self._preface:  # h2 checks it; the frames start after it
            pos = min(self._preface, size)
            self._preface -= pos
        credit = self._credit
        max_frame = self._h2.max_inbound_frame_size
        guard = self._guard
        now = self._loop.time()
        exhausted = False
        while pos + 9 <= size:
            if credit <= 0:
                exhausted = True
                break
            length = (inbox[pos] << 16) | (inbox[pos + 1] << 8) | inbox[pos + 2]
            if length > max_frame:
                pos = size  # h2 answers it (FRAME_SIZE_ERROR)
                break
            end = pos + 9 + length
            if end > size:
                break
            credit -= self._count(inbox, pos, length, now)
            if guard.exceeded is not None or self._excess is not None:
                self._calm(self._excess or guard.describe(self._limits))
                return
            pos = end
        self._credit = credit
        if pos:
            chunk = bytes(inbox[:pos])
            del inbox[:pos]
            self._feed(chunk)
        if exhausted and not self._closed:
            self._sit_out()

    def _sit_out(self) -> None:
        """Leave the rest for the next loop turn, reading paused meanwhile."""
        self._pause(_PAUSED_TURN)
        if not self._turn_scheduled:
            self._turn_scheduled = True
            self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        if self._closed:
            return
        self._paused &= ~_PAUSED_TURN
        if self._paused:  # the write buffer is still full: resume_writing comes back here
            return
        self._turn()
        if not self._paused and self._transport is not None:
            self._transport.resume_reading()

    def _count(self, inbox: bytearray, pos: int, length: int, now: float) -> int:
        """Count one frame against the guard; returns its cost against the turn's budget."""
        kind = inbox[pos + 3]
        flags = inbox[pos + 4]
        guard = self._guard
        if kind == 0x0:  # DATA
            if not flags & 0x1:  # without END_STREAM
                payload = length - (1 + inbox[pos + 9] if flags & 0x8 and length else 0)
                if payload <= 0:
                    guard.spend(EMPTY, now)
            return 1
        if kind == 0x1:  # HEADERS: a request, or trailers
            fragment = length - (1 + inbox[pos + 9] if flags & 0x8 and length else 0) - (5 if flags & 0x20 else 0)
            if fragment <= 0 and not flags & 0x1:
                guard.spend(EMPTY, now)
            self._block = fragment
            self._continuations = 0
            if fragment > self._block_cap:
                self._excess = f"a header block over {self._block_cap} bytes"
            cost = 1 + length // _HEADER_BYTES_PER_UNIT
            stream_id = int.from_bytes(inbox[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            if stream_id > self._last_stream:
                self._last_stream = stream_id
                cost += _STREAM_COST
            return cost
        if kind == 0x9:  # CONTINUATION
            if length == 0:
                guard.spend(EMPTY, now)
            self._block += length
            self._continuations += 1
            if self._block > self._block_cap:
                self._excess = f"a header block over {self._block_cap} bytes"
            elif self._continuations > _MAX_CONTINUATIONS:
                self._excess = f"a header block of more than {_MAX_CONTINUATIONS} CONTINUATION frames"
            return 1 + length // _HEADER_BYTES_PER_UNIT
        if kind == 0x3:  # RST_STREAM
            guard.spend(RESETS, now)
        elif kind == 0x6:  # PING (an ACK is unsolicited: the gateway sends none)
            guard.spend(CONTROL if flags & 0x1 else PINGS, now)
        elif kind == 0x4:  # SETTINGS: applied, acknowledged, and every stream's writer woken
            if flags & 0x1:
                guard.spend(CONTROL, now)
            else:
                guard.spend(SETTINGS, now)
                return _SETTINGS_COST
        elif kind == 0x8:  # WINDOW_UPDATE: free as long as DATA frames sent explain it
            if self._update_credit > 0:
                self._update_credit -= 1
            else:
                guard.spend(CONTROL, now)
        elif kind != 0x5:  # PRIORITY, GOAWAY, unknown types (PUSH_PROMISE: h2 refuses it)
            guard.spend(CONTROL, now)
        return 1

    def _feed(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            if isinstance(exc, h2.exceptions.DenialOfServiceError):
                logger.warning("closing the HTTP/2 connection of %s: %s", _peer(self._client), exc)
            self._flush()  # h2's GOAWAY (ENHANCE_YOUR_CALM for a header list over the cap)
            for stream in list(self._streams.values()):
                stream.disconnect()
            self._abandon(linger=True)
            return
        for event in events:
            kind = type(event)
            if kind is h2.events.DataReceived:
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.feed(event.data, event.flow_controlled_length)
                else:
                    self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif kind is h2.events.RequestReceived:
                self._on_request(event)
                if self._closed:
                    return
            elif kind is h2.events.StreamEnded:
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.feed_eof()
            elif kind is h2.events.StreamReset:
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream.disconnect()
            elif kind is h2.events.WindowUpdated:
                self._wake_writers(event.stream_id)
            elif kind is h2.events.RemoteSettingsChanged:
                self._wake_writers(0)
            elif kind is h2.events.ConnectionTerminated:
                self._draining = True
                if not self._streams:
                    self._close()
        self._flush()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause(_PAUSED_WRITE)  # answer nothing more until the client reads

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._drained)
        if self._paused & _PAUSED_WRITE:
            # frames may wait in the inbox: the next turn handles them, then reads again
            self._paused = (self._paused & ~_PAUSED_WRITE) | _PAUSED_TURN
            if not self._turn_scheduled:
                self._turn_scheduled = True
                self._loop.call_soon(self._next_turn)

    def _pause(self, why: int) -> None:
        if not self._paused and self._transport is not None:
            self._transport.pause_reading()
        self._paused |= why

    # -- requests --------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        scope = None if self._draining else build_scope(event.headers, "2", self._client, self._server, self._app_state)
        if scope is None:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if len(self._streams) >= _MAX_STREAMS:  # the handlers of streams reset meanwhile still run
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            if not self._guard.spend(RESETS, self._loop.time()):
                self._calm(self._guard.describe(self._limits))
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        app = self._app
        problem = header_problem(event.headers, self._limits)
        if problem is not None:
            app = refusal(431, "request_header_fields_too_large", problem)
        elif self._overloaded:
            app = too_many_connections(self._limits)
        stream = self._streams[stream_id] = RequestStream(
            self, stream_id, scope, False, self._server_state.default_headers
        )
        task = stream.task = self._loop.create_task(stream.run(app))
        self._server_state.tasks.add(task)
        task.add_done_callback(self._server_state.tasks.discard)
        if self._overloaded:
            self.shutdown()  # this stream is answered, later ones refused, then GOAWAY

    def _wake_writers(self, stream_id: int) -> None:
        if stream_id:
            stream = self._streams.get(stream_id)
            if stream is not None:
                stream.wake_writer()
        else:
            for stream in self._streams.values():
                stream.wake_writer()

    # -- what a RequestStream calls ----------------------------------------------------

    def send_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        if self._closed:
            return
        try:
            self._h2.send_headers(stream_id, headers, end_stream=end)
        except h2.exceptions.H2Error:
            return  # the stream was reset meanwhile
        self._flush()

    async def send_data(self, stream: RequestStream, data: bytes, end: bool) -> None:
        """Send as the windows allow; wait for WINDOW_UPDATE (or a drained socket) when
        they are closed. Returns at once when the stream is gone."""
        h2conn = self._h2
        view = memoryview(data)
        stream_id = stream.id
        while not stream.disconnected and not self._closed:
            if self._write_paused:
                if self._drained is None or self._drained.done():
                    self._drained = self._loop.create_future()
                await self._drained
                continue
            try:
                if not view:
                    if end:
                        h2conn.end_stream(stream_id)
                        self._flush()
                    return
                window = min(h2conn.local_flow_control_window(stream_id), h2conn.max_outbound_frame_size)
                if window <= 0:
                    await stream.wait_writable()
                    continue
                chunk, view = view[:window], view[window:]
                h2conn.send_data(stream_id, chunk.tobytes(), end_stream=end and not view)
                self._update_credit = min(self._update_credit + _UPDATES_PER_DATA, _MAX_UPDATE_CREDIT)
            except h2.exceptions.H2Error:
                return  # reset by the client, or the connection is closing
            self._flush()
            if end and not view:
                return

    def reset(self, stream_id: int) -> None:
        if self._closed:
            return
        try:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
        except h2.exceptions.H2Error:
            return
        self._flush()

    def ack(self, stream_id: int, nbytes: int) -> None:
        if self._closed:
            return
        try:
            self._h2.acknowledge_received_data(nbytes, stream_id)
        except h2.exceptions.H2Error:
            return
        self._flush()

    def stream_closed(self, stream: RequestStream) -> None:
        self._streams.pop(stream.id, None)
        unread = stream.discard_body()
        if unread:  # the body's credit, read or not
            self.ack(stream.id, unread)
        if not self._streams:
            if self._draining:
                self._close()
            else:
                self._arm_idle()

    # -- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Graceful: refuse new streams (REFUSED_STREAM: the client may retry them
        elsewhere), let the running ones finish, then GOAWAY and close.

        GOAWAY goes last because h2, on either side, moves its connection state machine to
        CLOSED when GOAWAY is sent or received, after which the running streams' DATA is a
        protocol error: an h2 client (the gateway's own HTTP/2 pool among them) would lose
        them."""
        if self._closed or self._draining:
            return
        self._draining = True
        if not self._streams:
            self._close()

    def _arm_idle(self) -> None:
        if self._idle is None and not self._closed:
            # a new connection must open its first stream within limits.header_timeout_s, as a new
            # HTTP/1.1 connection must send its first request head; later, keep-alive applies
            wait = self._keep_alive if self._last_stream else min(self._keep_alive, self._limits.header_timeout_s)
            self._idle = self._loop.call_later(wait, self._idle_out)

    def _idle_out(self) -> None:
        self._idle = None
        if not self._streams:
            self.shutdown()

    def _close(self) -> None:
        if not self._closed and self._transport is not None:
            try:
                self._h2.close_connection()  # GOAWAY
                self._flush()
            except h2.exceptions.H2Error:
                pass
            self._abandon()

    def _calm(self, reason: str) -> None:
        """Over a limit: GOAWAY(ENHANCE_YOUR_CALM) with the reason as debug data, every
        stream ended, the connection closed."""
        if self._closed:
            return
        logger.warning("closing the HTTP/2 connection of %s: %s", _peer(self._client), reason)
        try:
            self._h2.close_connection(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, additional_data=reason.encode()[:256])
        except h2.exceptions.H2Error:
            pass
        self._flush()
        for stream in list(self._streams.values()):
            stream.disconnect()
        self._abandon(linger=True)

    def _abandon(self, linger: bool = False) -> None:
        """Close the transport: at once when the client reads nothing (its buffer would
        never flush), else after the last bytes, and aborted if that takes too long.

        ``linger``: a client still sending (a flood) would have its unread bytes answered
        by the kernel with a reset as the socket closes, and a reset destroys what the
        client has not read yet: the GOAWAY. So the connection is read (and what arrives
        dropped) for ``_LINGER`` seconds first, as nginx's lingering close does."""
        self._closed = True
        self._inbox.clear()
        transport = self._transport
        if transport is None:
            return
        if self._write_paused:
            transport.abort()
        elif linger:
            if self._paused:
                self._paused = 0
                transport.resume_reading()
            self._loop.call_later(_LINGER, self._close_transport, True)
        else:
            self._close_transport()

    def _close_transport(self, lingered: bool = False) -> None:
        transport = self._transport
        if self._lost or transport is None:
            return
        if lingered and transport.get_write_buffer_size():  # a second on, the GOAWAY still waits: it reads nothing
            transport.abort()
            return
        transport.close()
        self._loop.call_later(_CLOSE_GRACE, self._abort_if_open)

    def _abort_if_open(self) -> None:
        if not self._lost and self._transport is not None:
            self._transport.abort()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
