"""Where each millisecond went: the per-request stage timer, Server-Timing, Prometheus.

Stages (Server-Timing names):
  admit     request read and parsed, admission passed
  route     the routing decision
  cache     the cache lookup
  pool      waiting for an upstream connection (connect included when a new one opened);
            its desc names the protocol that carried the request (http1 | http2 | http3)
  upstream  from sending the request to the upstream's response headers (its queue + prefill
            for a streaming server that sends headers with the first token)
  engine    the in-process edge engine: chat template and tokenisation (its time to the
            first token shows in the TTFT histogram; non-streaming answers in ``total``)
  total     everything up to the moment the header is sent (non-streaming: the whole answer)
"""

from __future__ import annotations

import logging
import time

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

__all__ = ["Timing", "Metrics", "Sample"]

# (metric name, help, labels, value): a gauge read from live state at scrape time
Sample = tuple[str, str, dict[str, str], float]

access_log = logging.getLogger("edgegw.access")

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Timing:
    """Stage durations of one request, rendered as a ``Server-Timing`` header."""

    __slots__ = ("start", "stages", "_mark")

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self._mark = self.start
        self.stages: list[tuple[str, float, str | None]] = []

    def mark(self, name: str, desc: str | None = None) -> float:
        """Close the stage ``name`` at now (it began where the previous one ended)."""
        now = time.perf_counter()
        self.stages.append((name, now - self._mark, desc))
        self._mark = now
        return now

    def upstream(self, pool_wait: float, attempts: int, protocol: str = "") -> None:
        """Close the upstream stages: pool wait (connect included), then time to first byte."""
        now = time.perf_counter()
        self.stages.append(("pool", pool_wait, protocol or None))
        desc = "first byte" if attempts == 1 else f"first byte, attempt {attempts}"
        self.stages.append(("upstream", now - self._mark - pool_wait, desc))
        self._mark = now

    def add(self, name: str, seconds: float, desc: str | None = None) -> None:
        """Record a stage measured elsewhere (it does not move the running mark)."""
        self.stages.append((name, seconds, desc))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def header(self) -> bytes:
        parts = []
        for name, seconds, desc in self.stages:
            part = f"{name};dur={seconds * 1000:.3f}"
            if desc:
                part += f';desc="{desc}"'
            parts.append(part)
        parts.append(f"total;dur={self.elapsed() * 1000:.3f}")
        return ", ".join(parts).encode()


class _Series:
    """The labelled children for one (model, upstream) pair, resolved once."""

    __slots__ = ("ttft", "gap", "e2e")

    def __init__(self, metrics: Metrics, model: str, upstream: str) -> None:
        self.ttft = metrics.ttft.labels(model, upstream)
        self.gap = metrics.inter_token.labels(model, upstream)
        self.e2e = metrics.e2e.labels(model, upstream)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "edgegw_requests", "Requests answered, by route kind and status.", ["endpoint", "status"], registry=registry
        )
        self.ttft = Histogram(
            "edgegw_ttft_seconds",
            "Time from request arrival to the first relayed token (or full answer when not streaming).",
            ["model", "upstream"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "edgegw_inter_token_seconds",
            "Gap between consecutive relayed stream chunks.",
            ["model", "upstream"],
            buckets=_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "edgegw_e2e_seconds",
            "Time from request arrival to the last byte relayed.",
            ["model", "upstream"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage = Histogram(
            "edgegw_stage_seconds", "Duration of each gateway stage.", ["stage"], buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.upstream_errors = Counter(
            "edgegw_upstream_errors", "Upstream failures, by endpoint and kind.", ["upstream", "kind"], registry=registry
        )
        self.failovers = Counter(
            "edgegw_failovers", "Requests retried on another endpoint before the first byte.", registry=registry
        )
        self.hedges = Counter("edgegw_hedges", "Hedged requests (a second attempt started).", registry=registry)
        self.upstream_requests = Counter(
            "edgegw_upstream_requests",
            "Requests answered by an endpoint, by the protocol that carried them (an http3 endpoint may fall back to http2).",
            ["upstream", "protocol"],
            registry=registry,
        )
        self.hedge_wins = Counter("edgegw_hedge_wins", "Hedged requests won by the hedge.", registry=registry)
        self.client_disconnects = Counter(
            "edgegw_client_disconnects", "Requests whose client left before the end.", registry=registry
        )
        self.in_flight = Gauge("edgegw_in_flight_requests", "Requests being served.", registry=registry)
        self._series: dict[tuple[str, str], _Series] = {}
        self._counts: dict[tuple[str, int], object] = {}

    def count(self, endpoint: str, status: int) -> None:
        """``requests{endpoint, status}`` += 1, with the labelled child looked up once."""
        key = (endpoint, status)
        child = self._counts.get(key)
        if child is None:
            child = self._counts[key] = self.requests.labels(endpoint, str(status))
        child.inc()

    def watch(self, read: Callable[[], Iterable[Sample]]) -> None:
        """Export gauges computed by ``read`` at every scrape."""
        self.registry.register(_LiveGauges(read))

    def series(self, model: str, upstream: str) -> _Series:
        key = (model, upstream)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(self, model, upstream)
        return series


class _LiveGauges:
    """A collector that reads its gauges from live state when /metrics is scraped, so the
    hot path never updates them (breaker states, in-flight counts, the engine's queue)."""

    def __init__(self, read: Callable[[], Iterable[Sample]]) -> None:
        self._read = read

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        for name, doc, labels, value in self._read():
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        return list(families.values())

    def describe(self):
        return []  # read at scrape time: nothing to check at registration
