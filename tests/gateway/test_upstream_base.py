"""The bounded response body: quiet spells, backpressure callbacks, end and errors."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.errors import UpstreamProtocolError
from gateway.upstream.body import Body


def make_body(high_water: int = 100):
    calls = {"full": 0, "drained": []}
    loop = asyncio.get_running_loop()
    body = Body(loop, high_water, lambda: calls.__setitem__("full", calls["full"] + 1), calls["drained"].append)
    return body, calls


async def test_quiet_spells_are_reported_once_per_timeout():
    body, _ = make_body()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await body.read(0.05) is None
    first = loop.time() - started
    assert await body.read(0.05) is None  # the next spell is timed from the end of the last
    second = loop.time() - started
    assert 0.04 <= first < 5  # not before the timeout (the upper bound only catches a hang)
    assert second - first >= 0.04


async def test_data_before_the_timeout_is_returned_and_postpones_it():
    body, calls = make_body()
    loop = asyncio.get_running_loop()
    loop.call_later(0.03, body.feed, b"abc")
    assert await body.read(0.1) == b"abc"
    assert calls["drained"] == [3]
    loop.call_later(0.06, body.feed, b"def")  # 0.06 s after the last data: within 0.1 s
    assert await body.read(0.1) == b"def"


async def test_chunks_are_joined_and_the_full_callback_fires_at_high_water():
    body, calls = make_body(high_water=10)
    body.feed(b"12345")
    assert calls["full"] == 0
    body.feed(b"67890")
    assert calls["full"] == 1
    assert await body.read(1) == b"1234567890"
    assert body.buffered == 0


async def test_end_and_error_stop_the_timer():
    body, _ = make_body()
    reader = asyncio.ensure_future(body.read(10))
    await asyncio.sleep(0)
    body.feed_eof()
    assert await reader == b""
    assert body._timer is None
    failing, _ = make_body()
    reader = asyncio.ensure_future(failing.read(10))
    await asyncio.sleep(0)
    failing.feed_error(UpstreamProtocolError("gone"))
    with pytest.raises(UpstreamProtocolError):
        await reader
    assert failing._timer is None
