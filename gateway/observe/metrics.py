"""Prometheus for the event loop's hot path: the request counters, the latency histograms
(TTFT, inter-token gap, end to end, stages, queue wait) and the gauges read from live state
at scrape time (the requests in flight among them: the admission gate's own count).

The stages themselves are ``gateway.core.timing``'s; the relay adds ``first_token`` and
``decode`` (what the client saw) to the stage histogram, and the edge engine its own view
once its answer has ended (``Reply.stages``):
  engine_queue    waiting in the engine for a batch slot and KV blocks
  engine_prefill  from its first schedule to its first token (prompt chunks included)
  engine_decode   from the first token to the last

Metric labels say what they hold: ``api`` (chat | completions | ws), ``model``, ``target``
(an endpoint URL, ``edge``, ``cache`` or ``coalesced``), ``endpoint`` (an endpoint URL).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["GaugeSample", "LoopCounter", "LoopHistogram", "Metrics", "Series"]

# (metric name, help, labels, value): a gauge read from live state at scrape time
GaugeSample = tuple[str, str, dict[str, str], float]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _Labelled:
    """A labelled metric of the event loop's hot path: its children by label values, made on
    first use (``_child``), registered once and read at scrape time (``collect``). Only the
    event loop's thread writes to them: no locks."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], *, registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def labels(self, *values: str):
        values = tuple(str(v) for v in values)
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = self._child()
        return child

    def _child(self):
        raise NotImplementedError


class LoopHistogram(_Labelled):
    """A labelled Prometheus histogram for the event loop's hot path.

    ``prometheus_client.Histogram.observe`` takes a lock for the sum and another for the
    bucket and checks its state on every call (~3 µs); a request observes eight to ten of
    these. Here a child is two lists and an observation one ``bisect`` and two additions,
    safe because only the event loop's thread observes. Buckets are kept per bucket and
    summed into Prometheus's cumulative form at scrape time."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], *, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            running = 0
            buckets = []
            for bound, count in zip(self.bounds + (float("inf"),), child.counts):
                running += count
                buckets.append((_bucket_name(bound), running))
            family.add_metric(list(values), buckets, child.sum)
        yield family

    def describe(self):
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopCounter(_Labelled):
    """A labelled Prometheus counter for the event loop's hot path, as ``LoopHistogram`` is
    for histograms: a child is one number that ``inc`` adds to (``prometheus_client``'s
    ``Counter.inc`` checks its state and takes a lock: ~30 bytecode instructions a call,
    a few per request), read at scrape time."""

    def _child(self) -> _CounterChild:
        return _CounterChild()

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family

    def describe(self):
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount


class _Children(dict):
    def __init__(self, histogram: LoopHistogram, kind: str) -> None:
        super().__init__()
        self.histogram = histogram
        self.kind = kind

    def __missing__(self, stage: str) -> _HistogramChild:
        child = self[stage] = self.histogram.labels(stage, self.kind)
        return child


def _bucket_name(bound: float) -> str:
    if bound == float("inf"):
        return "+Inf"
    return repr(bound) if bound != int(bound) else f"{bound:.1f}"


class Series:
    """The labelled children for one (model, target) pair, resolved once."""

    __slots__ = ("ttft", "gap", "e2e")

    def __init__(self, metrics: Metrics, model: str, target: str) -> None:
        self.ttft = metrics.ttft.labels(model, target)
        self.gap = metrics.inter_token.labels(model, target)
        self.e2e = metrics.e2e.labels(model, target)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        self.requests = LoopCounter(
            "edgegw_requests", "Requests answered, by API, status (499: the client left) and tenant.", ["api", "status", "tenant"], registry=registry
        )
        self.ttft = LoopHistogram(
            "edgegw_ttft_seconds",
            "Time from request arrival to the first relayed token (or full answer when not streaming).",
            ["model", "target"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = LoopHistogram(
            "edgegw_inter_token_seconds",
            "Gap between consecutive relayed stream chunks.",
            ["model", "target"],
            buckets=_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = LoopHistogram(
            "edgegw_e2e_seconds",
            "Time from request arrival to the last byte relayed.",
            ["model", "target"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "edgegw_upstream_errors", "Upstream failures, by endpoint and kind.", ["endpoint", "kind"], registry=registry
        )
        self.failovers = Counter(
            "edgegw_failovers", "Requests retried on another endpoint before the first byte.", registry=registry
        )
        self.hedges = Counter("edgegw_hedges", "Hedged requests (a second attempt started).", registry=registry)
        self.upstream_requests = LoopCounter(
            "edgegw_upstream_requests",
            "Requests answered by an endpoint, by the protocol that carried them (an http3 endpoint may fall back to http2).",
            ["upstream", "protocol"],
            registry=registry,
        )
        self.hedge_wins = Counter("edgegw_hedge_wins", "Hedged requests won by the hedge.", registry=registry)
        self.client_disconnects = Counter(
            "edgegw_client_disconnects", "Requests whose client left before the end.", registry=registry
        )
        self._series: dict[tuple[str, str], Series] = {}
        self.rate_limited = Counter(
            "edgegw_rate_limited", "Requests refused by a tenant's rate limit.", ["tenant", "limit"], registry=registry
        )
        self.queue_wait = LoopHistogram(
            "edgegw_queue_seconds",
            "Time a request waited in the gateway's queue in front of its target.",
            ["target", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.shed = Counter(
            "edgegw_shed",
            "Requests answered at once because no target could start them within their budget, or dropped when it passed.",
            ["reason", "priority"],
            registry=registry,
        )
        self.stage = LoopHistogram(
            "edgegw_stage_seconds",
            "Time a request spent in each stage: the Server-Timing stages, first_token and decode as relayed, the edge engine's own.",
            ["stage", "target_kind"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self._counts: dict[tuple[str, int, str], object] = {}
        self._stages: dict[str, _Children] = {}
        self._children: dict[tuple, object] = {}

    def count(self, api: str, status: int, tenant: str) -> None:
        """``requests{api, status, tenant}`` += 1, with the labelled child looked up once."""
        key = (api, status, tenant)
        child = self._counts.get(key)
        if child is None:
            child = self._counts[key] = self.requests.labels(api, str(status), tenant)
        child.inc()

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once (prometheus_client's ``labels`` checks
        and locks on every call)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def stage_children(self, target_kind: str) -> dict[str, _HistogramChild]:
        """``stage{stage=..., target_kind}`` by stage name, made on first use."""
        children = self._stages.get(target_kind)
        if children is None:
            children = self._stages[target_kind] = _Children(self.stage, target_kind)
        return children

    def watch(self, read: Callable[[], Iterable[GaugeSample]]) -> None:
        """Export gauges computed by ``read`` at every scrape."""
        self.registry.register(_LiveGauges(read))

    def series(self, model: str, target: str) -> Series:
        key = (model, target)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = Series(self, model, target)
        return series


class _LiveGauges:
    """A collector that reads its gauges from live state when /metrics is scraped, so the
    hot path never updates them (breaker states, in-flight counts, the engine's queue)."""

    def __init__(self, read: Callable[[], Iterable[GaugeSample]]) -> None:
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
