"""``GET /v1/ws``: completions over a WebSocket.

The client sends a request body as one JSON text message (a chat request when it has
``messages``, a completion when it has ``prompt``); the answer streams back as one text
message per chunk, then ``{"type":"done"}``; failures arrive as
``{"type":"error","status":N,"error":{...}}`` and the socket stays open. Several requests
may follow on one socket and are answered in order, one at a time; messages sent ahead
wait in a small queue, and when it is full the socket is not read (backpressure), so none
is dropped.

``AdmissionApp`` admitted the socket at its handshake (``scope[SOCKET]``); this handler
keeps only the per-message loop, admitting each message through ``Gate.admit_message``.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.admission import SOCKET, Gate, Socket
from gateway.core.errors import GatewayError
from gateway.core.sse import ws_error
from gateway.observe import Metrics
from gateway.pipeline import Pipeline
from gateway.relay import respond_websocket
from gateway.replies import Answer

__all__ = ["WebSocketApp"]

_WS_QUEUE = 16  # WebSocket messages read ahead of the one being answered
_DRAIN = {"type": "edgegw.drain"}  # put in a socket's inbox when the gateway starts draining
_STOPPED = "the gateway stopped this answer: it is shutting down and the drain time ran out"


class WebSocketApp:
    def __init__(self, pipeline: Pipeline, gate: Gate, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.gate = gate
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        socket: Socket = scope[SOCKET]
        reader = _Reader(asyncio.current_task())
        task = asyncio.get_running_loop().create_task(reader.read(receive))
        self.gate.on_drain.add(reader.drain)
        try:
            for number in range(1, 1 << 62):
                if self.gate.draining:
                    break
                message = await reader.inbox.get()
                if reader.gone:
                    return  # nobody to answer what is still queued
                if message is _DRAIN:
                    break
                if await self._serve_one(scope, send, reader, socket, number, _text_of(message)):
                    return
            # the gateway is shutting down: the answer under way was finished, the socket ends
            await send({"type": "websocket.close", "code": 1001, "reason": "the gateway is shutting down"})
        finally:
            self.gate.on_drain.discard(reader.drain)
            task.cancel()

    async def _serve_one(self, scope, send, reader: _Reader, socket: Socket, number: int, body: bytes) -> bool:
        """Answer one message; True when the client left meanwhile."""
        gate = self.gate
        ctx = gate.begin(scope, socket.message_id(number), "ws")
        delivery = ctx.delivery
        answer = Answer()
        failure: BaseException | None = None
        reader.busy = True
        try:
            parsed = await gate.admit_message(ctx, socket, body)
            await self.pipeline.answer(ctx, parsed, answer)
            ctx.served.via = answer.reply.label
            ctx.served.target_kind = answer.target_kind
            await respond_websocket(send, ctx, answer, self.metrics.series(parsed.model, answer.reply.label))
        except GatewayError as exc:
            failure = exc
            delivery.status = exc.status
            error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
            await send({"type": "websocket.send", "text": ws_error(exc.status, error)})
        except asyncio.CancelledError as exc:
            failure = exc
            if not reader.gone:
                if self.gate.draining:  # the drain time ran out: say so, as a stream's error event does
                    stopped = {"message": _STOPPED, "type": "server_error", "param": None, "code": "shutting_down"}
                    with contextlib.suppress(Exception):
                        await send({"type": "websocket.send", "text": ws_error(503, stopped)})
                        await send({"type": "websocket.close", "code": 1001, "reason": "the gateway is shutting down"})
                raise
            asyncio.current_task().uncancel()
            delivery.gone = True
            delivery.status = 499
        finally:
            reader.busy = False
            await answer.close(ctx, failure)
            gate.done(ctx)
        return delivery.gone


class _Reader:
    """A WebSocket's reader: messages into ``inbox`` (waiting while it is full, so the
    socket is not read: backpressure); when the client leaves, the message being answered
    is cancelled."""

    __slots__ = ("task", "inbox", "busy", "gone")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.inbox: asyncio.Queue[dict] = asyncio.Queue(_WS_QUEUE)
        self.busy = False
        self.gone = False

    def drain(self) -> None:
        """The gateway is shutting down: end the socket once the answer under way is done
        (an idle socket at once)."""
        with contextlib.suppress(asyncio.QueueFull):
            self.inbox.put_nowait(_DRAIN)

    async def read(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self.gone = True
                if self.busy:
                    self.task.cancel()
                with contextlib.suppress(asyncio.QueueFull):
                    self.inbox.put_nowait(message)
                return
            await self.inbox.put(message)


def _text_of(message: dict) -> bytes:
    text = message.get("text")
    if text is not None:
        return text.encode()
    return message.get("bytes") or b""
