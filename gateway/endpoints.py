"""The OpenAI surface: completions relayed (streamed or not), models, health, metrics.

``CompletionsEndpoint`` is a plain ASGI app (no Request/Response objects on the hot path).
Per request: admission (in-flight limit) -> read the body under its byte limit -> parse the
few fields the gateway needs -> pick the cluster -> open an upstream response (failover
before the first byte) -> relay it. A task watches for the client's disconnect from the
moment the body is read; when the client goes, the request task is cancelled wherever it
waits, and the upstream response is closed (RST_STREAM / connection close) in ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import GatewayError, Overloaded
from gateway.observability import Timing
from gateway.protocol import CHAT, ClientGone, parse_request, read_body
from gateway.relay import DONE, PING, EventReader, error_event
from gateway.state import State

__all__ = ["CompletionsEndpoint", "Models", "Healthz", "Readyz", "MetricsEndpoint", "request_id_of", "send_error"]

logger = logging.getLogger("edgegw")
access_log = logging.getLogger("edgegw.access")

_SAFE_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
_JSON = (b"content-type", b"application/json")
_PASS_HEADERS = {b"accept", b"traceparent", b"tracestate", b"content-type"}
_DROP_RESPONSE_HEADERS = {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"date",
    b"server",
    b"server-timing",
    b"x-request-id",
}
_PATHS = {CHAT: b"/v1/chat/completions", "completion": b"/v1/completions"}


def request_id_of(scope: dict) -> bytes:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _SAFE_ID.match(value):
            return value
    return uuid.uuid4().hex.encode()


async def send_error(send, exc: GatewayError, headers: list[tuple[bytes, bytes]]) -> None:
    body = exc.body()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers, *exc.headers()],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _Disconnect:
    """Watches ``receive`` for the client leaving and cancels the request task when it does."""

    __slots__ = ("gone", "finished", "task", "_watcher")

    def __init__(self, receive, task: asyncio.Task) -> None:
        self.gone = False
        self.finished = False
        self.task = task
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finished:
                    self.gone = True
                    self.task.cancel()
                return

    def stop(self) -> None:
        self.finished = True
        self._watcher.cancel()


class CompletionsEndpoint:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""

    def __init__(self, state: State, kind: str) -> None:
        self.state = state
        self.kind = kind
        self.path = _PATHS[kind]
        self.label = "chat" if kind == CHAT else "completions"

    async def __call__(self, scope, receive, send) -> None:
        state = self.state
        metrics = state.metrics
        limits = state.settings.limits
        timing = Timing()
        request_id = request_id_of(scope)
        reply_headers = [(b"x-request-id", request_id)]
        if state.in_flight >= limits.max_in_flight or state.draining:
            exc = Overloaded("the gateway is at its concurrency limit", retry_after=limits.retry_after_s)
            if state.draining:
                exc = Overloaded("the gateway is shutting down", retry_after=limits.retry_after_s)
            metrics.requests.labels(self.label, "503").inc()
            await send_error(send, exc, reply_headers)
            return
        state.in_flight += 1
        metrics.in_flight.inc()
        watch: _Disconnect | None = None
        response = None
        started = False
        status = 500
        model = upstream_url = "-"
        try:
            body = await read_body(scope, receive, limits.max_body_bytes)
            parsed = parse_request(self.kind, body)
            model = parsed.model
            cluster = state.dispatcher.cluster_for(model)
            watch = _Disconnect(receive, asyncio.current_task())
            timing.mark("admit")
            forward = [(b"x-request-id", request_id)]
            for name, value in scope["headers"]:
                if name in _PASS_HEADERS:
                    forward.append((name, value))
            response, upstream, attempts = await state.dispatcher.open(cluster, self.path, forward, parsed.body)
            upstream_url = upstream.url
            timing.upstream(response.pool_wait, attempts)
            series = metrics.series(model, upstream_url)
            status = response.status
            headers = [*_relayable(response.headers), *reply_headers]
            if status >= 400 or not parsed.stream:
                data = await response.body.read_all(upstream.timeouts.read, limits.max_response_bytes)
                headers.append((b"content-length", str(len(data)).encode()))
                headers.append((b"server-timing", timing.header()))
                started = True
                await send({"type": "http.response.start", "status": status, "headers": headers})
                watch.finished = True
                await send({"type": "http.response.body", "body": data})
                elapsed = timing.elapsed()
                if status < 400:
                    series.ttft.observe(elapsed)
                    series.e2e.observe(elapsed)
                return
            if response.header(b"cache-control") is None:
                headers.append((b"cache-control", b"no-cache"))
            headers.append((b"x-accel-buffering", b"no"))
            headers.append((b"server-timing", timing.header()))
            started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await self._relay_stream(send, response, upstream, series, timing.start)
            watch.finished = True
            await send({"type": "http.response.body", "body": b""})
            series.e2e.observe(timing.elapsed())
        except GatewayError as exc:
            status = exc.status
            if not started:
                await send_error(send, exc, [*reply_headers, (b"server-timing", timing.header())])
        except ClientGone:
            status = 499
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            asyncio.current_task().uncancel()
            status = 499
        finally:
            if watch is not None:
                watch.stop()
                if watch.gone:
                    metrics.client_disconnects.inc()
            if response is not None:
                response.close()
            state.in_flight -= 1
            metrics.in_flight.dec()
            metrics.requests.labels(self.label, str(status)).inc()
            if state.settings.listen.access_log:
                access_log.info(
                    "%s %s %s model=%s upstream=%s %.1fms",
                    request_id.decode(),
                    self.label,
                    status,
                    model,
                    upstream_url,
                    timing.elapsed() * 1000,
                )

    async def _relay_stream(self, send, response, upstream, series, start: float) -> None:
        limits = self.state.settings.limits
        reader = EventReader(response.body, limits.keepalive_interval_s, upstream.timeouts.read, limits.max_event_bytes)
        last = 0.0
        message = {"type": "http.response.body", "body": b"", "more_body": True}
        while True:
            try:
                events = await reader.next()
            except GatewayError as exc:
                self.state.metrics.upstream_errors.labels(upstream.url, "mid_stream").inc()
                message["body"] = (b"\n\n" if reader.in_event else b"") + error_event(exc) + DONE
                await send(message)
                return
            if events is None:
                if not reader.in_event:
                    message["body"] = PING
                    await send(message)
                continue
            if not events:
                return
            now = time.perf_counter()
            if last:
                series.gap.observe(now - last)
            else:
                series.ttft.observe(now - start)
            last = now
            message["body"] = events
            await send(message)


def _relayable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k not in _DROP_RESPONSE_HEADERS]


# -- the small endpoints -----------------------------------------------------------------


async def _send_json(send, status: int, payload: object, headers: list[tuple[bytes, bytes]]) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _StateEndpoint:
    """A small GET endpoint over the gateway state (an ASGI app, as Starlette routes want)."""

    def __init__(self, state: State) -> None:
        self.state = state


class Models(_StateEndpoint):
    async def __call__(self, scope, receive, send) -> None:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": c} for m, c in self.state.dispatcher.models()]
        await _send_json(send, 200, {"object": "list", "data": data}, [(b"x-request-id", request_id_of(scope))])


class Healthz(_StateEndpoint):
    async def __call__(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"status": "ok"}, [])


class Readyz(_StateEndpoint):
    async def __call__(self, scope, receive, send) -> None:
        state = self.state
        if state.draining:
            status, payload = 503, {"status": "draining"}
        elif state.started and state.dispatcher.is_ready():
            status, payload = 200, {"status": "ready"}
        else:
            status, payload = 503, {"status": "not ready"}
        await _send_json(send, status, payload, [])


class MetricsEndpoint(_StateEndpoint):
    async def __call__(self, scope, receive, send) -> None:
        body = generate_latest(self.state.metrics.registry)
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
