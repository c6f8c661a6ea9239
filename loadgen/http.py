"""A lean HTTP/1.1 client on asyncio protocols and httptools: the load generator's wire.

Why not httpx: on this kind of machine httpx's ``AsyncClient`` costs 1–3.5 ms of CPU per
request (its pool; ``shared/FACTS.md``), as much as the gateway being measured, so at a
few hundred requests per second the client would be the bottleneck and its queueing would
show up as server latency. This client costs tens of microseconds: a request is one
``write`` of pre-built bytes, the response is parsed by httptools in the read callback, and
every chunk of body is stamped with the time of the read that brought it (what a client
really sees) and handed to a ``BodyReader`` that the caller picks from the status and
headers. Nothing here knows about OpenAI; ``openai.py`` does.

Scope, deliberately: HTTP/1.1 with keep-alive (one request at a time per connection: what
vLLM, SGLang and edgegw serve to clients), ``http://`` and ``https://`` (the ssl module,
ALPN ``http/1.1``), a total deadline per request, and failures sorted into the kinds of
``types.ErrorKind``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from loadgen.types import ErrorKind

__all__ = ["BaseURL", "BodyReader", "ConnectionPool", "HttpError", "Response", "ssl_context"]


@dataclass(frozen=True, slots=True)
class BaseURL:
    """An OpenAI-style base URL (``https://host/openai/v1``): origin plus path prefix."""

    scheme: str
    host: str
    port: int
    prefix: str  # "/v1", no trailing slash

    @classmethod
    def parse(cls, url: str) -> BaseURL:
        parts = urlsplit(url.strip())
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{url!r}: expected an http:// or https:// URL")
        if not parts.hostname:
            raise ValueError(f"{url!r}: no host")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: a base URL has no query or fragment")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"{url!r}: bad port") from None
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def authority(self) -> str:
        """The Host header: the port only when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.authority}{self.prefix}{path}"


def ssl_context(verify: bool = True, ca_file: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    return context


class HttpError(Exception):
    """A request that got no complete HTTP answer; ``kind`` is an ``ErrorKind``."""

    def __init__(self, kind: str, detail: str, unanswered: bool = False) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.unanswered = unanswered  # the connection closed before any byte of an answer


class BodyReader(Protocol):
    """Consumes a response body as it arrives; ``now`` is when the read brought it."""

    def feed(self, data: bytes, now: float) -> None: ...


ReaderFactory = Callable[[int, dict[str, str]], BodyReader]  # (status, headers) -> reader


class Response:
    """One exchange: written at ``sent``, headers parsed at ``first_byte``, last byte at
    ``done`` (perf_counter seconds)."""

    __slots__ = ("make_reader", "reader", "status", "headers", "sent", "first_byte", "done", "framed")

    def __init__(self, make_reader: ReaderFactory) -> None:
        self.make_reader = make_reader
        self.reader: BodyReader | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.sent = 0.0
        self.first_byte = 0.0
        self.done = 0.0
        self.framed = False  # Content-Length or chunked: its end is known without EOF


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time; httptools parser callbacks."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.now = 0.0
        self.closed = False
        self.reusable = True
        self.exchanges = 0  # completed on this connection

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        if self.response is None:  # nothing asked: a stray byte makes the connection unusable
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpError(ErrorKind.PROTOCOL, f"bad HTTP response: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None:
            return
        if response.status and not response.framed:  # a body delimited by the close
            response.done = time.perf_counter()
            self._finish()
            return
        unanswered = not response.status
        where = "before the answer" if unanswered else "in the middle of the answer"
        reason = f": {exc}" if exc else ""
        self._fail(HttpError(ErrorKind.CONNECTION, f"connection closed {where}{reason}", unanswered))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.response.headers
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = status = self.parser.get_status_code()
        response.first_byte = self.now
        headers = response.headers
        response.framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")
        response.reader = response.make_reader(status, headers)

    def on_body(self, body: bytes) -> None:
        self.response.reader.feed(body, self.now)

    def on_message_complete(self) -> None:
        self.response.done = self.now
        self.reusable = self.parser.should_keep_alive()
        self._finish()

    # -- the exchange

    def exchange(self, raw: bytes, make_reader: ReaderFactory, remaining: float, timeout: float) -> asyncio.Future[Response]:
        """Write ``raw``; the future fails after ``remaining`` seconds (of a ``timeout``)."""
        response = Response(make_reader)
        self.response = response
        self.waiter = waiter = self.loop.create_future()
        self.timer = self.loop.call_later(remaining, self._time_out, timeout)
        response.sent = time.perf_counter()
        self.transport.write(raw)
        return waiter

    def _finish(self) -> None:
        response, waiter = self.response, self.waiter
        self._clear()
        self.exchanges += 1
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _fail(self, error: HttpError) -> None:
        waiter = self.waiter
        self._clear()
        self.reusable = False
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _clear(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.response = self.waiter = self.timer = None

    def _time_out(self, timeout: float) -> None:
        self.timer = None
        self._fail(HttpError(ErrorKind.TIMEOUT, f"no complete answer within {timeout:g} s"))
        self.abort()

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()


class ConnectionPool:
    """Keep-alive connections to one origin, opened on demand, reused most recent first.

    No limit of its own: the runner bounds the requests in flight, so the number of open
    connections follows the concurrency the workload asks for."""

    def __init__(self, base: BaseURL, context: ssl.SSLContext | None = None) -> None:
        self.base = base
        self.context = context if context is not None else (ssl_context() if base.tls else None)
        self.idle: list[_Connection] = []
        self.all: set[_Connection] = set()
        self.opened = 0

    async def request(self, raw: bytes, make_reader: ReaderFactory, timeout: float) -> Response:
        """Send ``raw`` (a whole HTTP/1.1 request) and wait for the complete answer.
        A keep-alive connection the server closed while idle is retried once, fresh."""
        deadline = time.perf_counter() + timeout
        conn = self._idle()
        if conn is not None:
            try:
                return await self._exchange(conn, raw, make_reader, deadline, timeout)
            except HttpError as exc:
                if not exc.unanswered:
                    raise
        conn = await self._connect(deadline - time.perf_counter(), timeout)
        return await self._exchange(conn, raw, make_reader, deadline, timeout)

    async def _exchange(
        self, conn: _Connection, raw: bytes, make_reader: ReaderFactory, deadline: float, timeout: float
    ) -> Response:
        try:
            response = await conn.exchange(raw, make_reader, max(deadline - time.perf_counter(), 0.0), timeout)
        except BaseException:
            conn.abort()  # cancelled or failed mid-answer: the connection's state is unknown
            self.all.discard(conn)
            raise
        if conn.reusable and not conn.closed:
            self.idle.append(conn)
        else:
            conn.abort()
            self.all.discard(conn)
        return response

    def _idle(self) -> _Connection | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
            self.all.discard(conn)
        return None

    async def _connect(self, remaining: float, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        base = self.base
        tls = {"ssl": self.context, "server_hostname": base.host} if self.context is not None else {}
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Connection, base.host, base.port, **tls), max(remaining, 0.0))
        except (TimeoutError, asyncio.TimeoutError):
            raise HttpError(ErrorKind.TIMEOUT, f"connect to {base.authority}: no connection within {timeout:g} s") from None
        except ssl.SSLError as exc:
            raise HttpError(ErrorKind.TLS, f"TLS with {base.authority}: {exc.reason or exc}") from None
        except OSError as exc:  # asyncio words a refusal "Connect call failed": say what errno says
            reason = os.strerror(exc.errno) if exc.errno and not isinstance(exc, socket.gaierror) else str(exc)
            raise HttpError(ErrorKind.CONNECTION, f"connect to {base.authority}: {reason}") from None
        self.all.add(conn)
        self.opened += 1
        return conn

    def close(self) -> None:
        for conn in self.all:
            if conn.transport is not None:
                conn.transport.close()
        self.all.clear()
        self.idle.clear()

    def __repr__(self) -> str:
        return f"<ConnectionPool {self.base.authority} open={len(self.all)} idle={len(self.idle)} opened={self.opened}>"
