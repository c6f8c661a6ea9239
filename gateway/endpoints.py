"""The OpenAI surface: ASGI apps that parse a request, run the pipeline and relay the answer.

Admission (request id, limits, body, disconnects) has happened before these run
(``gateway.admission``); framing happens in ``gateway.relay``. Each app is short on purpose:
what it adds is the order of things and the one rule that matters here — a reply that was
opened is closed, whatever happens.

- ``CompletionsApp``: ``POST /v1/chat/completions`` and ``POST /v1/completions``.
- ``WebSocketApp``: ``GET /v1/ws``. The client sends a request body as one JSON text
  message (a chat request when it has ``messages``, a completion when it has ``prompt``);
  the answer streams back as one text message per chunk, then ``{"type":"done"}``; failures
  arrive as ``{"type":"error","status":N,"error":{...}}`` and the socket stays open. Several
  requests may follow on one socket and are answered in order, one at a time; messages sent
  ahead wait in a small queue, and when it is full the socket is not read (backpressure),
  so none is dropped.
- ``ModelsApp``, ``HealthzApp``, ``ReadyzApp``, ``MetricsApp``: the small GETs.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import Gate, RequestContext, request_id_of
from gateway.errors import GatewayError, PayloadTooLarge, send_error
from gateway.fleet import Fleet
from gateway.node import WORKER_SCOPE, Siblings, node_families
from gateway.observability import Metrics
from gateway.pipeline import Answer, Pipeline
from gateway.tenants import Tenant
from gateway.relay import WRITER, respond_json, respond_sse, respond_websocket, ws_error

__all__ = ["CompletionsApp", "HealthzApp", "JSONApp", "MetricsApp", "ModelsApp", "ReadyzApp", "WebSocketApp"]

_JSON = (b"content-type", b"application/json")
_WS_QUEUE = 16  # WebSocket messages read ahead of the one being answered


class CompletionsApp:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` (admission parsed the body)."""

    def __init__(self, pipeline: Pipeline, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        ctx: RequestContext = scope["edgegw"]
        answer = Answer()
        failure: BaseException | None = None
        try:
            parsed = ctx.parsed
            await self.pipeline.answer(ctx, parsed, answer)
            reply = answer.reply
            ctx.via = reply.label
            ctx.target_kind = answer.target_kind
            series = self.metrics.series(parsed.model, reply.label)
            if reply.status >= 400 or not parsed.stream:
                await respond_json(send, ctx, answer, series)
            else:
                await respond_sse(send, ctx, answer, series, scope.get(WRITER))
                failure = answer.failed_mid_stream
        except GatewayError as exc:
            failure = exc
            if ctx.status:
                raise  # the response had started: nothing more can be said to this client
            ctx.status = exc.status
            route = (b"x-edgegw-route", answer.route_of_failure(exc))
            headers = [(b"x-request-id", ctx.request_id), route, (b"server-timing", ctx.timing.header()), *ctx.rate_headers]
            await send_error(send, exc, headers)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await answer.close(ctx, failure)


class WebSocketApp:
    def __init__(self, pipeline: Pipeline, gate: Gate, metrics: Metrics) -> None:
        self.pipeline = pipeline
        self.gate = gate
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        if self.gate.draining:
            await send({"type": "websocket.close", "code": 1013})  # try again later
            return
        try:
            tenant = self.gate.tenants.identify(scope["headers"])
        except GatewayError:
            await send({"type": "websocket.close", "code": 1008})  # policy violation: no (known) key
            return
        await send({"type": "websocket.accept"})
        socket = _Socket(asyncio.current_task())
        reader = asyncio.get_running_loop().create_task(socket.read(receive))
        socket_id = request_id_of(scope["headers"])
        try:
            for number in range(1, 1 << 62):
                message = await socket.inbox.get()
                if socket.gone:
                    return  # nobody to answer what is still queued
                request_id = socket_id if number == 1 else socket_id + b"." + str(number).encode()
                if await self._serve_one(scope, send, socket, tenant, request_id, _text_of(message)):
                    return
        finally:
            reader.cancel()

    async def _serve_one(self, scope, send, socket: _Socket, tenant: Tenant, request_id: bytes, body: bytes) -> bool:
        """Answer one message; True when the client left meanwhile."""
        gate = self.gate
        ctx = RequestContext(scope, request_id, "ws")
        ctx.tenant = tenant
        if gate.tracing is not None:
            gate.tracing.begin(ctx)
        answer = Answer()
        failure: BaseException | None = None
        socket.busy = True
        try:
            limit = gate.settings.limits.max_body_bytes
            if len(body) > limit:
                raise PayloadTooLarge(f"request of {len(body)} bytes exceeds the limit of {limit} bytes")
            ctx.body = body
            parsed = await gate.admit(ctx, None, [(b"accept", b"text/event-stream")])
            if not parsed.stream:
                parsed = parsed.with_fields(stream=True)
            ctx.timing.mark("admit")
            await self.pipeline.answer(ctx, parsed, answer)
            ctx.via = answer.reply.label
            ctx.target_kind = answer.target_kind
            await respond_websocket(send, ctx, answer, self.metrics.series(parsed.model, answer.reply.label))
        except GatewayError as exc:
            failure = exc
            ctx.status = exc.status
            error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
            await send({"type": "websocket.send", "text": ws_error(exc.status, error)})
        except asyncio.CancelledError as exc:
            failure = exc
            if not socket.gone:
                raise
            asyncio.current_task().uncancel()
            ctx.gone = True
            ctx.status = 499
        finally:
            socket.busy = False
            await answer.close(ctx, failure)
            gate.done(ctx)
        return ctx.gone


class _Socket:
    """A WebSocket's reader: messages into ``inbox`` (waiting while it is full, so the
    socket is not read: backpressure); when the client leaves, the message being answered
    is cancelled."""

    __slots__ = ("task", "inbox", "busy", "gone")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.inbox: asyncio.Queue[dict] = asyncio.Queue(_WS_QUEUE)
        self.busy = False
        self.gone = False

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


# -- the small GETs ------------------------------------------------------------------------


async def _send_json(send, status: int, payload: object, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ModelsApp:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def __call__(self, scope, receive, send) -> None:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": c} for m, c in self.fleet.models()]
        await _send_json(send, 200, {"object": "list", "data": data}, [(b"x-request-id", request_id_of(scope["headers"]))])


class HealthzApp:
    async def __call__(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"status": "ok"})


class ReadyzApp:
    """200 when the gateway can serve something; 503 while starting, draining or shedding
    for capacity, so a load balancer steers away."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway  # gateway.app.Gateway

    async def __call__(self, scope, receive, send) -> None:
        gateway = self.gateway
        if gateway.gate.draining:
            await _send_json(send, 503, {"status": "draining"})
        elif gateway.gate.shedding:
            await _send_json(send, 503, {"status": "shedding"})
        elif gateway.started and gateway.fleet.is_ready():
            await _send_json(send, 200, {"status": "ready"})
        else:
            await _send_json(send, 503, {"status": "not ready"})


class JSONApp:
    """A small GET answering what ``read()`` returns, as JSON."""

    def __init__(self, read) -> None:
        self.read = read

    async def __call__(self, scope, receive, send) -> None:
        await _send_json(send, 200, self.read())


class MetricsApp:
    """``GET /metrics``: this process's metrics or, on a node of workers (``siblings``), the
    node's (``gateway.node.node_families``)."""

    def __init__(self, metrics: Metrics, siblings: Siblings | None = None) -> None:
        self.metrics = metrics
        self.siblings = siblings

    async def __call__(self, scope, receive, send) -> None:
        body = generate_latest(self.metrics.registry)
        if self.siblings is not None and WORKER_SCOPE not in scope["headers"]:
            body = generate_latest(_Families(await node_families(self.siblings, body.decode())))
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _Families:
    """Metric families already collected, as ``generate_latest`` reads a registry."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return self._families
