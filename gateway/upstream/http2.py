"""HTTP/2 pool: a few multiplexed connections per origin, driven by h2 over asyncio.

h2c with prior knowledge on ``http://`` origins, ALPN ``h2`` on ``https://`` ones.
Backpressure is HTTP/2's own: each stream's receive window is the relay buffer size
(``limits.stream_buffer_bytes``), and bytes are acknowledged (WINDOW_UPDATE) only when the
relay has taken them, so a slow client stalls exactly its own stream at the server while the
other streams on the connection keep flowing (the connection window is kept large).
Cancelling an unfinished response sends RST_STREAM(CANCEL).
"""

from __future__ import annotations

import asyncio
import logging

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from gateway.core.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamReadTimeout,
)
from gateway.upstream.base import (
    MultiplexedPool, Origin, Refused, Timeouts, connect, head_timeout, rewarm_soon, split_status, wait_closed,
)
from gateway.upstream.body import Body

__all__ = ["H2Pool"]

logger = logging.getLogger("edgegw.upstream")

_CONNECTION_WINDOW = 32 * 1024 * 1024


class _Stream:
    __slots__ = ("id", "head", "body", "send_window")

    def __init__(self, stream_id: int, head: asyncio.Future) -> None:
        self.id = stream_id
        self.head = head
        self.body: Body | None = None
        self.send_window: asyncio.Future[None] | None = None


class _H2Connection(asyncio.Protocol):
    def __init__(self, pool: H2Pool) -> None:
        self._pool = pool
        self._loop = pool._loop
        self._h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                header_encoding=None,
                # h2's header checks cost more CPU than the rest of a request; the gateway
                # builds its own headers, and a malformed answer fails on its own
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
            )
        )
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = self._loop.create_future()  # done once the transport is gone
        self.streams: dict[int, _Stream] = {}
        self.max_streams = 100
        self.is_closed = False
        self.is_draining = False  # GOAWAY received: no new streams

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        h2conn = self._h2
        h2conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self._pool._high_water,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
            },
        )
        h2conn.initiate_connection()
        h2conn.increment_flow_control_window(_CONNECTION_WINDOW - 65535)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        error = UpstreamProtocolError("upstream closed the HTTP/2 connection")
        for stream in list(self.streams.values()):
            self._fail_stream(stream, error if stream.head.done() else Refused())
        self.streams.clear()
        self._pool._lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self._flush()
            self._abort(UpstreamProtocolError(f"HTTP/2 protocol error from the upstream: {exc}"))
            return
        for event in events:
            handler = _HANDLERS.get(type(event))
            if handler is not None:
                handler(self, event)
        self._flush()

    # -- h2 events -------------------------------------------------------------------

    def _on_response(self, event: h2.events.ResponseReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            return
        status, headers = split_status(event.headers)
        stream.body = Body(self._loop, self._pool._high_water, None, lambda n, sid=stream.id: self._ack(sid, n))
        if not stream.head.done():
            stream.head.set_result((status, headers))

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None or stream.body is None:
            # a cancelled stream: give the connection window back at once
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        stream.body.feed(event.data, event.flow_controlled_length)

    def _on_end(self, event: h2.events.StreamEnded) -> None:
        stream = self.streams.pop(event.stream_id, None)
        if stream is not None and stream.body is not None:
            stream.body.feed_eof()
        self._stream_done()

    def _on_reset(self, event: h2.events.StreamReset) -> None:
        stream = self.streams.pop(event.stream_id, None)
        if stream is not None:
            if event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                error: Exception = Refused()
            else:
                error = UpstreamProtocolError(f"upstream reset the stream ({event.error_code!r})")
            self._fail_stream(stream, error)
        self._stream_done()

    def _stream_done(self) -> None:
        if self.is_draining and not self.streams and self.transport is not None:
            self.transport.close()  # GOAWAY received and the last stream is over
        self._pool._stream_done(self)

    def _on_window(self, event: h2.events.WindowUpdated) -> None:
        self._wake_senders(event.stream_id)

    def _wake_senders(self, stream_id: int) -> None:
        streams = self.streams.values() if stream_id == 0 else [self.streams.get(stream_id)]
        for stream in streams:
            if stream is not None and stream.send_window is not None and not stream.send_window.done():
                stream.send_window.set_result(None)

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
        if changed is not None:
            self.max_streams = changed.new_value
        self._wake_senders(0)  # an INITIAL_WINDOW_SIZE change may free senders

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        self.is_draining = True
        last = event.last_stream_id or 0
        for stream_id in [sid for sid in self.streams if sid > last]:
            self._fail_stream(self.streams.pop(stream_id), Refused())
        self._pool._lost(self)
        if not self.streams and self.transport is not None:
            self.transport.close()

    # -- requests --------------------------------------------------------------------

    async def exchange(
        self, headers: list[tuple[bytes, bytes]], body: bytes, timeouts: Timeouts, within: float | None
    ) -> tuple[int, list[tuple[bytes, bytes]], Body, int]:
        h2conn = self._h2
        try:
            stream_id = h2conn.get_next_available_stream_id()
            h2conn.send_headers(stream_id, headers, end_stream=not body)
        except h2.exceptions.H2Error:
            raise Refused() from None  # the connection is closing: nothing was sent
        head = self._loop.create_future()
        stream = self.streams[stream_id] = _Stream(stream_id, head)
        handle = None
        try:
            if body:
                await self._send_body(stream, memoryview(body), timeouts.write)
            else:
                self._flush()
            if within is not None and within < timeouts.read:
                handle = self._loop.call_later(within, head_timeout, head, within, True)
            else:
                handle = self._loop.call_later(timeouts.read, head_timeout, head, timeouts.read)
            status, response_headers = await head
        except h2.exceptions.H2Error as exc:
            self.cancel(stream_id)
            raise UpstreamProtocolError(f"HTTP/2 error while sending the request: {exc}") from None
        except BaseException:
            self.cancel(stream_id)
            raise
        finally:
            if handle is not None:
                handle.cancel()
        return status, response_headers, stream.body, stream_id  # type: ignore[return-value]

    async def _send_body(self, stream: _Stream, view: memoryview, timeout: float) -> None:
        """Send the request body as the flow-control windows allow; wait (up to ``timeout``
        in all) only when they are closed, which for a chat request is almost never."""
        h2conn = self._h2
        deadline = self._loop.time() + timeout
        while view:
            if self.is_closed or stream.id not in self.streams:
                raise UpstreamProtocolError("upstream stream closed while sending the request")
            window = min(h2conn.local_flow_control_window(stream.id), h2conn.max_outbound_frame_size)
            if window <= 0:
                self._flush()
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    raise UpstreamReadTimeout(f"sending the request took over {timeout:g} s")
                waiter = stream.send_window = self._loop.create_future()
                handle = self._loop.call_later(remaining, _wake, waiter)
                try:
                    await waiter
                finally:
                    handle.cancel()
                    stream.send_window = None
                continue
            h2conn.send_data(stream.id, view[:window].tobytes())
            view = view[window:]
        h2conn.end_stream(stream.id)
        self._flush()

    def cancel(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is None or self.is_closed:
            return
        try:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.H2Error:
            pass
        self._flush()
        self._stream_done()

    def close(self) -> None:
        if not self.is_closed and self.transport is not None:
            try:
                self._h2.close_connection()
                self._flush()
            except h2.exceptions.H2Error:
                pass
            self.transport.close()
            self.is_closed = True

    # -- helpers ---------------------------------------------------------------------

    def _ack(self, stream_id: int, nbytes: int) -> None:
        if nbytes and not self.is_closed:
            self._h2.acknowledge_received_data(nbytes, stream_id)
            self._flush()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _fail_stream(self, stream: _Stream, error: GatewayError) -> None:
        if not stream.head.done():
            stream.head.set_exception(error)
        elif stream.body is not None:
            stream.body.feed_error(error)
        if stream.send_window is not None and not stream.send_window.done():
            stream.send_window.set_result(None)

    def _abort(self, error: GatewayError) -> None:
        for stream in list(self.streams.values()):
            self._fail_stream(stream, error)
        self.streams.clear()
        if self.transport is not None:
            self.transport.close()

    @property
    def has_capacity(self) -> bool:
        return not self.is_closed and not self.is_draining and len(self.streams) < self.max_streams


_HANDLERS = {
    h2.events.ResponseReceived: _H2Connection._on_response,
    h2.events.DataReceived: _H2Connection._on_data,
    h2.events.StreamEnded: _H2Connection._on_end,
    h2.events.StreamReset: _H2Connection._on_reset,
    h2.events.WindowUpdated: _H2Connection._on_window,
    h2.events.RemoteSettingsChanged: _H2Connection._on_settings,
    h2.events.ConnectionTerminated: _H2Connection._on_goaway,
}


class H2Pool(MultiplexedPool):
    """Up to ``max_connections`` HTTP/2 connections to one origin; streams go to the least busy."""

    protocol = "http2"

    def __init__(self, origin: Origin, *, max_connections: int, warm_connections: int, timeouts: Timeouts, high_water: int) -> None:
        super().__init__(
            origin, max_connections=max_connections, warm_connections=warm_connections, timeouts=timeouts, high_water=high_water
        )
        self._connecting = 0  # warm-up connections being opened

    async def warm(self) -> None:
        """Open connections up to ``warm_connections`` now (a new connection costs a TCP,
        TLS and HTTP/2 handshake: the first requests should not pay for it)."""
        missing = self._warm - len(self._conns) - self._connecting
        if missing <= 0 or self._closed:
            return
        results = await asyncio.gather(*[self._open_warm() for _ in range(missing)], return_exceptions=True)
        for result in results:
            if isinstance(result, GatewayError):
                logger.warning("warm-up of %s failed: %s", self._origin, result.message)
                break

    async def _open_warm(self) -> _H2Connection:
        self._connecting += 1
        try:
            conn = await self._connect()
        finally:
            self._connecting -= 1
        if self._closed:
            conn.close()
        else:
            self._conns.append(conn)
            self._stream_done(conn)  # a waiter for a stream may take it
        return conn

    async def _closed_all(self, connections: list) -> None:
        await wait_closed(connections)

    async def _connect(self) -> _H2Connection:
        conn = await connect(
            self._loop, lambda: _H2Connection(self), self._origin, self._timeouts.connect
        )
        if self._origin.ssl is not None:
            ssl_object = conn.transport.get_extra_info("ssl_object")
            if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
                conn.close()
                raise UpstreamConnectError(f"{self._origin} did not negotiate h2 over ALPN")
        return conn

    def _lost(self, conn: _H2Connection) -> None:
        """A connection went away or received GOAWAY: forget it, and open another if the
        pool is now below ``warm_connections``."""
        if self._forget(conn) and not self._closed and len(self._conns) + self._connecting < self._warm:
            rewarm_soon(self)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
