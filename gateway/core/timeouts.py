"""Timeouts that almost never fire, checked by one sweep instead of one timer each.

A request arms two: its body must arrive within ``limits.body_timeout_s`` and each of its
sends must be accepted within ``limits.send_timeout_s``. An ``asyncio`` timer apiece is a
heap push, a cancel and a heap pop per request, on the path whose whole budget is a few
hundred microseconds, for a timeout that fires once in a blue moon. Here a request adds
itself to a set and takes itself out; one callback per event loop, ``PERIOD`` apart and
only while the set is not empty, looks for the overdue. A timeout thus fires up to
``PERIOD`` late, which is nothing next to seconds.
"""

from __future__ import annotations

import asyncio

__all__ = ["PERIOD", "Watch", "watchdog"]

PERIOD = 0.1  # seconds between sweeps


class Watch:
    """Something a sweep looks at: ``overdue(now)`` is asked with ``loop.time()``; when it
    says yes, ``expire()`` is called once and the watch is dropped."""

    __slots__ = ()

    def overdue(self, now: float) -> bool:
        raise NotImplementedError

    def expire(self) -> None:
        raise NotImplementedError


class Watchdog:
    __slots__ = ("loop", "watches", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: set[Watch] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, watch: Watch) -> None:
        self.watches.add(watch)
        if self._handle is None:
            self._handle = self.loop.call_later(PERIOD, self._sweep)

    def discard(self, watch: Watch) -> None:
        self.watches.discard(watch)

    def _sweep(self) -> None:
        now = self.loop.time()
        overdue = [watch for watch in self.watches if watch.overdue(now)]
        for watch in overdue:
            self.watches.discard(watch)
            watch.expire()
        self._handle = self.loop.call_later(PERIOD, self._sweep) if self.watches else None


_DOGS: dict[asyncio.AbstractEventLoop, Watchdog] = {}


def watchdog() -> Watchdog:
    """The running loop's watchdog."""
    loop = asyncio.get_running_loop()
    dog = _DOGS.get(loop)
    if dog is None:
        for old in [old for old in _DOGS if old.is_closed()]:  # loops of finished tests
            del _DOGS[old]
        dog = _DOGS[loop] = Watchdog(loop)
    return dog
