"""One request on a multiplexed connection (HTTP/2 or HTTP/3), as an ASGI app sees it.

The connection protocols (``gateway.ingress.h2``, ``gateway.ingress.h3``) parse frames and
feed a ``RequestStream``; the app talks to it through ``receive`` and ``send``, in the
shape uvicorn gives HTTP/1.1 requests, so the same app serves all three:

- ``receive`` hands out the request body as it arrives (each chunk is acknowledged to the
  peer's flow control when the app takes it), then waits and answers ``http.disconnect``
  once the response is complete or the client has gone (RST_STREAM / STOP_SENDING / the
  connection lost) — the gateway's disconnect watcher relies on exactly that;
- ``send`` returns only when the connection has room for the bytes: the peer's
  flow-control window and the socket's buffer for HTTP/2, the QUIC stream's unacknowledged
  bytes under the relay buffer size for HTTP/3. A slow client therefore blocks the app's
  writes, which stops the relay reading its upstream. (hypercorn's HTTP/2 send buffer
  releases the writer whenever the window is closed, so its writes never block; that is
  why the gateway does not use it for ingress.) After a disconnect ``send`` drops the bytes
  and returns, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Protocol
from urllib.parse import unquote

__all__ = ["RequestStream", "StreamConnection", "build_scope", "response_headers"]

logger = logging.getLogger("edgegw.ingress")

# connection-specific headers have no place in HTTP/2 or HTTP/3 (RFC 9113 8.2.2, RFC 9114 4.2)
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_ASGI = {"version": "3.0", "spec_version": "2.4"}
_ERROR_BODY = b"Internal Server Error"


class StreamConnection(Protocol):
    """What a ``RequestStream`` needs from its connection."""

    def send_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None: ...

    async def send_data(self, stream: RequestStream, data: bytes, end: bool) -> None: ...

    def reset(self, stream_id: int) -> None: ...

    def ack(self, stream_id: int, nbytes: int) -> None: ...

    def stream_closed(self, stream: RequestStream) -> None: ...


def build_scope(
    headers: list[tuple[bytes, bytes]],
    http_version: str,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    app_state: dict[str, Any],
) -> dict[str, Any] | None:
    """The ASGI scope of a request from its (pseudo-)headers; None when it is not a plain
    HTTP request (no method or path: CONNECT and extended CONNECT are not served)."""
    method = raw = authority = None
    scheme = "https"
    fields = []
    has_host = False
    for name, value in headers:
        if name[:1] == b":":
            if name == b":method":
                method = value
            elif name == b":path":
                raw = value
            elif name == b":authority":
                authority = value
            elif name == b":scheme":
                scheme = value.decode("latin-1")
        else:
            if name == b"host":
                has_host = True
            fields.append((name, value))
    if method is None or raw is None or method == b"CONNECT":
        return None
    if authority is not None and not has_host:
        fields.insert(0, (b"host", authority))
    raw_path, _, query = raw.partition(b"?")
    return {
        "type": "http",
        "asgi": _ASGI,
        "http_version": http_version,
        "server": server,
        "client": client,
        "scheme": scheme,
        "method": method.decode("ascii"),
        "root_path": "",
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "headers": fields,
        "state": app_state.copy(),
    }


def response_headers(
    status: int, headers: list[tuple[bytes, bytes]], default_headers: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """``:status`` first, names lower-cased, connection-specific headers dropped, the
    server's defaults (``date``) added unless the app set them."""
    out = [(b":status", str(status).encode())]
    names = set()
    for name, value in headers:
        name = bytes(name).lower()
        if name not in _HOP_BY_HOP:
            out.append((name, bytes(value)))
            names.add(name)
    for name, value in default_headers:
        if name not in names:
            out.append((name, value))
    return out


class RequestStream:
    """The request and response of one stream. The connection feeds it (``feed``,
    ``feed_eof``, ``disconnect``, ``wake_writer``); the app drives ``receive``/``send``."""

    __slots__ = (
        "id", "scope", "task", "disconnected", "complete", "_conn", "_loop", "_default_headers",
        "_body", "_body_done", "_request_done", "_reader", "_writer", "_status", "_headers", "_headers_sent",
    )

    def __init__(
        self,
        conn: StreamConnection,
        stream_id: int,
        scope: dict[str, Any],
        body_done: bool,
        default_headers: list[tuple[bytes, bytes]],
    ) -> None:
        self.id = stream_id
        self.scope = scope
        self.task: asyncio.Task | None = None
        self.disconnected = False
        self.complete = False
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._default_headers = default_headers
        self._body: deque[tuple[bytes, int]] = deque()
        self._body_done = body_done
        self._request_done = False
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None
        self._status: int | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._headers_sent = False

    # -- the connection's side ---------------------------------------------------------

    def feed(self, data: bytes, flow: int) -> None:
        self._body.append((data, flow))
        _wake(self._reader)

    def feed_eof(self) -> None:
        self._body_done = True
        _wake(self._reader)

    def disconnect(self) -> None:
        """The client reset the stream or the connection is gone."""
        if not self.disconnected:
            self.disconnected = True
            _wake(self._reader)
            _wake(self._writer)

    def wake_writer(self) -> None:
        _wake(self._writer)

    def discard_body(self) -> int:
        """Drop the body chunks the app did not take; returns their flow-controlled
        length, which the connection gives back to the client (an app that answers without
        reading the body, a 401 or a 415, must not dry up the connection's window)."""
        flow = 0
        for _, length in self._body:
            flow += length
        self._body.clear()
        return flow

    async def wait_writable(self) -> None:
        """Park the app's ``send`` until the connection calls ``wake_writer``."""
        waiter = self._writer = self._loop.create_future()
        try:
            await waiter
        finally:
            self._writer = None

    # -- ASGI ------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        while True:
            body = self._body
            if body:
                data, flow = body.popleft()
                if flow:
                    self._conn.ack(self.id, flow)
                more = bool(body) or not self._body_done
                self._request_done = not more
                return {"type": "http.request", "body": data, "more_body": more}
            if self._body_done and not self._request_done:
                self._request_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if self.disconnected or self.complete:
                return {"type": "http.disconnect"}
            waiter = self._reader = self._loop.create_future()
            try:
                await waiter
            finally:
                self._reader = None

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self._status is not None:
                raise RuntimeError("http.response.start sent twice")
            self._status = message["status"]
            self._headers = message.get("headers", [])
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if self._status is None:
            raise RuntimeError("http.response.body before http.response.start")
        if self.complete:
            raise RuntimeError("the response is already complete")
        if self.disconnected:
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not self._headers_sent:
            self._headers_sent = True
            end = not body and not more
            self._conn.send_headers(self.id, response_headers(self._status, self._headers, self._default_headers), end)
            if end:
                self._finish()
                return
        if body or not more:
            await self._conn.send_data(self, bytes(body), not more)
        if not more:
            self._finish()

    def _finish(self) -> None:
        self.complete = True
        _wake(self._reader)  # the app's receive() now answers http.disconnect

    async def run(self, app) -> None:
        """Run the app on this stream; a failure before the response is a 500, after it a
        reset stream (the client must not take a truncated body for a whole one). A stream
        the client reset before its turn came (a "rapid reset") never reaches the app."""
        try:
            if self.disconnected:
                return
            try:
                await app(self.scope, self.receive, self.send)
            except Exception:
                if not self.disconnected:
                    logger.exception("exception in the ASGI application")
                await self._fail()
            else:
                if not self.complete and not self.disconnected:
                    logger.error("the ASGI application returned without completing its response")
                    await self._fail()
        except BaseException:  # cancelled: the server is going away
            if not self.complete and not self.disconnected:
                self.complete = True
                self._conn.reset(self.id)
            raise
        finally:
            self._conn.stream_closed(self)

    async def _fail(self) -> None:
        if self.disconnected or self.complete:
            return
        self.complete = True
        if self._headers_sent:
            self._conn.reset(self.id)
            return
        self._headers_sent = True
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(_ERROR_BODY))]
        self._conn.send_headers(self.id, response_headers(500, headers, self._default_headers), False)
        await self._conn.send_data(self, _ERROR_BODY, True)


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)

