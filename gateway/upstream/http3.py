"""HTTP/3 pool: QUIC connections per origin, driven by aioquic's QUIC and HTTP/3 layers.

Why QUIC between tiers: an edge gateway reaches central clusters across a wide-area
network, where a new connection's round trips and head-of-line blocking under loss cost
the most. QUIC sets up transport and TLS in one round trip (a resumed connection can send
its request at once, as 0-RTT early data), and a lost datagram holds back only the streams
whose bytes it carried, not every stream on the connection as a lost TCP segment does.

The layout follows the HTTP/2 pool: a few multiplexed connections per origin, each stream
placed on the least busy one (at most ``_MAX_STREAMS`` per connection), one connection
opened at start-up and re-opened when it goes. The pump is aioquic's
``QuicConnectionProtocol`` (datagram in -> QUIC events -> HTTP/3 events; datagrams out; one
timer); the connected UDP socket reports an ICMP "port unreachable" at once.

Backpressure: aioquic raises a stream's receive limit (MAX_STREAM_DATA) as bytes *arrive*
(it doubles the limit once half of it is used), so a stream whose reader has stopped would
keep taking data without bound. ``_Quic`` overrides that one step, ``_write_stream_limits``,
for response streams: the limit is what the relay has *consumed* plus the relay buffer
(``limits.stream_buffer_bytes``), raised in half-window steps. A slow client therefore
stalls exactly its own stream at the server; the connection limit (MAX_DATA) is left to
aioquic and stays large, so the other streams keep flowing. aioquic has no public hook for
this: the override is of a private method (checked against aioquic 1.7.2; the backpressure
tests fail if it changes), as is ``_initialize``, where the client's TLS key shares are cut
from four to two (half of a new connection's handshake CPU here).

Cancellation: closing an unfinished response resets the stream both ways (RESET_STREAM and
STOP_SENDING, H3_REQUEST_CANCELLED), which is how the server learns the client has gone.

TLS is verified by default (certifi's roots, or the endpoint's ``ca_file``). Session
tickets are kept per pool, so a new connection resumes; only an endpoint with
``early_data: true`` sends a request as 0-RTT early data on a resumed connection (early
data can be replayed by an attacker; a POST is not idempotent).

A server that restarted has forgotten its connections and drops their packets silently.
A connection that has sent a request and heard nothing at all for the connect timeout is
taken for dead: it is closed and the request, unanswered, is sent again on a new one.

``FallbackPool`` (``fallback.py``) puts HTTP/3 first and HTTP/2 over TLS behind it, for networks that block
UDP: when QUIC cannot be established within ``fallback_after_s`` requests go over HTTP/2,
and QUIC is tried again in the background.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl as ssl_module

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events as quic_events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.tls import Group, SessionTicket

from gateway.core.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamProtocolError,
)
from gateway.upstream.base import (
    MultiplexedPool, Origin, Refused, Timeouts, head_timeout, rewarm_soon, split_status,
)
from gateway.upstream.body import Body

__all__ = ["H3Pool", "CONGESTION_CONTROL"]

logger = logging.getLogger("edgegw.upstream")

_MAX_STREAMS = 100  # concurrent request streams per connection
_CONNECTION_WINDOW = 32 * 1024 * 1024  # initial MAX_DATA (aioquic doubles it as it is used)
_IDLE_TIMEOUT = 60.0  # seconds without a packet before QUIC closes the connection
_KEY_SHARE_GROUPS = (Group.X25519, Group.SECP256R1)
# Token streams are small and steady: after a loss, Reno's halved window falls below what
# 32 streams at 50 tokens/s need at 40 ms RTT and every stream queues behind it for several
# round trips; CUBIC backs off less (x0.7) and regrows faster (BENCHMARKS.md, HTTP/3 under
# loss: p99 inter-token gap at 1 % loss 222 -> ~160 ms).
CONGESTION_CONTROL = "cubic"


class _Quic(QuicConnection):
    """A QUIC connection whose response streams get receive credit as the relay consumes
    their bytes, not as the bytes arrive (see the module docstring)."""

    def __init__(self, *, configuration: QuicConfiguration, session_ticket_handler, window: int) -> None:
        super().__init__(configuration=configuration, session_ticket_handler=session_ticket_handler)
        self.window = window
        self.limits: dict[int, int] = {}  # stream id -> receive limit granted by the pool

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        # aioquic's client offers a key share for each of P-256, P-384, X25519 and X448;
        # generating four keys is a good part of a handshake's CPU. Two cover every server.
        self.tls._supported_groups = [g for g in _KEY_SHARE_GROUPS if g in self.tls._supported_groups]

    def _write_stream_limits(self, builder, space, stream) -> None:
        limit = self.limits.get(stream.stream_id)
        if limit is None:  # control and QPACK streams, cancelled streams: aioquic's policy
            super()._write_stream_limits(builder, space, stream)
            return
        if limit > stream.max_stream_data_local:
            stream.max_stream_data_local = limit
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=self._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local


class _Stream:
    __slots__ = ("id", "head", "body", "flow", "consumed", "granted")

    def __init__(self, stream_id: int, head: asyncio.Future, window: int) -> None:
        self.id = stream_id
        self.head = head
        self.body: Body | None = None
        self.flow = 0  # QUIC bytes received and not yet handed to the body
        self.consumed = 0  # QUIC bytes the relay has taken (or that were not body bytes)
        self.granted = window  # the receive limit last granted


class _H3Connection(QuicConnectionProtocol):
    def __init__(self, quic: _Quic, pool: H3Pool) -> None:
        super().__init__(quic)
        self._pool = pool
        self._h3 = H3Connection(quic)
        self._window = quic.window
        self.streams: dict[int, _Stream] = {}
        self.connected: asyncio.Future[None] = self._loop.create_future()
        self.is_closed = False
        self.is_draining = False  # no new streams (the server rejected one)
        self.last_received = self._loop.time()
        self.sent_early = 0  # requests sent before the handshake completed (0-RTT)
        self.early_data_accepted = False

    # -- asyncio.DatagramProtocol ------------------------------------------------------

    def datagram_received(self, data: bytes, addr) -> None:
        self.last_received = self._loop.time()
        super().datagram_received(data, addr)

    def error_received(self, exc: OSError) -> None:
        # an ICMP error on the connected socket: nothing listens there (or a route is down)
        if not self.connected.done():
            self.connected.set_exception(UpstreamConnectError(f"cannot connect to {self._pool._origin}: {exc}"))
            self.connected.exception()
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._terminate(UpstreamProtocolError("the QUIC connection to the upstream was closed"))
        self._pool._lost(self)

    def transmit(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            super().transmit()

    # -- QUIC and HTTP/3 events ------------------------------------------------------

    def quic_event_received(self, event: quic_events.QuicEvent) -> None:
        kind = type(event)
        if kind is quic_events.StreamDataReceived:
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.flow += len(event.data)
            for h3_event in self._h3.handle_event(event):
                h3_kind = type(h3_event)
                if h3_kind is DataReceived:
                    self._on_data(h3_event)
                elif h3_kind is HeadersReceived:
                    self._on_headers(h3_event)
            if stream is not None and stream.flow and event.stream_id in self.streams:
                # frame headers, HEADERS frames: nothing for the relay to consume
                flow, stream.flow = stream.flow, 0
                self._credit(stream, flow)
        elif kind is quic_events.StreamReset or kind is quic_events.StopSendingReceived:
            self._h3.handle_event(event)
            if kind is quic_events.StopSendingReceived and event.error_code == ErrorCode.H3_NO_ERROR:
                return  # the server answers without reading the rest of the request (RFC 9114 4.1)
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                self._quic.limits.pop(event.stream_id, None)
                if event.error_code == ErrorCode.H3_REQUEST_REJECTED and not stream.head.done():
                    self.is_draining = True  # a server that rejects streams is shutting down
                    error: Exception = Refused()
                else:
                    error = UpstreamProtocolError(f"upstream reset the stream (error {event.error_code:#x})")
                _fail_stream(stream, error)
                self._stream_done()
        elif kind is quic_events.HandshakeCompleted:
            self._pool.resumed += event.session_resumed
            self.early_data_accepted = event.early_data_accepted
            if not self.connected.done():
                self.connected.set_result(None)
        elif kind is quic_events.ConnectionTerminated:
            reason = event.reason_phrase or f"error {event.error_code:#x}"
            if not self.connected.done():
                self.connected.set_exception(
                    UpstreamConnectError(f"cannot connect to {self._pool._origin}: QUIC handshake failed: {reason}")
                )
                self.connected.exception()
            self._terminate(UpstreamProtocolError(f"upstream closed the QUIC connection: {reason}"))
            if self._transport is not None:
                self._transport.close()  # -> connection_lost -> the pool forgets it
        else:
            self._h3.handle_event(event)

    def _on_headers(self, event: HeadersReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            return
        if stream.body is None:
            status, headers = split_status(event.headers)
            if status < 200:
                return  # an interim response; the real one follows
            stream.body = Body(self._loop, self._pool._high_water, None, lambda n, s=stream: self._credit(s, n))
            if not stream.head.done():
                # the body travels with the head (a short answer can end before the waiter runs)
                stream.head.set_result((status, headers, stream.body))
        if event.stream_ended:
            self._end(stream)

    def _on_data(self, event: DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None or stream.body is None:
            return
        if event.data:
            flow, stream.flow = stream.flow, 0
            stream.body.feed(event.data, flow)
        if event.stream_ended:
            self._end(stream)

    def _end(self, stream: _Stream) -> None:
        stream.body.feed_eof()  # type: ignore[union-attr]
        del self.streams[stream.id]
        self._quic.limits.pop(stream.id, None)
        self._stream_done()

    def _stream_done(self) -> None:
        if self.is_draining and not self.streams:
            self.close()
        self._pool._stream_done()

    # -- flow control ----------------------------------------------------------------

    def _credit(self, stream: _Stream, nbytes: int) -> None:
        """The relay took ``nbytes``: once half a window has been taken since the last
        grant, grant a full window past what was consumed (one MAX_STREAM_DATA frame)."""
        stream.consumed += nbytes
        limit = stream.consumed + self._window
        if limit - stream.granted >= self._window // 2 and stream.id in self._quic.limits and not self.is_closed:
            stream.granted = limit
            self._quic.limits[stream.id] = limit
            self._transmit_soon()

    # -- requests --------------------------------------------------------------------

    async def exchange(
        self, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: Timeouts, within: float | None = None
    ) -> tuple[int, list[tuple[bytes, bytes]], Body, int]:
        if self.is_closed:
            raise Refused()
        quic = self._quic
        stream_id = quic.get_next_available_stream_id()
        quic.limits[stream_id] = self._window
        head = self._loop.create_future()
        self.streams[stream_id] = _Stream(stream_id, head, self._window)
        self._h3.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self._h3.send_data(stream_id, body, end_stream=True)
        self.transmit()
        if not self.connected.done():
            self.sent_early += 1
        sent_at = self._loop.time()
        if within is not None and within < timeouts.read:
            handle = self._loop.call_later(within, head_timeout, head, within, True)
        else:
            handle = self._loop.call_later(timeouts.read, head_timeout, head, timeouts.read)
        watchdog = self._loop.call_later(timeouts.connect, self._check_alive, sent_at)
        try:
            status, response_headers, response_body = await head
        except BaseException:
            self.cancel(stream_id)
            raise
        finally:
            handle.cancel()
            watchdog.cancel()
        return status, response_headers, response_body, stream_id

    def _check_alive(self, sent_at: float) -> None:
        """Nothing at all came back since a request went out: the peer is gone (a server
        that restarted drops packets of connections it does not know)."""
        if self.last_received < sent_at and not self.is_closed:
            logger.warning("QUIC connection to %s silent since a request went out: closing it", self._pool._origin)
            self._terminate(None)
            self.abort()

    def cancel(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None or self.is_closed:
            return
        quic = self._quic
        quic.limits.pop(stream_id, None)
        try:
            quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        except (ValueError, AssertionError):
            pass  # the stream is already over at the QUIC layer
        self.transmit()
        self._stream_done()

    def close(self) -> None:  # type: ignore[override]
        """Close with H3_NO_ERROR (CONNECTION_CLOSE goes out now) and drop the socket."""
        if not self.is_closed:
            self._terminate(UpstreamProtocolError("upstream pool closed"))
            self._quic.close(error_code=ErrorCode.H3_NO_ERROR)
            self.transmit()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection without a word (the peer is unreachable or gone)."""
        self.is_closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()

    # -- helpers ---------------------------------------------------------------------

    def _terminate(self, error: GatewayError | None) -> None:
        """Fail every stream: those without an answer as refused (sent again elsewhere),
        the others with ``error``."""
        if self.is_closed and not self.streams:
            return
        self.is_closed = True
        for stream in list(self.streams.values()):
            _fail_stream(stream, Refused() if not stream.head.done() or error is None else error)
        self.streams.clear()
        self._quic.limits.clear()

    @property
    def has_capacity(self) -> bool:
        return not self.is_closed and not self.is_draining and len(self.streams) < _MAX_STREAMS


def _fail_stream(stream: _Stream, error: Exception) -> None:
    if not stream.head.done():
        stream.head.set_exception(error)
    elif stream.body is not None:
        if isinstance(error, Refused):
            error = UpstreamProtocolError("the upstream went away mid-response")
        stream.body.feed_error(error)


class H3Pool(MultiplexedPool):
    """Up to ``max_connections`` QUIC connections to one origin; streams go to the least busy.

    Beyond the common pool arguments: ``ca_file`` (PEM roots to verify the server with,
    instead of certifi's), ``early_data`` (send requests as 0-RTT on resumed connections).
    Whether the certificate is verified at all is the origin's TLS context's verify mode.
    """

    protocol = "http3"

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int,
        warm_connections: int,
        timeouts: Timeouts,
        high_water: int,
        ca_file: str | None = None,
        early_data: bool = False,
    ) -> None:
        if origin.ssl is None:
            raise ValueError("HTTP/3 needs an https:// origin")
        super().__init__(
            origin, max_connections=max_connections, warm_connections=warm_connections, timeouts=timeouts, high_water=high_water
        )
        self._verify = origin.ssl.verify_mode != ssl_module.CERT_NONE
        self._ca_file = ca_file
        self._early_data = early_data
        self._ticket: SessionTicket | None = None
        self.handshakes = 0  # QUIC connections started
        self.resumed = 0  # handshakes that resumed a TLS session (a session ticket was accepted)

    async def warm(self) -> None:
        """Open one connection now (streams multiplex on it), so the first request pays no handshake."""
        if self._warm and not self._conns and not self._closed:
            try:
                if self._opening is not None:  # a request is opening one already
                    await asyncio.shield(self._opening)
                else:
                    await self._open()
            except GatewayError as exc:
                logger.warning("warm-up of %s (HTTP/3) failed: %s", self._origin, exc.message)

    async def _connect(self) -> _H3Connection:
        origin = self._origin
        loop = self._loop
        timeout = self._timeouts.connect
        addr = _literal_address(origin.host, origin.port)
        if addr is None:
            try:
                infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_DGRAM)
            except OSError as exc:
                raise UpstreamConnectError(f"cannot resolve {origin}: {exc}") from None
            addr = infos[0][4]
        configuration = QuicConfiguration(
            is_client=True,
            alpn_protocols=H3_ALPN,
            server_name=origin.host,
            verify_mode=ssl_module.CERT_REQUIRED if self._verify else ssl_module.CERT_NONE,
            cafile=self._ca_file,
            max_data=_CONNECTION_WINDOW,
            max_stream_data=self._high_water,
            idle_timeout=_IDLE_TIMEOUT,
            congestion_control_algorithm=CONGESTION_CONTROL,
        )
        ticket = self._ticket
        resuming = ticket is not None and ticket.is_valid and ticket.server_name == origin.host
        if resuming:
            configuration.session_ticket = ticket
        quic = _Quic(configuration=configuration, session_ticket_handler=self._store_ticket, window=self._high_water)
        try:
            _, conn = await loop.create_datagram_endpoint(lambda: _H3Connection(quic, self), remote_addr=addr)
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {origin}: {exc}") from None
        conn.connect(addr)
        self.handshakes += 1
        if resuming and self._early_data and ticket.max_early_data_size is not None:
            return conn  # requests go out now as 0-RTT; a failed handshake fails (refuses) them
        try:
            await asyncio.wait_for(asyncio.shield(conn.connected), timeout)
        except asyncio.TimeoutError:
            conn.abort()
            raise UpstreamConnectError(f"QUIC handshake with {origin} timed out after {timeout:g} s") from None
        except BaseException:
            conn.abort()
            raise
        return conn

    def _store_ticket(self, ticket: SessionTicket) -> None:
        self._ticket = ticket

    def _lost(self, conn: _H3Connection) -> None:
        if self._forget(conn) and not self._closed and self._warm and not self._conns:
            rewarm_soon(self)  # keep a connection warm (servers restart, idle connections time out)


def _literal_address(host: str, port: int) -> tuple | None:
    """An IP literal's socket address, without a trip through the resolver's thread pool."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return (host, port) if ip.version == 4 else (host, port, 0, 0)

