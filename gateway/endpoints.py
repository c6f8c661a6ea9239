"""The OpenAI surface: completions (streamed or not), models, health, metrics.

``CompletionsEndpoint`` is a plain ASGI app (no Request/Response objects on the hot path).
Per request: admission (in-flight limit) -> read the body under its byte limit -> parse the
few fields the gateway needs -> ``answer()``: cache lookup (a hit is replayed; an identical
request in flight is followed) -> routing decision -> open a reply on the target (edge
engine or upstream; fallbacks before the first byte; hedging) -> relay it.

A task watches for the client's disconnect from the moment the body is read; when the client
goes, the request task is cancelled wherever it waits, and the reply is closed in ``finally``
(RST_STREAM / connection close upstream, sequence aborted in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cache import Flight, FlightAborted
from gateway.backends import Reply, ReplayReply
from gateway.caching import BYPASS, HIT, MISS, Lookup, Recorder
from gateway.errors import GatewayError, Overloaded, UpstreamTimeout
from gateway.observability import Timing
from gateway.protocol import CHAT, ClientGone, ParsedRequest, parse_request, read_body
from gateway.relay import DONE, PING, error_event
from gateway.state import State
from routing import RouteDecision, TargetKind

__all__ = [
    "Answer",
    "CompletionsEndpoint",
    "Models",
    "Healthz",
    "Readyz",
    "MetricsEndpoint",
    "answer",
    "header_map",
    "request_id_of",
    "send_error",
]

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


def request_id_of(scope: dict) -> bytes:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _SAFE_ID.match(value):
            return value
    return uuid.uuid4().hex.encode()


def header_map(scope: dict) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


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


# -- the pipeline shared by HTTP and WebSocket ----------------------------------------------


class Answer:
    """A request's reply, with what the response headers say about how it was found."""

    __slots__ = ("reply", "x_cache", "age", "route", "recorder", "flight", "attempts")

    def __init__(self) -> None:
        self.reply: Reply | None = None
        self.x_cache: bytes | None = None
        self.age: int | None = None
        self.route = b""
        self.recorder: Recorder | None = None
        self.flight: Flight | None = None
        self.attempts = 1

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-edgegw-route", self.route)]
        if self.x_cache is not None:
            headers.append((b"x-cache", self.x_cache))
        if self.age is not None:
            headers.append((b"age", str(self.age).encode()))
        return headers

    async def stream(self, dispatcher, series, start: float) -> AsyncIterator[bytes | None]:
        """The reply's events as the client should get them, for every transport (SSE and
        WebSocket): recorded for the cache and its followers, measured (TTFT, inter-token
        gaps, the endpoint's health); ``None`` after a quiet spell. When the backend breaks
        off, the recording is aborted, the failure recorded, and the ``GatewayError`` raised."""
        reply, recorder = self.reply, self.recorder
        events, reply.first = reply.first, None
        chunks = 0
        last = 0.0
        while True:
            if events is None:
                try:
                    events = await reply.next_events()
                except GatewayError:
                    if recorder is not None:
                        await recorder.finish(False)
                    dispatcher.record_end(reply, False, chunks, time.perf_counter() - start)
                    raise
                if events is None:
                    yield None
                    continue
            if not events:
                if recorder is not None:
                    await recorder.finish(True)
                dispatcher.record_end(reply, True, chunks, time.perf_counter() - start)
                return
            now = time.perf_counter()
            if last:
                series.gap.observe(now - last)
            else:
                series.ttft.observe(now - start)
                dispatcher.record_first_token(reply, now - start)
            last = now
            chunks += 1
            yield events if recorder is None else await recorder.feed(events)
            events = None

    async def close(self, exc: BaseException | None = None) -> None:
        if self.reply is not None:
            await self.reply.aclose()
        if self.flight is not None:
            await self.flight.release(exc)


async def answer(
    state: State,
    parsed: ParsedRequest,
    headers: dict[str, str],
    peer: str | None,
    request_id: str,
    timing: Timing,
    forward: list[tuple[bytes, bytes]],
    result: Answer,
) -> Answer:
    """Fill ``result`` with the reply for ``parsed``: from the cache, by following an
    identical request in flight, or from the routed target."""
    dispatcher = state.dispatcher
    layer = state.cache
    ping = state.settings.limits.keepalive_interval_s
    lookup: Lookup | None = None
    if layer.enabled:
        lookup = layer.plan(parsed, headers)
        result.x_cache = BYPASS
        if lookup.plan.lookup:
            entry = await layer.get(lookup)
            if entry is not None:
                timing.mark("cache", "hit")
                result.reply = layer.replay(entry, parsed)
                result.x_cache = HIT
                result.age = int(entry.age(time.time()))
                result.route = _route_header(dispatcher.route(parsed, peer, headers, cache_hit=True))
                return result
            if _only_if_cached(headers):
                raise UpstreamTimeout("not in the cache and Cache-Control says only-if-cached", code="cache_miss")
        if lookup.plan.store:
            result.x_cache = MISS
            flight = await layer.join(lookup.key)
            if flight is not None and not flight.is_leader:
                followed = await _follow(layer.follower(flight, parsed, ping), parsed)
                if followed is not None:
                    timing.mark("cache", "coalesced")
                    result.reply = followed
                    result.route = _route_header(dispatcher.route(parsed, peer, headers, cache_hit=True)) + b"; coalesced=1"
                    return result
            else:
                result.flight = flight
        timing.mark("cache")
    decision = dispatcher.route(parsed, peer, headers)
    timing.mark("route")
    upstream_parsed = parsed
    hide_usage = False
    if lookup is not None and lookup.plan.store and parsed.stream and not parsed.include_usage:
        options = parsed.data.get("stream_options") or {}
        upstream_parsed = parsed.with_fields(stream_options={**options, "include_usage": True})
        hide_usage = True
    cascade = decision.cascade_threshold is not None and decision.target.kind is TargetKind.EDGE and not parsed.stream
    if cascade:
        upstream_parsed = upstream_parsed.with_fields(logprobs=True)
    reply, target, attempts = await dispatcher.open(decision, upstream_parsed, forward, request_id)
    if reply.upstream is not None:
        timing.upstream(reply.pool_wait, attempts, reply.protocol)
    else:
        timing.mark("engine", "prompt rendered and tokenised")
    result.reply = reply
    result.attempts = attempts
    route = _route_header(decision)
    if target is not decision.target:
        route += b"; served-by=" + target.label().encode()
    if cascade and reply.status == 200:
        result.reply, note = await _cascade(state, decision, parsed, reply, forward, request_id)
        route += note
    result.route = route
    if lookup is not None and lookup.plan.store:
        result.recorder = Recorder(layer, lookup, result.flight, parsed.kind, hide_usage)
    return result


async def _follow(follower, parsed: ParsedRequest) -> Reply | None:
    """The followed answer, or None when its leader failed before a byte (go upstream)."""
    try:
        if not parsed.stream:
            return ReplayReply(await follower.read_body(), None, label="coalesced")
        events = None
        while events is None:
            events = await follower.next_events()
        follower.first = events
        return follower
    except FlightAborted:
        await follower.aclose()
        return None


async def _cascade(
    state: State, decision: RouteDecision, parsed: ParsedRequest, reply: Reply, forward, request_id: str
) -> tuple[Reply, bytes]:
    """Confidence-gated cascade: keep the edge's answer when its mean token logprob clears
    the threshold, else escalate to the first central fallback."""
    body = await reply.read_body()
    await reply.aclose()
    data = orjson.loads(body)
    mean = _mean_logprob(data)
    threshold = decision.cascade_threshold
    central = next((t for t in decision.fallbacks if t.kind is TargetKind.ENDPOINT), None)
    if mean is not None and mean < threshold and central is not None:
        escalated = await state.dispatcher.open_target(central, parsed, forward, request_id)
        note = f"; cascaded=1 (edge mean logprob {mean:.2f} < {threshold:g}) served-by={central.label()}"
        return escalated, note.encode()
    if not parsed.data.get("logprobs"):
        for choice in data.get("choices", []):
            choice["logprobs"] = None
        body = orjson.dumps(data)
    note = "" if mean is None else f"; cascade-kept (edge mean logprob {mean:.2f})"
    return ReplayReply(body, None, label="edge"), note.encode()


def _mean_logprob(data: dict) -> float | None:
    values = []
    for choice in data.get("choices", []):
        logprobs = choice.get("logprobs") or {}
        if isinstance(logprobs.get("content"), list):
            values += [t.get("logprob") for t in logprobs["content"] if isinstance(t.get("logprob"), (int, float))]
        elif isinstance(logprobs.get("token_logprobs"), list):
            values += [v for v in logprobs["token_logprobs"] if isinstance(v, (int, float))]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _only_if_cached(headers: dict[str, str]) -> bool:
    return "only-if-cached" in (headers.get("cache-control") or "").lower()


def _route_header(decision: RouteDecision) -> bytes:
    return decision.header_value().encode("ascii", "replace")


# -- HTTP -----------------------------------------------------------------------------------


class CompletionsEndpoint:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""

    def __init__(self, state: State, kind: str) -> None:
        self.state = state
        self.kind = kind
        self.label = "chat" if kind == CHAT else "completions"

    async def __call__(self, scope, receive, send) -> None:
        state = self.state
        metrics = state.metrics
        limits = state.settings.limits
        timing = Timing()
        request_id = request_id_of(scope)
        reply_headers = [(b"x-request-id", request_id)]
        if state.in_flight >= limits.max_in_flight or state.draining:
            reason = "the gateway is shutting down" if state.draining else "the gateway is at its concurrency limit"
            metrics.count(self.label, 503)
            await send_error(send, Overloaded(reason, retry_after=limits.retry_after_s), reply_headers)
            return
        state.in_flight += 1
        metrics.in_flight.inc()
        watch: _Disconnect | None = None
        result = Answer()
        started = False
        status = 500
        model = "-"
        failure: BaseException | None = None
        try:
            body = await read_body(scope, receive, limits.max_body_bytes)
            parsed = parse_request(self.kind, body)
            model = parsed.model
            headers = header_map(scope)
            watch = _Disconnect(receive, asyncio.current_task())
            timing.mark("admit")
            forward = [(b"x-request-id", request_id)]
            for name, value in scope["headers"]:
                if name in _PASS_HEADERS:
                    forward.append((name, value))
            client = scope.get("client")
            await answer(state, parsed, headers, client[0] if client else None, request_id.decode(), timing, forward, result)
            reply = result.reply
            status = reply.status
            series = metrics.series(model, reply.label)
            out_headers = [*_relayable(reply.headers), *reply_headers, *result.headers()]
            if status >= 400 or not parsed.stream:
                data = await reply.read_body()
                recorder = result.recorder
                if recorder is not None:
                    recorder.body = data
                    await recorder.finish(status == 200)
                out_headers.append((b"content-length", str(len(data)).encode()))
                out_headers.append((b"server-timing", timing.header()))
                started = True
                await send({"type": "http.response.start", "status": status, "headers": out_headers})
                watch.finished = True
                await send({"type": "http.response.body", "body": data})
                if status < 400:
                    elapsed = timing.elapsed()
                    series.ttft.observe(elapsed)
                    series.e2e.observe(elapsed)
                    state.dispatcher.record_first_token(reply, elapsed)
                    state.dispatcher.record_end(reply, True, 1, elapsed)
                return
            if not any(name == b"cache-control" for name, _ in out_headers):
                out_headers.append((b"cache-control", b"no-cache"))
            out_headers.append((b"x-accel-buffering", b"no"))
            out_headers.append((b"server-timing", timing.header()))
            started = True
            await send({"type": "http.response.start", "status": status, "headers": out_headers})
            await self._relay_stream(send, result, series, timing.start)
            watch.finished = True
            await send({"type": "http.response.body", "body": b""})
            series.e2e.observe(timing.elapsed())
        except GatewayError as exc:
            status = exc.status
            failure = exc
            if not started:
                await send_error(send, exc, [*reply_headers, *_route(result, exc), (b"server-timing", timing.header())])
        except ClientGone:
            status = 499
        except asyncio.CancelledError as exc:
            failure = exc
            if watch is None or not watch.gone:
                raise
            asyncio.current_task().uncancel()
            status = 499
        except Exception as exc:  # a bug: answer like any other error, keep serving, log it
            failure = exc
            logger.exception("request %s failed", request_id.decode())
            status = 500
            if not started:
                error = GatewayError("the gateway failed to handle this request")
                await send_error(send, error, [*reply_headers, *_route(result, error)])
        finally:
            if watch is not None:
                watch.stop()
                if watch.gone:
                    metrics.client_disconnects.inc()
            await result.close(failure)
            state.in_flight -= 1
            metrics.in_flight.dec()
            metrics.count(self.label, status)
            if state.settings.listen.access_log:
                access_log.info(
                    "%s %s %s model=%s via=%s %.1fms",
                    request_id.decode(),
                    self.label,
                    status,
                    model,
                    result.reply.label if result.reply is not None else "-",
                    timing.elapsed() * 1000,
                )

    async def _relay_stream(self, send, result: Answer, series, start: float) -> None:
        """Relay the reply's events to the client; a backend that breaks off ends the
        stream with an OpenAI error event and ``[DONE]``."""
        reply = result.reply
        message = {"type": "http.response.body", "body": b"", "more_body": True}
        try:
            async with contextlib.aclosing(result.stream(self.state.dispatcher, series, start)) as stream:
                async for events in stream:
                    if events is None:
                        if reply.in_event:
                            continue
                        events = PING
                    message["body"] = events
                    await send(message)
        except GatewayError as exc:
            self.state.metrics.upstream_errors.labels(reply.label, "mid_stream").inc()
            message["body"] = (b"\n\n" if reply.in_event else b"") + error_event(exc) + DONE
            await send(message)


def _route(result: Answer, exc: GatewayError) -> list[tuple[bytes, bytes]]:
    """The route header of a failed request: its decision if one was made, else why not."""
    route = result.route or f"target=none; why={exc.code or exc.type}".encode("ascii", "replace")
    return [(b"x-edgegw-route", route)]


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
