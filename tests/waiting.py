"""Waiting for a condition, bounded: poll it until it holds or a generous time is up.

What a test waits for happens in milliseconds on a quiet machine; the bound is what a
machine whose cores are all busy still meets, and only a broken gateway reaches it. Never a
fixed sleep before asserting that something has happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["eventually", "wait_until"]


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, what: str = "the condition", interval: float = 0.02):
    """Poll ``predicate`` (from a thread that may block) until it returns something true,
    and return that; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def eventually(predicate: Callable[[], object], timeout: float = 10.0, what: str = "the condition", interval: float = 0.01):
    """``wait_until`` for a coroutine: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
