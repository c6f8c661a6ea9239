"""The HTTP/3 listener: aioquic's ``QuicServer`` on a UDP socket, one
``H3ServerConnection`` (``h3.py``) per QUIC connection, session tickets for resumption
(``TicketStore``), draining, and the work one client address may cause per event-loop
turn (at most ``_DATAGRAMS_PER_TURN`` of its datagrams, the rest set aside for later turns,
so one client's flood is read off the socket quickly and cannot hold the loop, nor the other
clients' datagrams queued behind it). ``serve_http3`` starts one."""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict, deque
from typing import Any

from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import pull_quic_header
from aioquic.tls import SessionTicket

from gateway.core.settings import LimitSettings
from gateway.ingress.h3 import H3ServerConnection
from gateway.upstream.http3 import CONGESTION_CONTROL

__all__ = ["H3Listener", "TicketStore", "serve_http3"]

_IDLE_TIMEOUT = 60.0  # seconds without a packet before QUIC closes a connection
_MAX_TICKETS = 10_000
_DATAGRAMS_PER_TURN = 8  # datagrams of one client address handled per event-loop turn
_MAX_DEFERRED = 64  # datagrams of one client address held for later turns


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
        limits: LimitSettings | None = None,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(
            configuration=configuration,
            create_protocol=functools.partial(H3ServerConnection, listener=self),
            session_ticket_fetcher=tickets.pop,
            session_ticket_handler=tickets.add,
        )
        self.app = app
        self.server_state = server_state
        self.app_state = app_state
        self.high_water = high_water
        self.limits = limits if limits is not None else LimitSettings()
        self.max_connections = max_connections
        self.accepting = True
        self._turn_counts: dict[Any, int] = {}  # datagrams handled this turn, per client address
        self._deferred: dict[Any, deque[bytes]] = {}  # datagrams left for later turns, per client address
        self._turn_scheduled = False

    @property
    def port(self) -> int:
        return self._transport.get_extra_info("sockname")[1]

    def datagram_received(self, data: bytes, addr) -> None:
        """At most ``_DATAGRAMS_PER_TURN`` datagrams of one client address are handled per
        event-loop turn; the rest wait for the next turns (up to ``_MAX_DEFERRED``, more are
        dropped, as a full socket buffer would drop them: QUIC sends them again), so that
        one client's flood is read, and set aside, at the speed of the socket while the
        other clients' datagrams behind it are served."""
        counts = self._turn_counts
        count = counts.get(addr, 0)
        if count >= _DATAGRAMS_PER_TURN or addr in self._deferred:
            queue = self._deferred.setdefault(addr, deque())
            if len(queue) < _MAX_DEFERRED:
                queue.append(data)
            self._schedule_turn()
            return
        if not counts:
            self._schedule_turn()  # the counts start again next turn
        counts[addr] = count + 1
        self._receive(data, addr)

    def _schedule_turn(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_scheduled = False
        self._turn_counts.clear()
        deferred, self._deferred = self._deferred, {}
        for addr, queue in deferred.items():
            for _ in range(min(len(queue), _DATAGRAMS_PER_TURN)):
                self._receive(queue.popleft(), addr)
            self._turn_counts[addr] = _DATAGRAMS_PER_TURN
            if queue:
                self._deferred[addr] = queue
        if self._deferred or self._turn_counts:
            self._schedule_turn()

    def _receive(self, data: bytes, addr) -> None:
        if self._transport is None or self._transport.is_closing():
            return
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
        self._deferred.clear()
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
    limits: LimitSettings | None = None,
    max_connections: int | None = None,
) -> H3Listener:
    """Serve ``app`` over HTTP/3 on UDP ``host:port`` (0 picks a free port: ``listener.port``).
    ``reuse_port``: share the port with the other workers of the node (SO_REUSEPORT: the
    kernel keeps each client address on one worker).

    ``server_state`` is uvicorn's ``ServerState`` (or anything with ``connections``,
    ``tasks`` and ``default_headers``): connections and request tasks are tracked there, so
    the server's graceful shutdown waits for them. ``limits``: header limits and what one
    connection may cost (``LimitSettings``' defaults when None); ``max_connections``: the
    most connections of every listener together (``server_state.connections``)."""
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
        limits=limits,
        max_connections=max_connections,
    )
    await loop.create_datagram_endpoint(lambda: listener, local_addr=(host, port), reuse_port=reuse_port or None)
    return listener
