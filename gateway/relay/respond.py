"""Writing an answer to its client: ``respond_json``, ``respond_sse`` (with the splice on the
HTTP/1.1 listener) and ``respond_websocket``; ``Stall`` ends an answer whose client
accepts nothing for ``limits.send_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson

from gateway.core.context import BodyWriter, RequestContext
from gateway.core.errors import GatewayError, Overloaded
from gateway.core.sse import DONE, PING, error_event, sse_payloads, ws_error
from gateway.core.timeouts import Watch, watchdog
from gateway.observe import Series
from gateway.relay.meter import Meter, measured, usage_tokens
from gateway.relay.splice import Splice
from gateway.replies import Answer

__all__ = ["Stall", "respond_json", "respond_sse", "respond_websocket"]

_DROP_RESPONSE_HEADERS = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"date",
        b"server",
        b"server-timing",
        b"x-request-id",
        b"x-edgegw-route",  # an edgegw behind this one: the answer says this gateway's route and cache
        b"x-cache",
    }
)
_WS_DONE = '{"type":"done"}'
_STOPPED = Overloaded("the gateway stopped this stream: it is shutting down and the drain time ran out", code="shutting_down")


def _headers(ctx: RequestContext, answer: Answer) -> list[tuple[bytes, bytes]]:
    reply = answer.reply
    headers = [(k, v) for k, v in reply.headers if k not in _DROP_RESPONSE_HEADERS]
    if ctx.charge.rate_headers:  # the tenant's limits here replace whatever the upstream counted
        headers = [(k, v) for k, v in headers if not k.startswith(b"x-ratelimit-")] + ctx.charge.rate_headers
    headers.append((b"x-request-id", ctx.request_id))
    headers += answer.headers()
    return headers


async def respond_json(send, ctx: RequestContext, answer: Answer, series: Series) -> None:
    """A whole answer (non-streaming, or an error status from the backend) in one body."""
    reply = answer.reply
    data = await reply.read_body()
    ctx.timing.mark("decode", "answer body")
    ctx.delivery.tokens = 1
    ok = reply.status < 400
    if answer.recorder is not None:
        answer.recorder.body = data
        await answer.recorder.finish(ok)
    if ok and ctx.wants_usage:
        try:
            ctx.charge.usage = usage_tokens(orjson.loads(data))
        except orjson.JSONDecodeError:
            pass
    headers = _headers(ctx, answer)
    headers.append((b"content-length", str(len(data)).encode()))
    headers.append((b"server-timing", ctx.timing.header()))
    ctx.delivery.status = reply.status
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    ctx.responded()
    stall = Stall(ctx, ctx.send_timeout)
    try:
        await stall.send(send, {"type": "http.response.body", "body": data})
    finally:
        stall.stop()
    if ok:
        elapsed = ctx.timing.elapsed()
        series.e2e.observe(elapsed)
        # a JSON answer's first byte is its last: its time is an end-to-end figure, not a TTFT
        reply.finish(True, 1, time.monotonic())


class Stall(Watch):
    """Ends an answer whose client has accepted nothing for ``timeout`` seconds (nginx's
    ``send_timeout``): the request task is cancelled as if the client had left, which closes
    the reply and cancels the upstream request. The hot path only notes when a send starts
    and ends; the loop's watchdog (``gateway.timeouts``) looks for a send under way too long."""

    __slots__ = ("ctx", "task", "timeout", "sending", "_loop", "_dog")

    def __init__(self, ctx: RequestContext, timeout: float) -> None:
        self.ctx = ctx
        self.task = asyncio.current_task()
        self.timeout = timeout
        self.sending = 0.0  # loop.time() when the send under way began; 0: none
        self._dog = watchdog()
        self._loop = self._dog.loop
        self._dog.add(self)

    def overdue(self, now: float) -> bool:
        return bool(self.sending) and now - self.sending >= self.timeout

    def expire(self) -> None:
        self.ctx.delivery.gone = True  # for all purposes: nobody is reading
        self.ctx.delivery.stalled = True
        self.task.cancel()

    async def send(self, send, message: dict) -> None:
        self.sending = self._loop.time()
        await send(message)
        self.sending = 0.0

    def stop(self) -> None:
        self._dog.discard(self)


async def respond_sse(send, ctx: RequestContext, answer: Answer, series: Series, writer: BodyWriter | None = None) -> None:
    """Relay the answer as SSE: headers at once, then each run of events as it comes, a
    ``: ping`` comment after each quiet spell; a reply that breaks off ends the stream with
    an OpenAI error event and ``[DONE]``. With a listener's ``writer`` and nothing to record
    for the cache, events go straight from the upstream's callback to the client while it
    keeps up (``Splice``)."""
    reply = answer.reply
    headers = _headers(ctx, answer)
    if not any(name == b"cache-control" for name, _ in headers):
        headers.append((b"cache-control", b"no-cache"))
    headers.append((b"x-accel-buffering", b"no"))
    headers.append((b"server-timing", ctx.timing.header()))
    ctx.delivery.status = reply.status
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    message = {"type": "http.response.body", "body": b"", "more_body": True}
    meter = Meter(ctx, answer, series)
    splice = Splice(reply, meter, writer) if writer is not None and answer.recorder is None else None
    stall = Stall(ctx, ctx.send_timeout)
    try:
        async with contextlib.aclosing(measured(ctx, answer, series, meter)) as stream:
            if splice is not None:
                splice.start()
            async for events in stream:
                if events is None:
                    if reply.in_event:
                        continue
                    events = PING
                if splice is not None:
                    splice.flush()  # what it holds goes first
                if events:
                    message["body"] = events
                    await stall.send(send, message)
                if splice is not None:
                    splice.start()  # caught up (or never behind): straight through again
    except GatewayError as exc:
        if splice is not None:
            splice.stop()
        answer.failed_mid_stream = exc
        message["body"] = (b"\n\n" if reply.in_event else b"") + error_event(exc) + DONE
        await send(message)
    except asyncio.CancelledError:
        if ctx.delivery.gone:
            raise
        # stopped from outside with the client still there (the drain timeout ran out): end
        # the stream the way any failure after the first byte ends, then stop
        if splice is not None:
            splice.stop()
        message["body"] = (b"\n\n" if reply.in_event else b"") + error_event(_STOPPED) + DONE
        await send(message)
        ctx.responded()
        await send({"type": "http.response.body", "body": b""})
        raise
    finally:
        stall.stop()
        if splice is not None:
            splice.stop()
    ctx.responded()
    await send({"type": "http.response.body", "body": b""})
    series.e2e.observe(ctx.timing.elapsed())


async def respond_websocket(send, ctx: RequestContext, answer: Answer, series: Series) -> None:
    """The answer over a WebSocket: one text message per chunk (the chunk JSON exactly as
    the backend produced it), then ``{"type":"done"}``; a failure is an error message."""
    reply = answer.reply
    if reply.status >= 400:
        data = await reply.read_body()
        try:
            error = orjson.loads(data).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            error = None
        ctx.delivery.status = reply.status
        await send({"type": "websocket.send", "text": ws_error(reply.status, error)})
        return
    ctx.delivery.status = reply.status
    message = {"type": "websocket.send", "text": ""}
    stall = Stall(ctx, ctx.send_timeout)
    try:
        async with contextlib.aclosing(measured(ctx, answer, series)) as stream:
            async for events in stream:
                for payload in sse_payloads(events) if events else ():
                    if payload != b"[DONE]":
                        message["text"] = payload.decode()
                        await stall.send(send, message)
    finally:
        stall.stop()
    series.e2e.observe(ctx.timing.elapsed())
    await send({"type": "websocket.send", "text": _WS_DONE})
