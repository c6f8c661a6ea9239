"""Moving a streamed answer from a backend to the client, event by event.

``EventReader`` cuts the upstream's SSE bytes at event boundaries (so that a keep-alive
comment or an error event is never spliced into the middle of an event), hands back each
run of complete events exactly as received, and reports idleness so the caller can send a
``: ping`` comment. The body underneath is a bounded buffer (``gateway.upstream.base.Body``):
while the relay waits on the client, nothing more is read from the upstream.
"""

from __future__ import annotations

from gateway.errors import GatewayError, UpstreamProtocolError, UpstreamReadTimeout, error_body
from gateway.upstream.base import Body

__all__ = ["EventReader", "PING", "DONE", "error_event", "sse_payloads"]

PING = b": ping\n\n"
DONE = b"data: [DONE]\n\n"


class EventReader:
    __slots__ = ("_body", "_ping", "_timeout", "_max_event", "_tail", "_idle")

    def __init__(self, body: Body, ping_interval: float, read_timeout: float, max_event: int) -> None:
        self._body = body
        self._ping = min(ping_interval, read_timeout)
        self._timeout = read_timeout
        self._max_event = max_event
        self._tail = b""
        self._idle = 0.0

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
                continue
            if end == len(data):
                self._tail = b""
                return data
            self._tail = data[end:]
            return data[:end]


def error_event(exc: GatewayError) -> bytes:
    """An OpenAI-shaped error as an SSE event (what OpenAI clients raise on mid-stream)."""
    return b"data: " + error_body(exc.message, exc.type, exc.param, exc.code) + b"\n\n"


def sse_payloads(events: bytes) -> list[bytes]:
    """The ``data`` payload of each event in a run of complete events (comments dropped)."""
    payloads = []
    for event in events.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            payloads.append(b"\n".join(lines))
    return payloads
