"""The splice: events written to the client from the upstream connection's read callbacks.

On the HTTP/1.1 listener (which offers a ``BodyWriter`` in ``scope[WRITER]``) an SSE event
goes from the upstream's callback to the client's socket, with no task wake-up and no ASGI
message per event, while the client keeps up.
"""

from __future__ import annotations

import asyncio

from gateway.core.context import BodyWriter
from gateway.relay.meter import Meter
from gateway.replies import Reply

__all__ = ["Splice"]

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
        events = self.meter.passing(events)  # timed as it arrives
        if events:
            if not self._pending:
                self._loop.call_soon(self.flush)
            self._pending.append(events)
            self._size += len(events)
            if self._size >= _SPLICE_BYTES:  # one loop turn may read many times: bounded here
                self.flush()
