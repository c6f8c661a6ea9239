"""``GET /dashboard``: one page that shows, live, where the gateway's time goes.

``DashboardApp`` serves two things and knows nothing about the gateway:

- ``/dashboard``: the page. Its HTML, CSS and JavaScript live in ``gateway/observe/static/`` (shipped
  as package data) and are inlined into one response at start-up, so the page needs no
  second request, no CDN and nothing from the network; its ``Content-Security-Policy``
  allows exactly those inline blocks (by hash) and a connection back to the gateway,
  which makes "nothing fetched from elsewhere" a rule the browser enforces.
- ``/dashboard/feed``: ``text/event-stream``, one ``data:`` event with the ``snapshot()``
  as JSON at once, then one every ``interval_s``. The stream ends when the client leaves
  (a watcher on ``receive`` wakes the loop, nothing is left running) or when ``stop()``
  says the gateway is draining, so an open dashboard never holds up a shutdown. A
  ``snapshot()`` that raises is logged and skipped: the page shows its feed as stale.

The snapshot is a plain dict, sent as orjson writes it. Any field may be absent or null
(unknown), and the page shows "—" for it::

    time      wall-clock seconds
    gateway   {requests_per_s, in_flight, shedding, cache_hit_rate}
    targets   [{name, kind: edge | endpoint, cluster, requests_per_s,
                ttft_ms, tpot_ms, itl_ms: {p50, p90, p99},
                stages_ms: {admit, cache, route, queue, pool, upstream, engine,
                            first_token, decode: {p50, p90, p99}},
                queue: {waiting, active, limit, arrival_rate_per_s, service_rate_per_s},
                breaker: closed | half_open | open, in_flight, error_rate,
                diagnosis: {verdict: healthy | queue_saturated | prefill_bound
                            | decode_bound | network_bound | unknown, evidence}}]
    slo       [{name, metric, target, burn: {"5m": rate, ...}, error_budget_remaining, alert}]
    engine    {waiting, running, kv_blocks_used, kv_blocks_total, prefix_cache_hit_rate}

``live_snapshot(gateway)``, below its own rule, builds one from the stage model's own
reading (``Gateway.latency()``: what ``/debug/latency`` answers), routing's health, the
engine's stats, and counter differences for the rates.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import importlib.resources
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from gateway.core.sse import sse_event

__all__ = ["DashboardApp", "live_snapshot"]

logger = logging.getLogger("edgegw.dashboard")

Snapshot = Callable[[], dict]


class DashboardApp:
    """The page at ``/dashboard`` and its live feed at ``/dashboard/feed``; while ``stop()``
    returns True (the gateway draining) open feeds end and new ones are refused (503)."""

    def __init__(self, snapshot: Snapshot, interval_s: float = 1.0, *, stop: Callable[[], bool] | None = None) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.stop = stop or (lambda: False)
        self.page, self.page_headers = _page()

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"].rstrip("/").endswith("/feed"):
            await self._feed(scope, receive, send)
        else:
            await _respond(send, scope, 200, self.page_headers, self.page)

    async def _feed(self, scope, receive, send) -> None:
        if self.stop():
            await _respond(send, scope, 503, [(b"content-type", b"text/plain"), (b"retry-after", b"1")], b"draining\n")
            return
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-store"),
            (b"x-accel-buffering", b"no"),  # a buffering proxy in front would hold the events back
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        gone = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(_watch(receive, gone))
        message = {"type": "http.response.body", "body": b"retry: 2000\n\n", "more_body": True}
        failing = False
        try:
            await send(message)
            while not gone.is_set() and not self.stop():
                try:
                    message["body"] = sse_event(orjson.dumps(self.snapshot()))
                    failing = False
                except Exception:
                    if not failing:  # once per failing spell, not every second
                        logger.exception("dashboard snapshot failed; the feed skips it")
                    failing = True
                else:
                    await send(message)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await gone.wait()
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b""})  # draining: end it cleanly
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def _watch(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _respond(send, scope, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


def _page() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The page with its stylesheet and script inlined, and headers whose CSP allows
    exactly those two blocks and an EventSource back to this origin."""
    static = importlib.resources.files("gateway.observe") / "static"
    css = (static / "dashboard.css").read_text(encoding="utf-8")
    js = (static / "dashboard.js").read_text(encoding="utf-8")
    html = (static / "dashboard.html").read_text(encoding="utf-8")
    html = html.replace("/*STYLE*/", css).replace("/*SCRIPT*/", js)
    policy = "; ".join(
        [
            "default-src 'none'",
            f"style-src {_hash(css)}",
            f"script-src {_hash(js)}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"content-security-policy", policy.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]
    return html.encode(), headers


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# == the live snapshot ==================================================================

_RATE_WINDOW_S = 3.0  # requests/s over the last ~3 s
_MIN_GAP_S = 0.5  # several open dashboards share one reading per half second

@dataclass(slots=True)
class _Reading:
    """The gateway's cumulative counters at one moment (``time.monotonic()``)."""

    at: float
    requests: float = 0.0
    answered: dict[str, float] = field(default_factory=dict)  # target -> answers, ever
    cache_hits: float = 0.0
    cache_lookups: float = 0.0


def live_snapshot(gateway, *, rate_window_s: float = _RATE_WINDOW_S, min_gap_s: float = _MIN_GAP_S) -> Snapshot:
    """The ``snapshot()`` for ``DashboardApp`` over ``gateway`` (a ``gateway.node.app.Gateway``):
    per target what ``/debug/latency`` says (stage, TTFT and gap percentiles of the last
    minute, the queue, the diagnosis) with its breaker and load from routing's health;
    the objectives' burn rates; the engine. Rates (requests per second, the cache hit
    rate) are differences of cumulative counters over the last ``rate_window_s`` seconds,
    so the charts move within seconds (the first reading is taken here, at start-up)."""
    return _Live(gateway, rate_window_s, min_gap_s)


class _Live:
    def __init__(self, gateway, rate_window_s: float, min_gap_s: float) -> None:
        self.gateway = gateway
        self.rate_window_s = rate_window_s
        self.min_gap_s = min_gap_s
        self.readings: collections.deque[_Reading] = collections.deque([_read(gateway, time.monotonic())])
        self.last: dict | None = None

    def __call__(self) -> dict:
        now = time.monotonic()
        if self.last is not None and now - self.readings[-1].at < self.min_gap_s:
            return self.last
        reading = _read(self.gateway, now)
        readings = self.readings
        readings.append(reading)
        while len(readings) > 2 and readings[1].at <= now - 2 * self.rate_window_s:
            readings.popleft()
        self.last = _snapshot(self.gateway, reading, _base(readings, now, self.rate_window_s), now)
        return self.last


def _base(readings: collections.deque[_Reading], now: float, span: float) -> _Reading | None:
    """The latest reading at least ``span`` old, or failing that (or when it is older than
    ``2 * span``) the oldest younger one; None when there is none but the current one."""
    older = [r for r in readings if r.at <= now - span]
    if older and older[-1].at >= now - 2 * span:
        return older[-1]
    younger = [r for r in readings if now - span < r.at < now]
    return younger[0] if younger else None


def _read(gateway, now: float) -> _Reading:
    metrics = gateway.metrics
    reading = _Reading(now)
    reading.requests = sum(s.value for m in metrics.requests.collect() for s in m.samples if s.name.endswith("_total"))
    for metric in metrics.e2e.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                target = sample.labels["target"]
                reading.answered[target] = reading.answered.get(target, 0.0) + sample.value
    layer = gateway.cache
    if layer.enabled:
        counts = layer.metrics.counts
        backend = layer.backend
        first = getattr(backend, "front", backend).name  # tiered: every lookup starts at the front
        reading.cache_hits = counts["hits"]
        reading.cache_lookups = counts[f"hits:{first}"] + counts[f"misses:{first}"]
    return reading


def _snapshot(gateway, now_r: _Reading, base: _Reading | None, now: float) -> dict:
    gate, fleet = gateway.gate, gateway.fleet
    span = None if base is None else now - base.at
    rps = None if base is None else (now_r.requests - base.requests) / span
    hit_rate = None
    if base is not None and gateway.cache.enabled:
        lookups = now_r.cache_lookups - base.cache_lookups
        hit_rate = (now_r.cache_hits - base.cache_hits) / lookups if lookups > 0 else None
    latency = gateway.latency()
    health = fleet.health.snapshot(time.monotonic())["endpoints"] if fleet.health is not None else {}
    targets = []
    for view in latency["targets"]:
        name = view["name"]
        endpoint = health.get(name, {})
        answered = None if base is None else (now_r.answered.get(name, 0.0) - base.answered.get(name, 0.0)) / span
        targets.append(
            {
                **view,
                "requests_per_s": answered,
                "breaker": endpoint.get("state"),
                "in_flight": endpoint.get("inflight"),
                "error_rate": endpoint.get("error_rate"),
            }
        )
    return {
        "time": time.time(),
        "gateway": {"requests_per_s": rps, "in_flight": gate.in_flight, "shedding": gate.shedding, "cache_hit_rate": hit_rate},
        "targets": targets,
        "slo": latency["slo"],
        "engine": _engine(fleet),
    }


def _engine(fleet) -> dict | None:
    stats = fleet.edge.snapshot() if fleet.edge is not None else None
    if stats is None:
        return None
    return {
        "waiting": stats["num_waiting"],
        "running": stats["num_running"],
        "kv_blocks_used": stats["num_kv_blocks_used"],
        "kv_blocks_total": stats["num_kv_blocks_total"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
    }
