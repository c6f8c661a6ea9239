"""`Circuit`: skip a failing dependency for a cooldown after an error (closed → open →
half-open with one probe → closed or open again)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Circuit:
    def __init__(self, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self._clock = clock
        self._opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._clock() - self._opened_at < self.cooldown:
            return "open"
        return "half-open"

    def allow(self) -> bool:
        """May a call go through now? In half-open, only one probe at a time does."""
        if self._opened_at is None:
            return True
        if self._probing or self._clock() - self._opened_at < self.cooldown:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        self._opened_at = self._clock()
        self._probing = False

    def abandon(self) -> None:
        """The call let through was cancelled before it said anything about the dependency:
        the state stays as it was, and the next call may probe (otherwise a cancelled probe
        would keep the circuit open for good)."""
        self._probing = False

    def __repr__(self) -> str:
        return f"<Circuit {self.state}>"
