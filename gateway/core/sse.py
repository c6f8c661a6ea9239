"""SSE and WebSocket framing, and the reader that cuts an upstream's SSE bytes into events.

The lowest piece of the relay, used by everything that produces or consumes events (the
replies, the engine's process client, the cache layer, the dashboard, the writers):

- ``sse_event`` / ``sse_events`` build ``data:`` events, ``sse_payloads`` takes them apart,
  ``PING`` is the keep-alive comment, ``DONE`` the OpenAI terminator and ``error_event`` an
  OpenAI-shaped error inside a stream; ``ws_error`` the same error as a WebSocket message.
- ``EventReader`` cuts an upstream's SSE bytes at event boundaries (so that a keep-alive
  comment or an error event is never spliced into the middle of an event), hands back each
  run of complete events exactly as received, and reports idleness so the caller can send a
  ``: ping`` comment. The body underneath is a bounded buffer (``gateway.upstream.body.Body``):
  while the relay waits on the client, nothing more is read from the upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import orjson

from gateway.core.errors import GatewayError, UpstreamProtocolError, UpstreamReadTimeout

__all__ = ["DONE", "PING", "EventReader", "error_event", "sse_event", "sse_events", "sse_payloads", "ws_error"]

PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"


class _Body(Protocol):
    """What ``EventReader`` reads: ``gateway.upstream.body.Body``."""

    async def read(self, timeout: float) -> bytes | None: ...

    def hand_over(self, on_data: Callable[[bytes], None] | None) -> bool: ...

    def feed_error(self, exc: BaseException) -> None: ...


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

    def __init__(self, body: _Body, ping_interval: float, read_timeout: float, max_event: int) -> None:
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
        elif data.endswith(b"\n\n"):  # whole events, the usual read: no end can lie past this one
            return data
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
