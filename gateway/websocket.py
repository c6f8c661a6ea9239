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
import contextlib
import uuid
from collections import deque

import orjson

from gateway.endpoints import Answer, answer, header_map
from gateway.errors import GatewayError, Overloaded, PayloadTooLarge
from gateway.observability import Timing
from gateway.protocol import CHAT, COMPLETION, parse_request
from gateway.relay import sse_payloads
from gateway.state import State

__all__ = ["WebSocketEndpoint"]

_DONE = orjson.dumps({"type": "done"}).decode()
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

        if state.draining or state.in_flight >= limits.max_in_flight:
            await _send_error(send, Overloaded("the gateway is busy", retry_after=limits.retry_after_s))
            return
        state.in_flight += 1
        watcher = None
        result = Answer()
        failure: BaseException | None = None
        try:
            if len(body) > limits.max_body_bytes:
                raise PayloadTooLarge(f"request of {len(body)} bytes exceeds the limit of {limits.max_body_bytes} bytes")
            parsed = parse_request(_kind_of(body), body)
            if not parsed.stream:
                parsed = parsed.with_fields(stream=True)
            timing = Timing()
            watcher = asyncio.get_running_loop().create_task(watch())
            request_id = uuid.uuid4().hex
            client = scope.get("client")
            forward = [(b"x-request-id", request_id.encode()), (b"accept", b"text/event-stream")]
            await answer(state, parsed, header_map(scope), client[0] if client else None, request_id, timing, forward, result)
            reply = result.reply
            series = state.metrics.series(parsed.model, reply.label)
            if reply.status >= 400:
                data = await reply.read_body()
                try:
                    error = orjson.loads(data).get("error")
                except (orjson.JSONDecodeError, AttributeError):
                    error = None
                await _send_text(send, orjson.dumps({"type": "error", "status": reply.status, "error": error}).decode())
                return
            async with contextlib.aclosing(result.stream(state.dispatcher, series, timing.start)) as stream:
                async for events in stream:
                    for payload in sse_payloads(events) if events else ():
                        if payload != b"[DONE]":
                            await _send_text(send, payload.decode())
            series.e2e.observe(timing.elapsed())
            await _send_text(send, _DONE)
        except GatewayError as exc:
            failure = exc
            await _send_error(send, exc)
        except asyncio.CancelledError as exc:
            failure = exc
            if not gone:
                raise
            task.uncancel()
            state.metrics.client_disconnects.inc()
            raise _Closed from None
        finally:
            if watcher is not None:
                watcher.cancel()
            await result.close(failure)
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
