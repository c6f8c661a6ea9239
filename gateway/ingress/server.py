"""uvicorn's server plus the gateway-to-gateway listeners: HTTPS (HTTP/1.1 and HTTP/2) and HTTP/3.

The plain HTTP/1.1 listener stays uvicorn's (``listen.host``/``listen.port``). With
``listen.tls`` a TCP listener serves TLS on its own port and picks the protocol by ALPN:
``h2`` goes to ``gateway.ingress.h2``, ``http/1.1`` to uvicorn's own HTTP/1.1 protocol
(the same one the plain listener runs). With ``listen.http3`` a UDP listener serves
HTTP/3 (``gateway.ingress.h3``), and HTTPS responses carry ``Alt-Svc`` so that clients
learn of it. With ``listen.admin`` a plain HTTP/1.1 listener on its own port serves the
admin paths (``gateway.admission.admin``). All of them serve the same app (uvicorn's loaded app, the lifespan already
run) and register their connections and request tasks in uvicorn's server state, so
uvicorn's graceful shutdown (SIGTERM) drains them like its own: no new connections, GOAWAY,
in-flight streams finish up to ``timeout_graceful_shutdown``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import itertools
import logging
import ssl
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from gateway.core.context import LISTENING
from gateway.ingress.h2 import H2ServerProtocol
from gateway.ingress.h3_listener import H3Listener, serve_http3
from gateway.core.settings import LimitSettings, ListenSettings

__all__ = ["AltSvcApp", "Server", "tls_context"]

logger = logging.getLogger("edgegw.ingress")

_ALT_SVC_MAX_AGE = 86400
_TRIM_EVERY_S = 0.5  # how often the count of closed connections is looked at
_FREE_EVERY = 20  # and malloc's free bytes, every this many looks: mallinfo2 walks the free lists (7.5 ms with 200,000 free chunks)
_TRIM_AFTER = 100  # connections gone since the last trim: give their memory back
_TRIM_SETTLED = 16  # or this many, and none gone during the last look: a flood's tail
_TRIM_FREED_BYTES = 32 << 20  # or malloc's free lists grew this much since the last trim (short-lived connections by the thousand)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


@functools.cache
def _libc():
    """The C library, loaded once (``find_library`` runs ``ldconfig``)."""
    name = ctypes.util.find_library("c")
    if sys.platform != "linux" or name is None:
        return None
    return ctypes.CDLL(name)


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    libc = _libc()
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def _free_heap_bytes():
    """A function answering the bytes glibc's malloc holds free (``mallinfo2().fordblks``), or
    None where there is no ``mallinfo2`` (glibc < 2.33, other C libraries)."""
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    return lambda: mallinfo2().fordblks


def should_trim(gone: int, freed: int, settled: bool = False) -> bool:
    """Whether to give freed memory back now: ``_TRIM_AFTER`` connections have closed since
    the last trim (``gone``: counted as they close, so a flood of connections that each
    lived for milliseconds counts as much as a crowd that leaves at once), or
    ``_TRIM_SETTLED`` have and none closed during the last look (``settled``: the churn is
    over, and a trim in the middle of it gave back only what lay between live connections),
    or malloc's free lists grew by ``_TRIM_FREED_BYTES`` over their low since then
    (``freed``: what the requests of long-lived connections left). ``malloc_trim`` gives the
    pages back but leaves the chunks on the free lists, so the growth, not the total, is what
    says there is something new to give back."""
    return gone >= _TRIM_AFTER or (settled and gone >= _TRIM_SETTLED) or freed >= _TRIM_FREED_BYTES


class _Connections(set):
    """uvicorn's set of open connections (``server_state.connections``), which also counts
    the connections that have left it (``gone``), for the memory trimmer."""

    gone = 0

    def discard(self, connection) -> None:
        if connection in self:
            self.gone += 1
            super().discard(connection)


class AltSvcApp:
    """Adds ``Alt-Svc: h3=":PORT"`` to responses over HTTPS that did not come over HTTP/3
    (RFC 7838: the client may use HTTP/3 on that UDP port for this origin)."""

    def __init__(self, app, port: int) -> None:
        self.app = app
        self.value = f'h3=":{port}"; ma={_ALT_SVC_MAX_AGE}'.encode()

    def __getattr__(self, name: str):
        return getattr(self.app, name)  # e.g. ``state``

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("scheme") != "https" or scope.get("http_version") == "3":
            return await self.app(scope, receive, send)
        header = (b"alt-svc", self.value)

        async def send_with_alt_svc(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_alt_svc)


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


class _AlpnSwitch(asyncio.Protocol):
    """Sits on a fresh TLS connection; when the handshake is done (``connection_made``)
    hands the transport to the protocol ALPN chose."""

    def __init__(self, server: Server) -> None:
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        config = server.config
        protocol: asyncio.Protocol
        if alpn == "h2":
            protocol = H2ServerProtocol(
                config.loaded_app,
                server.server_state,
                server.lifespan.state,
                keep_alive=config.timeout_keep_alive,
                limits=server.limits,
                max_connections=config.limit_concurrency,
            )
        else:
            protocol = config.http_protocol_class(  # uvicorn's HTTP/1.1 (httptools or h11)
                config=config, server_state=server.server_state, app_state=server.lifespan.state
            )
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


class Server(uvicorn.Server):
    """``uvicorn.Server`` that also runs ``listen.tls`` and ``listen.http3``.

    ``high_water`` is the relay buffer (``limits.stream_buffer_bytes``): the HTTP/3 listener
    keeps at most that many unacknowledged bytes per stream before it blocks the app.
    ``reuse_port``: the HTTPS and HTTP/3 ports are shared with the node's other workers
    (SO_REUSEPORT), each of which opens its own listeners. ``limits``: the header limits and
    what one HTTP/2 or HTTP/3 connection may cost (default: those the HTTP/1.1 protocol
    class was made with, ``H1Protocol.with_limits``); ``limits.max_connections`` is
    uvicorn's ``limit_concurrency``, counted over every listener's connections."""

    def __init__(
        self,
        config: uvicorn.Config,
        listen: ListenSettings,
        *,
        high_water: int = 256 * 1024,
        reuse_port: bool = False,
        limits: LimitSettings | None = None,
    ) -> None:
        super().__init__(config)
        self.server_state.connections = _Connections()
        self.listen = listen
        self.high_water = high_water
        self.reuse_port = reuse_port
        self._limits = limits
        self.http3: H3Listener | None = None
        self._trimmer: asyncio.Task | None = None

    @property
    def limits(self) -> LimitSettings:
        if self._limits is None:  # uvicorn resolves the protocol class when it loads the config
            protocol = getattr(self.config, "http_protocol_class", None)
            self._limits = getattr(protocol, "limits", None) or LimitSettings()
        return self._limits

    async def startup(self, sockets=None) -> None:
        listen = self.listen
        if listen.http3 is not None:
            self.config.loaded_app = AltSvcApp(self.config.loaded_app, listen.http3.port)
        self.lifespan.state[LISTENING] = False  # the first port answers before the others are open
        await super().startup(sockets)
        if not self.started:
            return
        loop = asyncio.get_running_loop()
        try:
            if listen.tls is not None:
                context = tls_context(listen.tls.certfile, listen.tls.keyfile)
                server = await loop.create_server(
                    lambda: _AlpnSwitch(self),
                    listen.host,
                    listen.tls.port,
                    ssl=context,
                    # a TLS handshake not done within the head's timeout: closed, as a silent HTTP/1.1 client is
                    ssl_handshake_timeout=self.limits.header_timeout_s,
                    backlog=self.config.backlog,
                    reuse_port=self.reuse_port or None,
                )
                self.servers.append(server)  # uvicorn closes it with its own on shutdown
                logger.info("HTTPS (HTTP/1.1, HTTP/2) on https://%s:%d", listen.host, listen.tls.port)
            if listen.admin is not None:
                # the admin paths' own port (gateway.admission.admin tells it by its number): HTTP/1.1
                config = self.config
                server = await loop.create_server(
                    lambda: config.http_protocol_class(config=config, server_state=self.server_state, app_state=self.lifespan.state),
                    listen.admin.host or listen.host,
                    listen.admin.port,
                    backlog=config.backlog,
                    reuse_port=self.reuse_port or None,
                )
                self.servers.append(server)
                logger.info("admin paths on http://%s:%d", listen.admin.host or listen.host, listen.admin.port)
            if listen.http3 is not None:
                self.http3 = await serve_http3(
                    self.config.loaded_app,
                    listen.host,
                    listen.http3.port,
                    listen.http3.certfile,
                    listen.http3.keyfile,
                    server_state=self.server_state,
                    app_state=self.lifespan.state,
                    high_water=self.high_water,
                    reuse_port=self.reuse_port,
                    limits=self.limits,
                    max_connections=self.config.limit_concurrency,
                )
                logger.info("HTTP/3 on udp://%s:%d", listen.host, listen.http3.port)
        except (OSError, ssl.SSLError) as exc:
            logger.error("cannot start the gateway's listeners: %s", exc)
            for server in self.servers:
                server.close()
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)
        self.lifespan.state[LISTENING] = True
        trim = _malloc_trim()
        if trim is not None:
            self._trimmer = loop.create_task(self._trim_memory(trim))

    async def _trim_memory(self, trim) -> None:
        """Give the memory of many closed connections back to the system. glibc keeps what
        they freed (TLS buffers, protocol objects: ~20 KB a connection) in its free lists,
        scattered, so the process stays as large as its busiest moment: 1,000 idle
        connections, once closed, would leave ~20 MB behind. ``malloc_trim`` returns the
        free pages (a few ms for a heap of hundreds of MB); it runs when ``should_trim`` says
        so, looked at every ``_TRIM_EVERY_S`` (the free bytes every ``_FREE_EVERY`` looks)."""
        connections = self.server_state.connections
        free_bytes = _free_heap_bytes() or (lambda: 0)
        gone = closed = getattr(connections, "gone", 0)  # connections closed: at the last trim, at the last look
        low = free_bytes()  # malloc's free bytes: their low since the last trim
        free = low
        for look in itertools.count(1):
            await asyncio.sleep(_TRIM_EVERY_S)
            if look % _FREE_EVERY == 0:
                free = free_bytes()
                low = min(low, free)
            closed, before = getattr(connections, "gone", 0), closed
            if should_trim(closed - gone, free - low, settled=closed == before):
                trim(0)
                gone, low = closed, free

    async def shutdown(self, sockets=None) -> None:
        if self._trimmer is not None:
            self._trimmer.cancel()
        if self.http3 is not None:
            self.http3.stop_accepting()
        try:
            await super().shutdown(sockets)
        finally:
            if self.http3 is not None:
                self.http3.close()
