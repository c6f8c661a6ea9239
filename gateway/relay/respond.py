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
from gateway.relay.meter import Meter, measured, note_usage
from gateway.relay.splice import Splice
from gateway.replies import Answer

__all__ = ["KeepAlive", "Stall", "fail_sse", "open_sse", "openai_error", "respond_json", "respond_sse", "respond_websocket"]

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
        b"x-accel-buffering",  # the gateway says its own for a stream
    }
)
_ERROR_EXCERPT = 200  # bytes of an upstream's error body quoted in the message
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


def openai_error(status: int, data: bytes) -> dict:
    """The ``error`` object of an upstream's error answer: its own when it sent an
    OpenAI-shaped one, else one that keeps its status and quotes the start of its body
    (llama.cpp's server answers some requests with an empty body, some with a traceback)."""
    try:
        error = orjson.loads(data).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return {"message": error["message"], "type": error.get("type"), "param": error.get("param"), "code": error.get("code")}
    excerpt = data[:_ERROR_EXCERPT].decode("utf-8", "replace").strip()
    if isinstance(error, str) and error:
        excerpt = error[:_ERROR_EXCERPT]
    message = f"the upstream answered {status}" + (f": {excerpt}" if excerpt else " with no body")
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return {"message": message, "type": kind, "param": None, "code": f"upstream_http_{status}"}


async def respond_json(send, ctx: RequestContext, answer: Answer, series: Series) -> None:
    """A whole answer (non-streaming, or an error status from the backend) in one body; an
    error in whatever shape the backend sent it goes to the client OpenAI-shaped."""
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
            note_usage(ctx, orjson.loads(data))
        except orjson.JSONDecodeError:
            pass
    headers = _headers(ctx, answer)
    if not ok:
        data = orjson.dumps({"error": openai_error(reply.status, data)})
        headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
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
    and ends; the loop's watchdog (``gateway.core.timeouts``) looks for a send under way too long."""

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


_SSE_HEAD = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_PING_MESSAGE = {"type": "http.response.body", "body": PING, "more_body": True}


async def open_sse(send, ctx: RequestContext) -> None:
    """Start a stream's response before its answer is known (its target is slow to send
    headers, or it waits in a queue): 200 and the SSE headers now, so that keep-alives flow
    (``KeepAlive``); the answer, or its error, follows as events (``respond_sse(...,
    started=True)``, ``fail_sse``)."""
    headers = [*_SSE_HEAD, (b"x-request-id", ctx.request_id), *ctx.charge.rate_headers]
    headers.append((b"server-timing", ctx.timing.header()))
    ctx.delivery.status = 200  # before the send: a keep-alive stopped during it has sent the head
    await send({"type": "http.response.start", "status": 200, "headers": headers})


class KeepAlive(Watch):
    """A stream's keep-alive while its answer is not in hand (it waits in a queue, or its
    target holds its headers until its first token): past ``ping`` seconds, the head goes out
    (``open_sse``) and a ``: ping`` every ``ping`` seconds, from a task of its own, so the
    client and the proxies between see a live stream. Nothing is armed on the hot path but a
    watch in the loop's sweep; the task exists only for a stream that waits."""

    __slots__ = ("send", "ctx", "ping", "due", "task", "_dog")

    def __init__(self, send, ctx: RequestContext, ping: float) -> None:
        self.send = send
        self.ctx = ctx
        self.ping = ping
        self.task: asyncio.Task | None = None
        self._dog = watchdog()
        self.due = self._dog.loop.time() + ping
        self._dog.add(self)

    def overdue(self, now: float) -> bool:
        return now >= self.due

    def expire(self) -> None:
        self.task = self._dog.loop.create_task(self._run())

    async def _run(self) -> None:
        await open_sse(self.send, self.ctx)
        while True:
            await asyncio.sleep(self.ping)
            await self.send(_PING_MESSAGE)

    async def stop(self) -> bool:
        """Stop it; True when the stream's head went out (the answer follows as events)."""
        self._dog.discard(self)
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        return self.ctx.delivery.status != 0


async def fail_sse(send, ctx: RequestContext, exc: GatewayError) -> None:
    """End a stream whose response has started with ``exc`` as an OpenAI error event and
    ``[DONE]``."""
    ctx.responded()
    await send({"type": "http.response.body", "body": error_event(exc) + DONE, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def respond_sse(
    send, ctx: RequestContext, answer: Answer, series: Series, writer: BodyWriter | None = None, *, started: bool = False
) -> None:
    """Relay the answer as SSE: headers at once (unless ``open_sse`` sent them already:
    ``started``), then each run of events as it comes, a ``: ping`` comment after each quiet
    spell; a reply that breaks off ends the stream with an OpenAI error event and ``[DONE]``,
    and so does an error answer on a started stream. With a listener's ``writer`` and nothing
    to record for the cache, events go straight from the upstream's callback to the client
    while it keeps up (``Splice``)."""
    reply = answer.reply
    if started:
        if reply.status >= 400:
            error = openai_error(reply.status, await reply.read_body())
            failure = GatewayError(error["message"], param=error["param"], code=error["code"])
            failure.type = error["type"] or "upstream_error"
            answer.failed_mid_stream = failure
            await fail_sse(send, ctx, failure)
            return
    else:
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
        ctx.delivery.status = reply.status
        await send({"type": "websocket.send", "text": ws_error(reply.status, openai_error(reply.status, data))})
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
