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

Idle connections close after ``keep_alive`` seconds without a stream; ``shutdown()`` (the
server draining) refuses new streams and closes (GOAWAY) once the last one ends.
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

__all__ = ["H2ServerProtocol"]

logger = logging.getLogger("edgegw.ingress")

_MAX_STREAMS = 100
_REQUEST_WINDOW = 1024 * 1024  # per-stream receive window for request bodies


class H2ServerProtocol(asyncio.Protocol):
    def __init__(self, app, server_state: Any, app_state: dict[str, Any], *, keep_alive: float = 75.0) -> None:
        self._app = app
        self._server_state = server_state
        self._app_state = app_state
        self._keep_alive = keep_alive
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
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, RequestStream] = {}
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._draining = False
        self._closed = False

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
            },
        )
        h2conn.initiate_connection()
        self._flush()
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server_state.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        for stream in list(self._streams.values()):
            stream.disconnect()
        _wake(self._drained)

    def data_received(self, data: bytes) -> None:
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._flush()
            self._close()
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

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._drained)

    # -- requests --------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        stream_id = event.stream_id
        scope = None if self._draining else build_scope(event.headers, "2", self._client, self._server, self._app_state)
        if scope is None:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        stream = self._streams[stream_id] = RequestStream(
            self, stream_id, scope, False, self._server_state.default_headers
        )
        task = stream.task = self._loop.create_task(stream.run(self._app))
        self._server_state.tasks.add(task)
        task.add_done_callback(self._server_state.tasks.discard)

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
            self._idle = self._loop.call_later(self._keep_alive, self._idle_out)

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
            self._closed = True
            self._transport.close()

    def _flush(self) -> None:
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)


def _wake(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
