"""The HTTP/1.1 listener's protocol: uvicorn's httptools protocol with a client's limits.

uvicorn's ``HttpToolsProtocol`` parses fast but trusts the client with the head of a
request: a connection that never completes its headers (slowloris), or never sends a byte,
stays open for ever and counts against ``limit_concurrency``; headers have no count or
size limit (httptools buffers a header value until it ends, however long); parser errors
are answered in plain text. ``H1Protocol`` adds, per connection:

- ``limits.header_timeout_s``: from the connection's start, or from a request's first
  byte, its whole head (request line and headers) must arrive this soon, else ``408`` and
  the connection is closed (nginx's ``client_header_timeout``). The wait between requests
  on a kept-alive connection stays uvicorn's ``timeout_keep_alive``;
- ``limits.max_header_bytes`` and ``limits.max_header_count``: past either, ``431`` and
  close (counted as the parser hands over the URL and each header, and as raw bytes
  arrive while a head is incomplete, so an endless header is cut off within one read);
- OpenAI-shaped JSON for what the parser refuses (``400``: malformed request line, unknown
  method, smuggling attempts, a malformed chunked body) and for ``limits.max_connections``
  (``503`` with ``Retry-After``; the connections of the HTTPS and HTTP/3 listeners count
  too). A refusal in the middle of a body whose response has not started is answered too:
  the app is told the client has gone (``http.disconnect``), and the 400 goes out instead;
- the framing RFC 9112 asks a server to insist on: exactly one ``Host`` (``400``; HTTP/1.0
  may have none); ``Transfer-Encoding`` only as a plain ``chunked`` (a coding before it,
  which the gateway does not decode: ``501``; ``chunked`` not last, twice, or a malformed
  list, or any ``Transfer-Encoding`` in HTTP/1.0: ``400``), checked before the app sees
  the request.

A response's status line and headers are held until its first body bytes and written with
them (``_HeadCork``): a JSON answer goes out in one write (one syscall, one TCP segment)
instead of two; a head whose body does not follow within the same turn of the loop (a stream
waiting for its first event) is written alone on the next turn.

A response's head is written by ``_Cycle.send``: the bytes uvicorn's ``send`` writes, checked
and lower-cased over all the headers at once (a few C calls) instead of header by header
(two regular-expression searches, a ``lower`` and three comparisons each: a third of the
listener's Python work per JSON answer).

A response body may also be written from a callback (``scope[WRITER]``, a
``_ChunkWriter``): the relay's ``Splice`` writes SSE events as the upstream delivers them.

Timeouts go through the loop's watchdog (``gateway.core.timeouts``): no timer per request. A
lost connection is reported to the request's ``scope[ON_GONE]`` when admission put a
callable there: no task per request waits on ``receive`` for the disconnect.
"""

from __future__ import annotations

import weakref

import re

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.core.context import ON_GONE, WRITER
from gateway.core.settings import LimitSettings
from gateway.core.timeouts import Watch, watchdog
from gateway.ingress.guard import error_body, too_many_bytes, too_many_connections

__all__ = ["H1Protocol"]

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
}
_FRAMING = frozenset({b"host", b"transfer-encoding", b"expect"})  # request headers the listener reads itself
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 5.6.2


class _Refusal(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _TooLarge(_Refusal):
    def __init__(self, message: str) -> None:
        super().__init__(431, "request_header_fields_too_large", message)


class H1Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header limits and a header timeout; made for a
    gateway's limits by ``H1Protocol.with_limits`` (uvicorn instantiates the class)."""

    limits: LimitSettings = LimitSettings()

    @classmethod
    def with_limits(cls, limits: LimitSettings) -> type[H1Protocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._max_connections = self.limit_concurrency
        self.limit_concurrency = None  # checked here, to answer in JSON
        self._app = self.app
        self._in_head = False  # the head of a request is arriving
        self._head_bytes = 0
        self._head_size = 0
        self._hosts = 0
        self._codings: list[bytes] = []  # Transfer-Encoding values
        self._deadline = _HeadDeadline(self)
        self._dog = watchdog()
        self._max_count = self.limits.max_header_count  # read for every header
        self._max_bytes = self.limits.max_header_bytes

    # -- the head's deadline ----------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte must not stay for ever

    def connection_lost(self, exc) -> None:
        self._dog.discard(self._deadline)
        cycle = self.cycle
        if cycle is not None and type(cycle.transport) is _HeadCork:
            cycle.transport.flush()  # a response that never wrote: the cork lets go of its cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # lost before the response was complete
            gone = cycle.scope.get(ON_GONE)
            if gone is not None:
                gone()
        # the references between this protocol, its deadline and its last request's cycle
        # would leave the connection's objects to the garbage collector: freed now instead
        self.cycle = None
        self._deadline.protocol = None

    def _arm(self) -> None:
        self._deadline.at = self._dog.loop.time() + self.limits.header_timeout_s
        self._dog.add(self._deadline)

    def head_timed_out(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.logger.info("closing a connection whose request head did not arrive within %g s", self.limits.header_timeout_s)
        self._refuse(408, "request_timeout", f"the request headers did not arrive within {self.limits.header_timeout_s:g} s")

    # -- parsing --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(refusal.status, refusal.code, str(refusal))
            else:
                self._refuse(400, "invalid_http_request", "Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            self.logger.info("invalid HTTP request: %s", exc)
            self._refuse(400, "invalid_http_request", _parser_message(exc))
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, "request_header_fields_too_large", too_many_bytes(self.limits.max_header_bytes))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0  # bytes received while the head is incomplete (what httptools buffers)
        self._head_size = 0  # the parsed head: URL, names and values
        self._hosts = 0
        self._codings = []
        if self._deadline not in self._dog.watches:  # a new connection's first request: from the connect
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > self.limits.max_header_bytes:
            raise _TooLarge(too_many_bytes(self.limits.max_header_bytes))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        size = self._head_size = self._head_size + len(name) + len(value) + 4
        headers = self.headers
        if size > self._max_bytes or len(headers) >= self._max_count:
            if len(headers) >= self._max_count:
                raise _TooLarge(f"a request may have at most {self._max_count} headers")
            raise _TooLarge(too_many_bytes(self._max_bytes))
        name = name.lower()
        if name in _FRAMING:
            self._framing_header(name, value)
        headers.append((name, value))

    def _framing_header(self, name: bytes, value: bytes) -> None:
        if name == b"host":
            self._hosts += 1
        elif name == b"transfer-encoding":
            self._codings.append(value)
        elif value.lower() == b"100-continue":  # Expect: uvicorn's on_header, inlined
            self.expect_100_continue = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._dog.discard(self._deadline)
        self._check_framing()
        self.scope[ON_GONE] = None  # admission's to fill: told here when the client leaves
        limit = self._max_connections
        # this connection is one of ``connections``: the limit-th is still served
        if limit is not None and (len(self.connections) > limit or len(self.tasks) >= limit):
            self.logger.warning("over limits.max_connections (%d): answering 503", limit)
            self.app = self._overloaded
            try:
                super().on_headers_complete()
            finally:
                self.app = self._app
        else:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # not for an upgrade: no cycle of its own
                cycle.__class__ = _Cycle  # its task has not run yet: its first send is _Cycle's
                self.scope[WRITER] = _ChunkWriter(cycle)
                if not (self.pipeline and self.pipeline[0][0] is cycle):  # a pipelined one writes when its turn comes
                    cycle.transport = _HeadCork(cycle, self.transport, self.loop)

    def _check_framing(self) -> None:
        """Host and Transfer-Encoding as RFC 9112 3.2 and 6.1 have a server check them."""
        version = self.parser.get_http_version()
        if self._hosts > 1 or (self._hosts == 0 and version != "1.0"):
            raise _Refusal(400, "invalid_http_request", "a request must have exactly one Host header")
        if not self._codings:
            return
        if version == "1.0":
            raise _Refusal(400, "invalid_http_request", "HTTP/1.0 has no Transfer-Encoding")
        codings = [coding.strip().lower() for value in self._codings for coding in value.split(b",")]
        if not all(_TOKEN.fullmatch(coding) for coding in codings):
            raise _Refusal(400, "invalid_http_request", "malformed Transfer-Encoding")
        if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
            raise _Refusal(400, "invalid_http_request", "Transfer-Encoding must end with chunked, once")
        if len(codings) > 1:
            unknown = codings[0].decode("latin-1")
            raise _Refusal(
                501, "unsupported_transfer_coding", f"the transfer coding {unknown!r} is not supported (only chunked)"
            )

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid_http_request", msg)

    # -- answers of our own ---------------------------------------------------------------

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` with an OpenAI error and close. A request whose body was being
        read when the parser refused it is taken from the app first (as if its client had
        gone) when its response has not started; when a response is under way (this
        request's, or a pipelined earlier one's), only close: bytes of ours would land
        inside it."""
        self._dog.discard(self._deadline)
        if self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started and not self.pipeline:
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its send() writes nothing
            cycle.message_event.set()
            cycle = None
        if cycle is None or cycle.response_complete:
            body = error_body(status, code, message)
            head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
            for name, value in self.server_state.default_headers:
                head.append(name + b": " + value + b"\r\n")
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
            self.transport.write(b"".join(head) + body)
        self.transport.close()

    async def _overloaded(self, scope, receive, send) -> None:
        async def send_and_close(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
            await send(message)

        await too_many_connections(self.limits)(scope, receive, send_and_close)


_HEADER_LINE = b"%b: %b\r\n".__mod__
_bad_name = HEADER_RE.search
_bad_value = HEADER_VALUE_RE.search


class _Cycle(RequestResponseCycle):
    """uvicorn's request-response cycle whose ``send`` writes a response's head as
    uvicorn's does, byte for byte and with the same errors, over all its headers at once:
    a string that holds a forbidden byte is one whose parts do, so the names are checked
    joined, and the values joined; the names are lower-cased joined (a valid name holds no
    newline). The cases it does not do itself (the body, ``Transfer-Encoding`` or
    ``Connection`` among the headers, an access log, a paused or gone client, a head that
    is refused) go to uvicorn's ``send``, which starts from the same state."""

    async def send(self, message) -> None:
        if self.response_started or self.disconnected or self.access_log or self.flow.write_paused:
            return await super().send(message)
        headers = self.default_headers + list(message.get("headers", ()))
        if not headers or message["type"] != "http.response.start":
            return await super().send(message)
        names, values = zip(*headers)
        if _bad_name(b"".join(names)) or _bad_value(b"".join(values)):
            return await super().send(message)  # raises uvicorn's error for it
        lowered = b"\n".join(names).lower().split(b"\n")
        if b"transfer-encoding" in lowered or b"connection" in lowered:
            return await super().send(message)
        self.response_started = True
        self.waiting_for_100_continue = False
        if b"content-length" in lowered:  # the first one counts, as in uvicorn's loop
            self.expected_content_length = int(values[lowered.index(b"content-length")].decode())
            self.chunked_encoding = False
        status = message["status"]
        content = [STATUS_LINE[status], *map(_HEADER_LINE, zip(lowered, values))]
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        if self.chunked_encoding is None and status not in (204, 304) and self.scope["method"] != "HEAD":
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))


class _ChunkWriter:
    """``gateway.relay.BodyWriter`` for one response: a body chunk straight onto the
    socket, framed as uvicorn's ``send`` frames it (chunked transfer encoding), with no
    ASGI message and no task in between. ``send`` still starts and ends the response."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle) -> None:
        # weakly: the cycle's scope holds this writer, and a strong reference would make
        # every request a reference cycle that only the garbage collector frees
        self._cycle = weakref.ref(cycle)

    @property
    def writable(self) -> bool:
        cycle = self._cycle()
        return (
            cycle is not None
            and cycle.chunked_encoding is True
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
        )

    def write(self, data: bytes) -> bool:
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or cycle.response_complete:
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not cycle.flow.write_paused


class _HeadCork:
    """A response's transport until its first write after the head: the first bytes written
    (the status line and headers, or a ``100 Continue``) are held and go out with the next
    ones, in one write, or alone on the loop's next turn if none follow in this one. Then
    the cycle gets its real transport back, so the body's writes pay nothing for this."""

    __slots__ = ("_cycle", "_transport", "_loop", "_held")

    def __init__(self, cycle, transport, loop) -> None:
        self._cycle = cycle
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        cycle = self._cycle
        if cycle is not None:
            if held is None:
                self._held = data
                self._loop.call_soon(self.flush)  # nothing is held past this turn of the loop
                return
            self._cycle = None
            cycle.transport = self._transport  # the cork's part is done
            self._held = None
            data = held + data
        self._transport.write(data)

    def flush(self) -> None:
        cycle = self._cycle
        if cycle is None:  # a second write took the head along
            return
        self._cycle = None
        cycle.transport = self._transport
        held = self._held
        self._held = None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class _HeadDeadline(Watch):
    __slots__ = ("protocol", "at")

    def __init__(self, protocol: H1Protocol) -> None:
        self.protocol: H1Protocol | None = protocol
        self.at = 0.0

    def overdue(self, now: float) -> bool:
        return now >= self.at

    def expire(self) -> None:
        if self.protocol is not None:
            self.protocol.head_timed_out()


def _parser_message(exc: httptools.HttpParserError) -> str:
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        return "Invalid HTTP request received: unknown method."
    if isinstance(exc, httptools.HttpParserInvalidURLError):
        return "Invalid HTTP request received: malformed URL."
    return "Invalid HTTP request received."
