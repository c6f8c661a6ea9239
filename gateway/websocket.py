"""``GET /v1/ws``: the same relay over a WebSocket.

The client sends a request body as one JSON text message (a chat request when it has
``messages``, a completion when it has ``prompt``); the gateway streams the answer back as
one text message per chunk (the chunk JSON exactly as the backend produced it), then
``{"type":"done"}``. Failures arrive as ``{"type":"error","status":N,"error":{...}}``
and the socket stays open; several requests may follow on one socket, one at a time.

Backpressure is the WebSocket's: ``send`` waits while the client's socket is full, so the
upstream is not read meanwhile. A client that closes the socket cancels the upstream
request at once, as on the HTTP path.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import orjson

from gateway.errors import GatewayError, InvalidRequest, Overloaded
from gateway.protocol import CHAT, COMPLETION, parse_request
from gateway.relay import EventReader, sse_payloads
from gateway.state import State

__all__ = ["WebSocketEndpoint"]

_DONE = orjson.dumps({"type": "done"}).decode()
_PATHS = {CHAT: b"/v1/chat/completions", COMPLETION: b"/v1/completions"}
_MAX_PENDING = 16


class _Closed(Exception):
    pass


class WebSocketEndpoint:
    def __init__(self, state: State) -> None:
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        pending: deque[dict] = deque()
        while True:
            message = pending.popleft() if pending else await receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            if data is None:
                data = (message.get("bytes") or b"").decode("utf-8", "replace")
            try:
                await self._serve_one(scope, receive, send, data.encode(), pending)
            except _Closed:
                return

    async def _serve_one(self, scope, receive, send, body: bytes, pending: deque) -> None:
        state = self.state
        limits = state.settings.limits
        task = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    gone = True
                    task.cancel()
                    return
                if len(pending) < _MAX_PENDING:
                    pending.append(message)

        watcher = None
        response = None
        if state.draining or state.in_flight >= limits.max_in_flight:
            await _send_error(send, Overloaded("the gateway is busy", retry_after=limits.retry_after_s))
            return
        state.in_flight += 1
        try:
            if len(body) > limits.max_body_bytes:
                raise InvalidRequest(
                    f"request of {len(body)} bytes exceeds the limit of {limits.max_body_bytes} bytes",
                    code="request_too_large",
                )
            kind = _kind_of(body)
            parsed = parse_request(kind, body)
            if not parsed.stream:
                parsed = parsed.with_fields(stream=True)
            cluster = state.dispatcher.cluster_for(parsed.model)
            started = time.perf_counter()
            watcher = asyncio.get_running_loop().create_task(watch())
            response, upstream, _ = await state.dispatcher.open(
                cluster, _PATHS[kind], [(b"accept", b"text/event-stream")], parsed.body
            )
            series = state.metrics.series(parsed.model, upstream.url)
            if response.status >= 400:
                data = await response.body.read_all(upstream.timeouts.read, limits.max_response_bytes)
                try:
                    error = orjson.loads(data).get("error")
                except (orjson.JSONDecodeError, AttributeError):
                    error = None
                await _send_text(send, orjson.dumps({"type": "error", "status": response.status, "error": error}).decode())
                return
            reader = EventReader(response.body, limits.keepalive_interval_s, upstream.timeouts.read, limits.max_event_bytes)
            last = 0.0
            while True:
                events = await reader.next()
                if events is None:
                    continue
                if not events:
                    break
                now = time.perf_counter()
                if last:
                    series.gap.observe(now - last)
                else:
                    series.ttft.observe(now - started)
                last = now
                for payload in sse_payloads(events):
                    if payload != b"[DONE]":
                        await _send_text(send, payload.decode())
            series.e2e.observe(time.perf_counter() - started)
            await _send_text(send, _DONE)
        except GatewayError as exc:
            await _send_error(send, exc)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            state.metrics.client_disconnects.inc()
            raise _Closed from None
        finally:
            if watcher is not None:
                watcher.cancel()
            if response is not None:
                response.close()
            state.in_flight -= 1


def _kind_of(body: bytes) -> str:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return CHAT  # parse_request reports the error
    if isinstance(data, dict) and "prompt" in data and "messages" not in data:
        return COMPLETION
    return CHAT


async def _send_text(send, text: str) -> None:
    await send({"type": "websocket.send", "text": text})


async def _send_error(send, exc: GatewayError) -> None:
    error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    await _send_text(send, orjson.dumps({"type": "error", "status": exc.status, "error": error}).decode())
