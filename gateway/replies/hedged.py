"""A stream whose first event may come from a second attempt (hedging).

The dispatcher returns the primary's reply at once, wrapped in a ``HedgedReply``, so the
client gets its headers and keep-alives exactly as without a hedge. If no event has come
``hedge_after_ms`` after the request started, the same request starts on the hedge target,
and whichever sends a first event first is relayed; the other is closed (its upstream
request cancelled). A client that leaves meanwhile closes both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gateway.core.errors import NoHealthyUpstream
from gateway.replies.base import Reply

__all__ = ["HedgedReply"]


class HedgedReply(Reply):
    """A stream whose first event may come from a second attempt.

    Until a first event arrives, ``next_events`` waits on the primary and, from
    ``hedge_at`` (``time.monotonic()``), also on the hedge (opened, then read to its first
    event); the first to produce events wins and the other is closed. Quiet spells return
    ``None`` every ``ping`` seconds, as every reply does. A primary beaten by its hedge is
    told its first token came at the hedge's win, a lower bound of its TTFT, so the balancer
    stops preferring it."""

    def __init__(
        self,
        primary: Reply,
        start_hedge: Callable[[], Awaitable[Reply]],
        hedge_at: float,
        ping: float,
        may_hedge: Callable[[], bool],
        on_hedge_win: Callable[[], None],
    ) -> None:
        self.status = primary.status
        self.headers = primary.headers
        self.label = primary.label
        self.pool_wait = primary.pool_wait
        self._primary: Reply | None = primary
        self._start_hedge = start_hedge
        self._hedge_at = hedge_at
        self._ping = ping
        self._may_hedge = may_hedge
        self._on_hedge_win = on_hedge_win
        self._winner: Reply | None = None
        self._pending: asyncio.Future | None = None  # the primary's next_events()
        self._hedge: asyncio.Future | None = None  # the hedge's (reply, first events)
        self._hedge_tried = False

    @property
    def in_event(self) -> bool:
        return self._winner.in_event if self._winner is not None else False

    async def read_body(self) -> bytes:
        return await self._primary.read_body()

    async def next_events(self) -> bytes | None:
        if self._winner is not None:
            return await self._winner.next_events()
        loop = asyncio.get_running_loop()
        quiet_at = loop.time() + self._ping
        while True:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._primary.next_events())
            waiting = (self._pending,) if self._hedge is None else (self._pending, self._hedge)
            timeout = quiet_at - loop.time()
            if not self._hedge_tried:
                timeout = min(timeout, self._hedge_at - time.monotonic())
            done, _ = await asyncio.wait(waiting, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
            if self._hedge in done:
                events = await self._hedge_finished()
                if events is not None:
                    return events
            if self._pending in done:
                pending, self._pending = self._pending, None
                events = pending.result()  # a GatewayError before any event is the stream's error
                if events is not None:
                    await self._discard_hedge()
                    self._winner = self._primary
                    return events
                continue  # a quiet spell of the primary's own: keep waiting
            if not self._hedge_tried and time.monotonic() >= self._hedge_at:
                self._hedge_tried = True
                if self._may_hedge():
                    self._hedge = asyncio.ensure_future(self._hedge_first_events())
                continue
            if loop.time() >= quiet_at:
                return None

    async def _hedge_finished(self) -> bytes | None:
        """The hedge ended: it wins with its first events, unless it failed."""
        hedge, self._hedge = self._hedge, None
        if hedge.cancelled() or hedge.exception() is not None:
            return None  # the primary alone goes on
        reply, events = hedge.result()
        primary, self._primary = self._primary, None
        self._winner = reply
        self._on_hedge_win()
        await _cancel(self._pending)
        self._pending = None
        primary.first_token(time.monotonic())  # beaten: a lower bound of its TTFT
        await primary.aclose()
        return events

    async def _hedge_first_events(self) -> tuple[Reply, bytes]:
        reply = await self._start_hedge()
        try:
            if reply.status >= 400:
                raise NoHealthyUpstream(f"the hedge answered {reply.status}")
            events = None
            while events is None:
                events = await reply.next_events()
            return reply, events
        except BaseException:
            await reply.aclose()
            raise

    def first_token(self, now: float) -> None:
        self._winner.first_token(now)

    def finish(self, ok: bool, chunks: int, now: float) -> None:
        (self._winner or self._primary).finish(ok, chunks, now)

    async def _discard_hedge(self) -> None:
        hedge, self._hedge = self._hedge, None
        result = await _cancel(hedge)
        if result is not None:
            await result[0].aclose()  # it had answered just now: close it all the same

    async def aclose(self) -> None:
        await self._discard_hedge()
        await _cancel(self._pending)
        self._pending = None
        for reply in (self._winner, self._primary):
            if reply is not None:
                await reply.aclose()


async def _cancel(future: asyncio.Future | None):
    """Cancel ``future`` and wait for it; its result if it had finished, else None."""
    if future is None:
        return None
    future.cancel()
    # gather, not await: our own cancellation must propagate, the future's must not
    (result,) = await asyncio.gather(future, return_exceptions=True)
    return None if isinstance(result, BaseException) else result
