"""``GET /dashboard``: one page that shows, live, where the gateway's time goes.

``DashboardApp`` serves two things and knows nothing about the gateway:

- ``/dashboard``: the page. Its HTML, CSS and JavaScript live in ``gateway/static/`` (shipped
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
                ttft_ms, itl_ms: {p50, p99},
                stages_ms: {queue, pool, upstream, prefill, decode: {p50, p99}},
                queue: {waiting, active, limit, service_rate_per_s},
                breaker: closed | half_open | open,
                diagnosis: {verdict: healthy | queue_saturated | prefill_bound
                            | decode_bound | network_bound | unknown, evidence}}]
    slo       [{name, metric, target, burn: {"5m": rate, ...}, error_budget_remaining, alert}]
    engine    {waiting, running, kv_blocks_used, kv_blocks_total, prefix_cache_hit_rate}

``provisional_snapshot(gateway)``, below its own rule, builds one from what the gateway
measures today (Prometheus counters and histograms, the queues, routing's health, the
engine's stats); the observability work replaces it with the stage model's own reading
without touching the page.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import importlib.resources
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from gateway.relay import sse_event

__all__ = ["DashboardApp", "provisional_snapshot"]

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
    static = importlib.resources.files("gateway") / "static"
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


# == the provisional snapshot ==================================================================
#
# Built from what the running gateway measures today. Replaced by the observability work's
# own snapshot (stages, SLO burn, diagnosis); the page does not change when it is.

_WINDOW_S = 30.0  # percentiles over the last ~30 s
_RATE_WINDOW_S = 3.0  # requests/s over the last ~3 s
_MIN_GAP_S = 0.5  # several open dashboards share one reading per half second

Buckets = dict[str, dict[float, float]]  # target -> upper bound -> cumulative count


@dataclass(slots=True)
class _Reading:
    """The gateway's cumulative counters at one moment (``time.monotonic()``)."""

    at: float
    requests: float = 0.0
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    e2e: Buckets = field(default_factory=dict)
    queue: Buckets = field(default_factory=dict)
    cache_hits: float = 0.0
    cache_lookups: float = 0.0


def provisional_snapshot(
    gateway, *, window_s: float = _WINDOW_S, rate_window_s: float = _RATE_WINDOW_S, min_gap_s: float = _MIN_GAP_S
) -> Snapshot:
    """A ``snapshot()`` for ``DashboardApp`` over ``gateway`` (a ``gateway.app.Gateway``).

    Rates and percentiles are differences of cumulative counters between now and a
    reading ``rate_window_s`` / ``window_s`` ago (the first reading is taken here, at
    start-up); a reading older than twice its window is not compared against (after an
    idle spell with nobody watching, the first snapshot says "unknown" rather than
    averaging over minutes)."""
    return _Provisional(gateway, window_s, rate_window_s, min_gap_s)


class _Provisional:
    def __init__(self, gateway, window_s: float, rate_window_s: float, min_gap_s: float) -> None:
        self.gateway = gateway
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.min_gap_s = min_gap_s
        self.readings: collections.deque[_Reading] = collections.deque([_read(gateway, time.monotonic())])
        self.last: dict | None = None

    def __call__(self) -> dict:
        now = time.monotonic()
        latest = self.readings[-1]
        if self.last is not None and now - latest.at < self.min_gap_s:
            return self.last
        reading = _read(self.gateway, now)
        readings = self.readings
        readings.append(reading)
        while len(readings) > 2 and readings[1].at <= now - 2 * self.window_s:
            readings.popleft()
        rate_base = _base(readings, now, self.rate_window_s)
        self.last = _snapshot(self.gateway, reading, rate_base, _base(readings, now, self.window_s), now)
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
    reading.ttft = _buckets(metrics.ttft, "target")
    reading.itl = _buckets(metrics.inter_token, "target")
    reading.e2e = _buckets(metrics.e2e, "target")
    reading.queue = _buckets(metrics.queue_wait, "target")
    layer = gateway.cache
    if layer.enabled:
        counts = layer.metrics.counts
        backend = layer.backend
        first = getattr(backend, "front", backend).name  # tiered: every lookup starts at the front
        reading.cache_hits = counts["hits"]
        reading.cache_lookups = counts[f"hits:{first}"] + counts[f"misses:{first}"]
    return reading


def _buckets(histogram, label: str) -> Buckets:
    """Cumulative bucket counts per value of ``label``, summed over the other labels."""
    out: Buckets = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bounds = out.setdefault(sample.labels[label], {})
                le = float(sample.labels["le"])
                bounds[le] = bounds.get(le, 0.0) + sample.value
    return out


def _snapshot(gateway, now_r: _Reading, rate_base: _Reading | None, base: _Reading | None, now: float) -> dict:
    gate, fleet = gateway.gate, gateway.fleet
    rps = None if rate_base is None else (now_r.requests - rate_base.requests) / (now - rate_base.at)
    hit_rate = None
    if base is not None and gateway.cache.enabled:
        lookups = now_r.cache_lookups - base.cache_lookups
        hit_rate = (now_r.cache_hits - base.cache_hits) / lookups if lookups > 0 else None
    return {
        "time": time.time(),
        "gateway": {"requests_per_s": rps, "in_flight": gate.in_flight, "shedding": gate.shedding, "cache_hit_rate": hit_rate},
        "targets": _targets(fleet, now_r, rate_base, base, now),
        "slo": [],
        "engine": _engine(fleet),
    }


def _targets(fleet, now_r: _Reading, rate_base: _Reading | None, base: _Reading | None, now: float) -> list[dict]:
    health = fleet.health.snapshot(now)["endpoints"] if fleet.health is not None else {}
    clusters: dict[str, list[str]] = {}
    for cluster in fleet.clusters:
        for upstream in cluster.upstreams:
            clusters.setdefault(upstream.url, []).append(cluster.name)
    targets = []
    for name, queue in fleet.queues.items():
        view = health.get(name, {})
        service = None
        if queue.limit and queue.service_s:
            service = queue.limit / queue.service_s
        done = _delta(now_r.e2e, rate_base.e2e, name) if rate_base is not None else None
        ttft = _percentiles(now_r.ttft, base, "ttft", name)
        queued = _percentiles(now_r.queue, base, "queue", name)
        e2e = _percentiles(now_r.e2e, base, "e2e", name)
        targets.append(
            {
                "name": name,
                "kind": "edge" if name == "edge" else "endpoint",
                "cluster": ", ".join(clusters[name]) if name in clusters else None,
                "requests_per_s": None if done is None else _count(done) / (now - rate_base.at),
                "ttft_ms": ttft,
                "itl_ms": _percentiles(now_r.itl, base, "itl", name),
                "stages_ms": _stages(name == "edge", queued, ttft, e2e),
                "queue": {"waiting": queue.waiting, "active": queue.active, "limit": queue.limit, "service_rate_per_s": service},
                "breaker": view.get("state"),
                "in_flight": view.get("inflight"),
                "error_rate": view.get("error_rate"),
                "diagnosis": {"verdict": "unknown"},
            }
        )
    return targets


def _stages(edge: bool, queued: dict | None, ttft: dict | None, e2e: dict | None) -> dict:
    """Median per stage, as differences of medians: the gateway's queue; then up to the first
    token (``upstream``: pool, connect, the server's own queue and prefill; ``prefill`` on
    the edge engine); then the rest of the stream (``decode``). A difference of medians is
    not the median of a difference, hence no p99: an approximation until the stage model
    reports each stage itself."""
    stages = {"queue": queued}
    if ttft is not None:
        first = ttft["p50"] - (queued["p50"] if queued is not None else 0.0)
        stages["prefill" if edge else "upstream"] = {"p50": max(0.0, first), "p99": None}
        if e2e is not None:
            stages["decode"] = {"p50": max(0.0, e2e["p50"] - ttft["p50"]), "p99": None}
    return stages


def _engine(fleet) -> dict | None:
    if fleet.edge is None:
        return None
    stats = fleet.edge.engine.stats()
    return {
        "waiting": stats.num_waiting,
        "running": stats.num_running,
        "kv_blocks_used": stats.num_kv_blocks_used,
        "kv_blocks_total": stats.num_kv_blocks_total,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
    }


def _delta(now: Buckets, then: Buckets, target: str) -> dict[float, float]:
    old = then.get(target, {})
    return {le: count - old.get(le, 0.0) for le, count in now.get(target, {}).items()}


def _count(buckets: dict[float, float]) -> float:
    return buckets.get(math.inf, 0.0)


def _percentiles(now: Buckets, base: _Reading | None, metric: str, target: str) -> dict | None:
    """p50 and p99 in milliseconds of what was observed since ``base``, or None."""
    if base is None:
        return None
    buckets = _delta(now, getattr(base, metric), target)
    if _count(buckets) <= 0:
        return None
    return {"p50": _quantile(0.5, buckets) * 1e3, "p99": _quantile(0.99, buckets) * 1e3}


def _quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in; the
    largest finite bound when it falls in ``+Inf``."""
    bounds = sorted(buckets)
    rank = q * buckets[math.inf]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
