"""HTTP/3 ingress: any ASGI app served over QUIC on aioquic's QUIC and HTTP/3 layers.

The same state machines as the HTTP/3 pool (``gateway.upstream.http3``), on the server
side: aioquic's ``QuicServer`` routes datagrams to one ``QuicConnectionProtocol`` per
connection, whose HTTP/3 events become ``RequestStream``s (``gateway.ingress.asgi``).

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
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer, encode_uint_var
from aioquic.h3.connection import H3_ALPN, ErrorCode, FrameType, H3Connection, encode_frame
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic import events as quic_events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import pull_quic_header
from aioquic.tls import SessionTicket

from gateway.ingress.asgi import RequestStream, build_scope
from gateway.upstream.http3 import CONGESTION_CONTROL

__all__ = ["H3Listener", "TicketStore", "serve_http3"]

logger = logging.getLogger("edgegw.ingress")

_IDLE_TIMEOUT = 60.0  # seconds without a packet before QUIC closes a connection
_MAX_TICKETS = 10_000


class TicketStore:
    """TLS session tickets issued by this server, each usable once (a bounded LRU)."""

    def __init__(self, capacity: int = _MAX_TICKETS) -> None:
        self._tickets: OrderedDict[bytes, SessionTicket] = OrderedDict()
        self._capacity = capacity

    def add(self, ticket: SessionTicket) -> None:
        self._tickets[ticket.ticket] = ticket
        if len(self._tickets) > self._capacity:
            self._tickets.popitem(last=False)

    def pop(self, label: bytes) -> SessionTicket | None:
        return self._tickets.pop(label, None)


class _H3ServerConnection(QuicConnectionProtocol):
    def __init__(self, quic, stream_handler=None, *, listener: H3Listener) -> None:
        super().__init__(quic)
        self._listener = listener
        self._app = listener.app
        self._server_state = listener.server_state
        self._high_water = listener.high_water
        self._h3 = H3Connection(quic)
        self._streams: dict[int, RequestStream] = {}
        self._blocked: dict[int, RequestStream] = {}  # writers waiting for acknowledgements
        self._draining = False
        self._close_when_sent = False  # draining, and no stream left: close once all is acknowledged
        self._closing = False
        self._server: tuple[str, int] | None = None
        self._server_state.connections.add(self)

    # -- datagrams -------------------------------------------------------------------

    def transmit(self) -> None:
        if not self._transport.is_closing():
            super().transmit()

    def datagram_received(self, data: bytes, addr) -> None:
        super().datagram_received(data, addr)
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
        kind = type(event)
        if kind is quic_events.StreamDataReceived:
            for h3_event in self._h3.handle_event(event):
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
        elif kind is quic_events.StopSendingReceived or kind is quic_events.StreamReset:
            self._h3.handle_event(event)
            stream = self._streams.get(event.stream_id)
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
        stream = self._streams[stream_id] = RequestStream(
            self, stream_id, scope, event.stream_ended, self._server_state.default_headers
        )
        task = stream.task = self._loop.create_task(stream.run(self._app))
        self._server_state.tasks.add(task)
        task.add_done_callback(self._server_state.tasks.discard)

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


class H3Listener(QuicServer):
    """aioquic's ``QuicServer`` that can stop taking new connections while the existing
    ones drain."""

    def __init__(
        self,
        app,
        configuration: QuicConfiguration,
        *,
        server_state: Any,
        app_state: dict[str, Any],
        high_water: int,
        tickets: TicketStore,
    ) -> None:
        super().__init__(
            configuration=configuration,
            create_protocol=functools.partial(_H3ServerConnection, listener=self),
            session_ticket_fetcher=tickets.pop,
            session_ticket_handler=tickets.add,
        )
        self.app = app
        self.server_state = server_state
        self.app_state = app_state
        self.high_water = high_water
        self.accepting = True

    @property
    def port(self) -> int:
        return self._transport.get_extra_info("sockname")[1]

    def datagram_received(self, data: bytes, addr) -> None:
        if not self.accepting:
            try:
                header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
            except ValueError:
                return
            if header.destination_cid not in self._protocols:
                return  # a new connection while draining: let it time out (the client tries elsewhere)
        super().datagram_received(data, addr)

    def stop_accepting(self) -> None:
        self.accepting = False

    def close(self, graceful: bool = True) -> None:
        """Close every connection (CONNECTION_CLOSE, or nothing at all when not
        ``graceful``, as a crashed server would) and the socket."""
        for protocol in set(self._protocols.values()):
            if graceful:
                protocol._close()
            for stream in list(protocol._streams.values()):
                if stream.task is not None:
                    stream.task.cancel()
            self.server_state.connections.discard(protocol)
            if protocol._timer is not None:
                protocol._timer.cancel()
        self._protocols.clear()
        if self._transport is not None:
            self._transport.close()


async def serve_http3(
    app,
    host: str,
    port: int,
    certfile: str,
    keyfile: str,
    *,
    server_state: Any,
    app_state: dict[str, Any] | None = None,
    high_water: int = 256 * 1024,
    reuse_port: bool = False,
) -> H3Listener:
    """Serve ``app`` over HTTP/3 on UDP ``host:port`` (0 picks a free port: ``listener.port``).
    ``reuse_port``: share the port with the other workers of the node (SO_REUSEPORT: the
    kernel keeps each client address on one worker).

    ``server_state`` is uvicorn's ``ServerState`` (or anything with ``connections``,
    ``tasks`` and ``default_headers``): connections and request tasks are tracked there, so
    the server's graceful shutdown waits for them."""
    configuration = QuicConfiguration(
        is_client=False,
        alpn_protocols=H3_ALPN,
        idle_timeout=_IDLE_TIMEOUT,
        congestion_control_algorithm=CONGESTION_CONTROL,  # as the pool's, for the same reason
    )
    configuration.load_cert_chain(certfile, keyfile)
    loop = asyncio.get_running_loop()
    listener = H3Listener(
        app,
        configuration,
        server_state=server_state,
        app_state={} if app_state is None else app_state,
        high_water=high_water,
        tickets=TicketStore(),
    )
    await loop.create_datagram_endpoint(lambda: listener, local_addr=(host, port), reuse_port=reuse_port or None)
    return listener
