"""Moving an answer from its ``Reply`` to the client: all SSE and WebSocket framing lives here.

- Framing: ``sse_event`` / ``sse_events`` build ``data:`` events, ``sse_payloads`` takes them
  apart, ``PING`` is the keep-alive comment, ``DONE`` the OpenAI terminator and
  ``error_event`` an OpenAI-shaped error inside a stream.
- ``EventReader`` cuts an upstream's SSE bytes at event boundaries (so that a keep-alive
  comment or an error event is never spliced into the middle of an event), hands back each
  run of complete events exactly as received, and reports idleness so the caller can send a
  ``: ping`` comment. The body underneath is a bounded buffer (``gateway.upstream.base.Body``):
  while the relay waits on the client, nothing more is read from the upstream.
- ``measured`` is the one event pipeline for every transport: it records the answer for the
  cache and its single-flight followers, observes TTFT and inter-token gaps, and tells the
  reply when its first token came and how it ended (which is how routing's health is fed).
- ``respond_json``, ``respond_sse`` and ``respond_websocket`` write an answer to an HTTP
  or WebSocket client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

import orjson

from cache import is_usage_chunk
from gateway.errors import GatewayError, Overloaded, UpstreamProtocolError, UpstreamReadTimeout
from gateway.upstream.base import Body
from gateway.timeouts import Watch, watchdog

if TYPE_CHECKING:  # annotations only: the pipeline imports this module
    from gateway.admission import RequestContext
    from gateway.observability import Series
    from gateway.pipeline import Answer
    from gateway.replies import Reply

__all__ = [
    "DONE",
    "PING",
    "WRITER",
    "BodyWriter",
    "EventReader",
    "Meter",
    "Splice",
    "error_event",
    "measured",
    "respond_json",
    "respond_sse",
    "respond_websocket",
    "sse_event",
    "sse_events",
    "Stall",
    "sse_payloads",
    "usage_tokens",
    "ws_error",
]

PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"

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


# -- framing ----------------------------------------------------------------------------


def sse_event(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (a JSON chunk, or ``[DONE]``)."""
    return b"data: " + payload + b"\n\n"


def sse_events(payloads: list[bytes]) -> bytes:
    return b"".join([b"data: " + p + b"\n\n" for p in payloads])


def sse_payloads(events: bytes) -> list[bytes]:
    """The ``data`` payload of each event in a run of complete events (comments dropped)."""
    payloads = []
    for event in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(lines))
    return payloads


def error_event(exc: GatewayError) -> bytes:
    """An OpenAI-shaped error as an SSE event (what OpenAI clients raise on mid-stream)."""
    return sse_event(exc.body())


def ws_error(status: int, error: dict | None) -> str:
    return orjson.dumps({"type": "error", "status": status, "error": error}).decode()


class EventReader:
    __slots__ = ("_body", "_ping", "_timeout", "_max_event", "_tail", "_idle", "_on_events")

    def __init__(self, body: Body, ping_interval: float, read_timeout: float, max_event: int) -> None:
        self._body = body
        self._ping = min(ping_interval, read_timeout)
        self._timeout = read_timeout
        self._max_event = max_event
        self._tail = b""
        self._idle = 0.0
        self._on_events: Callable[[bytes], None] | None = None

    @property
    def in_event(self) -> bool:
        """Part of an event has been received but not yet its end."""
        return bool(self._tail)

    async def next(self) -> bytes | None:
        """Complete events (as received), ``b""`` at the end of the stream, or ``None`` after
        ``ping_interval`` seconds of silence. Raises a ``GatewayError`` when the upstream breaks
        off or stays silent past its read timeout."""
        while True:
            data = await self._body.read(self._ping)
            if data is None:
                self._idle += self._ping
                if self._idle >= self._timeout:
                    raise UpstreamReadTimeout(f"the upstream sent nothing for {self._timeout:g} s")
                return None
            self._idle = 0.0
            if not data:
                tail, self._tail = self._tail, b""
                return tail  # an unterminated last event is passed on as it came (b"" when none)
            events = self._cut(data)
            if events:
                return events

    def hand_over(self, on_events: Callable[[bytes], None] | None) -> bool:
        """Give each run of complete events to ``on_events`` as it arrives, from the body's
        producer (``Body.hand_over``); ``next`` then returns only at the end, on an error,
        after a quiet spell, or once ``on_events`` gives the stream back (``None``)."""
        if not self._body.hand_over(None if on_events is None else self._arrived):
            return False
        self._on_events = on_events
        return True

    def _arrived(self, data: bytes) -> None:
        self._idle = 0.0
        try:
            events = self._cut(data)
        except GatewayError as exc:
            self._body.hand_over(None)
            self._body.feed_error(exc)
            return
        if events:
            self._on_events(events)  # type: ignore[misc]

    def _cut(self, data: bytes) -> bytes:
        """The complete events of what has arrived so far; the rest is kept as the tail."""
        if self._tail:
            data = self._tail + data
        cut = data.rfind(b"\n\n")
        end = cut + 2 if cut >= 0 else -1
        if b"\r" in data:
            cut = data.rfind(b"\r\n\r\n")
            if cut >= 0:
                end = max(end, cut + 4)
        if end < 0:
            if len(data) > self._max_event:
                raise UpstreamProtocolError(f"an upstream event exceeds {self._max_event} bytes")
            self._tail = data
            return b""
        if end == len(data):
            self._tail = b""
            return data
        self._tail = data[end:]
        return data[:end]


# -- the event pipeline -------------------------------------------------------------------


class Meter:
    """What is noted of each run of events on its way to the client, whoever carries it
    (the request's task through ``measured``, or a ``Splice`` inside the upstream's
    callback): TTFT and inter-token gaps, the reply's first token, the count, and the usage
    chunk read (and taken out when it was asked for on the client's behalf)."""

    __slots__ = ("ctx", "answer", "series", "chunks", "_last", "_usage")

    def __init__(self, ctx: RequestContext, answer: Answer, series: Series) -> None:
        self.ctx = ctx
        self.answer = answer
        self.series = series
        self.chunks = 0
        self._last = 0.0
        self._usage = answer.hide_usage or ctx.wants_usage

    def note(self, events: bytes) -> None:
        """A run of events is on its way: the first is the TTFT; after it, a run that
        carries a generated token (not ``[DONE]``, a usage chunk or a finish-only chunk,
        however the upstream's writes were split or merged) is a token and a gap."""
        now = time.perf_counter()
        if self._last:
            if b'"finish_reason":null' not in events and not _carries_token(events):
                return
            gap = now - self._last
            self.series.gap.observe(gap)
            self.ctx.gaps.append(gap)
        else:
            ctx = self.ctx
            ttft = now - ctx.timing.start
            self.series.ttft.observe(ttft)
            self.answer.ttft = ctx.ttft = ttft
            self.answer.reply.first_token(time.monotonic())
            ctx.timing.mark("first_token")
        self._last = now
        self.chunks += 1

    def usage(self, events: bytes) -> bytes:
        if self._usage and b'"usage"' in events:
            return _take_usage(self.ctx, events, self.answer.hide_usage)
        return events


async def measured(
    ctx: RequestContext, answer: Answer, series: Series, meter: Meter | None = None
) -> AsyncIterator[bytes | None]:
    """The answer's events as the client should get them, for every transport: recorded for
    the cache and its followers, noted by ``meter`` (``Meter``), and reported to the reply
    (its end); ``None`` after a quiet spell. When the reply breaks off, the recording is
    aborted, the failure reported, and the ``GatewayError`` raised."""
    reply, recorder = answer.reply, answer.recorder
    meter = meter or Meter(ctx, answer, series)
    while True:
        try:
            events = await reply.next_events()
        except GatewayError:
            if recorder is not None:
                await recorder.finish(False)
            reply.finish(False, meter.chunks, time.monotonic())
            ctx.tokens = meter.chunks
            ctx.timing.mark("decode" if meter.chunks else "first_token")
            raise
        if events is None:
            yield None
            continue
        if not events:
            if recorder is not None:
                await recorder.finish(True)
            reply.finish(True, meter.chunks, time.monotonic())
            ctx.tokens = meter.chunks
            ctx.timing.mark("decode")
            return
        meter.note(events)
        if recorder is not None:
            await recorder.feed(events)
        yield meter.usage(events)


_SPLICE_BYTES = 64 * 1024  # a splice writes at once what it holds past this


class Splice:
    """Events written to the client from the upstream connection's callbacks as they
    arrive: no wake-up of the request's task, no ASGI message per event (the HTTP/1.1
    listener's ``BodyWriter``; the reply's ``hand_over``). What one read of the upstream
    brings (an HTTP/1.1 read holds as many chunks as were sent, each a callback) is written
    once, at the end of that loop turn (``flush``), or at once past 64 KiB.

    It lasts while the client keeps up: when a write leaves the client's socket over its
    high-water mark the splice gives the stream back, arrivals are kept in the bounded body
    again (so the upstream is paused as before) and the task relays them through ``send``
    (which waits for the client, and ``Stall`` times it); once the task has caught up it
    starts the splice again. The task still wakes for a quiet spell (``: ping``), the end
    and a failure, and flushes the splice before it writes anything itself."""

    __slots__ = ("reply", "meter", "writer", "on", "_pending", "_size", "_loop")

    def __init__(self, reply: Reply, meter: Meter, writer: BodyWriter) -> None:
        self.reply = reply
        self.meter = meter
        self.writer = writer
        self.on = False
        self._pending: list[bytes] = []
        self._size = 0
        self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        if not self.on and self.writer.writable:
            self.on = self.reply.hand_over(self._events)

    def stop(self) -> None:
        self.flush()
        if self.on:
            self.on = False
            self.reply.hand_over(None)

    def flush(self) -> None:
        """Write what has arrived since the last flush; give the stream back to the task
        when the client is behind."""
        pending = self._pending
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            self._size = 0
            if not self.writer.write(data) and self.on:
                self.on = False
                self.reply.hand_over(None)

    def _events(self, events: bytes) -> None:
        meter = self.meter
        meter.note(events)  # timed as it arrives
        events = meter.usage(events)
        if events:
            if not self._pending:
                self._loop.call_soon(self.flush)
            self._pending.append(events)
            self._size += len(events)
            if self._size >= _SPLICE_BYTES:  # one loop turn may read many times: bounded here
                self.flush()


class BodyWriter(Protocol):
    """What a listener offers for ``Splice`` (``scope[WRITER]``): the next piece of a
    response body whose head went through ``send``, written now."""

    @property
    def writable(self) -> bool:
        """The client is there and its socket below its high-water mark."""

    def write(self, data: bytes) -> bool:
        """Write ``data`` (not empty); False when the client now accepts no more for the
        moment (or has gone)."""


# The scope key of a listener that offers a ``BodyWriter`` (gateway.ingress.http1).
WRITER = "edgegw.writer"


def _carries_token(events: bytes) -> bool:
    """Whether a run of events holds a generated token: anything but ``[DONE]``, a usage
    chunk (no choices) or a final chunk with an empty delta or text."""
    for payload in sse_payloads(events):
        if payload == b"[DONE]" or b'"choices":[]' in payload:
            continue
        if b'"finish_reason":"' in payload and (b'"delta":{}' in payload or b'"text":""' in payload):
            continue
        return True
    return False


def _take_usage(ctx: RequestContext, events: bytes, hide: bool) -> bytes:
    """Read the usage chunk's total tokens into ``ctx``; without it when ``hide``."""
    payloads = sse_payloads(events)
    kept = []
    for payload in payloads:
        if payload != b"[DONE]" and is_usage_chunk(payload):
            ctx.usage_tokens = usage_tokens(orjson.loads(payload))
            if hide:
                continue
        kept.append(payload)
    return sse_events(kept) if len(kept) < len(payloads) else events


def usage_tokens(answer: dict) -> int | None:
    """``usage.total_tokens`` of an OpenAI answer or chunk, if it says."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else None


# -- writers ------------------------------------------------------------------------------


def _headers(ctx: RequestContext, answer: Answer) -> list[tuple[bytes, bytes]]:
    reply = answer.reply
    headers = [(k, v) for k, v in reply.headers if k not in _DROP_RESPONSE_HEADERS]
    if ctx.rate_headers:  # the tenant's limits here replace whatever the upstream counted
        headers = [(k, v) for k, v in headers if not k.startswith(b"x-ratelimit-")] + ctx.rate_headers
    headers.append((b"x-request-id", ctx.request_id))
    headers += answer.headers()
    return headers


async def respond_json(send, ctx: RequestContext, answer: Answer, series: Series) -> None:
    """A whole answer (non-streaming, or an error status from the backend) in one body."""
    reply = answer.reply
    data = await reply.read_body()
    ctx.timing.mark("decode", "answer body")
    ctx.tokens = 1
    ok = reply.status < 400
    if answer.recorder is not None:
        answer.recorder.body = data
        await answer.recorder.finish(ok)
    if ok and ctx.wants_usage:
        try:
            ctx.usage_tokens = usage_tokens(orjson.loads(data))
        except orjson.JSONDecodeError:
            pass
    headers = _headers(ctx, answer)
    headers.append((b"content-length", str(len(data)).encode()))
    headers.append((b"server-timing", ctx.timing.header()))
    ctx.status = reply.status
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
        self.ctx.gone = True  # for all purposes: nobody is reading
        self.ctx.stalled = True
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
    ctx.status = reply.status
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
        if ctx.gone:
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
        ctx.status = reply.status
        await send({"type": "websocket.send", "text": ws_error(reply.status, error)})
        return
    ctx.status = reply.status
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
