"""The one event pipeline for every transport: what is noted of each run of events on its way
to the client.

``measured`` records the answer for the cache and its single-flight followers, observes
TTFT and inter-token gaps, and tells the reply when its first token came and how it ended
(which is how routing's health is fed); ``Meter`` is what it and the splice note per run.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

import orjson

from cache import is_usage_chunk
from gateway.core.context import RequestContext
from gateway.core.errors import GatewayError, UpstreamProtocolError
from gateway.core.sse import DONE, error_event, sse_events, sse_payloads
from gateway.observe import Series
from gateway.replies import Answer

__all__ = ["Meter", "measured", "note_usage", "usage_tokens"]

# a finish_reason that is a string (JSON written with or without spaces), or an error event
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"|data:\s*\{\s*"error"')


class Meter:
    """What is noted of each run of events on its way to the client, whoever carries it
    (the request's task through ``measured``, or a ``Splice`` inside the upstream's
    callback): TTFT and inter-token gaps, the reply's first token, the count, the usage
    chunk read (and taken out when it was asked for on the client's behalf), and whether the
    stream finished: a ``[DONE]`` before any ``finish_reason`` (llama.cpp's server ends a
    generation that way when another request interrupts it) is a stream cut short, and the
    client gets an error event before the ``[DONE]``, never a silent truncation."""

    __slots__ = ("ctx", "answer", "series", "chunks", "events", "finished", "cut", "_last", "_usage", "_gap", "_gaps")

    def __init__(self, ctx: RequestContext, answer: Answer, series: Series) -> None:
        self.ctx = ctx
        self.answer = answer
        self.series = series
        self.chunks = 0
        self.events = 0  # runs of events that carried more than [DONE]
        self.finished = False  # a finish_reason (or an error event) has gone by
        self.cut = False  # the upstream said [DONE] before it finished
        self._last = 0.0
        self._usage = answer.hide_usage or ctx.wants_usage
        self._gap = series.gap.observe
        self._gaps = ctx.delivery.gaps

    def passing(self, events: bytes) -> bytes:
        """A run of events on its way to the client: noted as it arrives, and returned as
        the client gets it (one call per run: this is the splice's per-event work).

        Noted: the first run is the TTFT; after it, a run that carries a generated token
        (not ``[DONE]``, a usage chunk or a finish-only chunk, however the upstream's writes
        were split or merged) is a token and a gap. Returned: the run with the usage chunk
        read (and taken out when it was asked for on the client's behalf), and an error
        event before a ``[DONE]`` that came before any ``finish_reason``."""
        now = time.perf_counter()
        compact = b'"finish_reason":null' in events  # a token chunk of a compact JSON writer
        if not self._last:
            self._first(now)
        elif compact or _carries_token(events):
            gap = now - self._last
            self._gap(gap)
            self._gaps.append(gap)
            self._last = now
            self.chunks += 1
        finished = self.finished
        # a finish_reason that is a string: compact JSON without a regex on the hot path; the
        # spaced forms are looked for only in a run from a writer that is not compact (one
        # server writes one JSON style); an error event from anyone
        if not finished and (
            b'"finish_reason":"' in events
            or (
                (b'"error"' in events or (not compact and (b'"finish_reason" ' in events or b'"finish_reason": ' in events)))
                and _FINISHED.search(events)
            )
        ):
            finished = self.finished = True
        if self._usage and b'"usage"' in events:
            events = _take_usage(self.ctx, events, self.answer.hide_usage)
        if finished or DONE not in events:
            self.events += 1
            return events
        if events.replace(DONE, b"").strip():
            self.events += 1
        self.cut = True
        self.answer.failed_mid_stream = error = _cut(self.events)
        return events.replace(DONE, error_event(error) + DONE, 1)

    def _first(self, now: float) -> None:
        ctx = self.ctx
        ttft = now - ctx.timing.start
        self.series.ttft.observe(ttft)
        self.answer.ttft = ctx.delivery.ttft = ttft
        self.answer.reply.first_token(time.monotonic())
        ctx.timing.mark("first_token")
        self._last = now
        self.chunks += 1


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
            ctx.delivery.tokens = meter.chunks
            ctx.timing.mark("decode" if meter.chunks else "first_token")
            raise
        if events is None:
            yield None
            continue
        if not events:
            if not meter.finished and not meter.cut:  # it ended before its first event, or unfinished
                error = _cut(meter.events)
                if recorder is not None:
                    await recorder.finish(False)
                reply.finish(False, meter.chunks, time.monotonic())
                ctx.delivery.tokens = meter.chunks
                ctx.timing.mark("decode" if meter.chunks else "first_token")
                raise error
            if recorder is not None:
                await recorder.finish(not meter.cut)
            reply.finish(not meter.cut, meter.chunks, time.monotonic())
            ctx.delivery.tokens = meter.chunks
            ctx.timing.mark("decode")
            return
        outgoing = meter.passing(events)  # timed as it arrives
        if recorder is not None:
            await recorder.feed(events)
        yield outgoing


def _cut(events: int) -> UpstreamProtocolError:
    if not events:
        return UpstreamProtocolError("the upstream ended the stream before its first event", code="upstream_empty_stream")
    return UpstreamProtocolError(
        f"the upstream ended the stream without finishing it (no finish_reason after {events} runs of events)",
        code="upstream_stream_cut",
    )


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
            note_usage(ctx, orjson.loads(payload))
            if hide:
                continue
        kept.append(payload)
    return sse_events(kept) if len(kept) < len(payloads) else events


def note_usage(ctx: RequestContext, answer: dict) -> None:
    """Note an answer's (or usage chunk's) ``usage`` in ``ctx.charge``: its total for the
    tenant's token rate, its prompt and completion tokens for the tenant's usage."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        ctx.charge.usage = None
        return
    charge = ctx.charge
    total, prompt, completion = usage.get("total_tokens"), usage.get("prompt_tokens"), usage.get("completion_tokens")
    # ``type(x) is int``: not a bool, a float or a string a server put there
    charge.usage = total if type(total) is int else None
    charge.prompt_used = prompt if type(prompt) is int and prompt >= 0 else None
    charge.completion_used = completion if type(completion) is int and completion >= 0 else None


def usage_tokens(answer: dict) -> int | None:
    """``usage.total_tokens`` of an OpenAI answer or chunk, if it says."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else None
