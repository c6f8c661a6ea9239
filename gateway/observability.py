"""Where each millisecond went: the per-request stage timer, Server-Timing, Prometheus.

Stages (Server-Timing names), each starting where the previous one ended:
  admit     request read, admission passed
  cache     the cache lookup (``desc``: hit, coalesced)
  route     the routing decision
  queue     waiting in the gateway's queue in front of the target (gateway.queueing)
  pool      waiting for an upstream connection (connect included when a new one opened);
            its desc names the protocol that carried the request (http1 | http2 | http3)
  upstream  from sending the request to the upstream's response headers (its queue + prefill
            for a streaming server that sends headers with the first token)
  engine    the in-process edge engine: chat template and tokenisation (its time to the
            first token shows in the TTFT histogram; non-streaming answers in ``total``)
  total     everything up to the moment the header is sent (non-streaming: the whole answer)

The relay adds ``first_token`` and ``decode`` (what the client saw) to the histogram and the
access log, and the edge engine its own view once its answer has ended (``Reply.stages``):
  engine_queue    waiting in the engine for a batch slot and KV blocks
  engine_prefill  from its first schedule to its first token (prompt chunks included)
  engine_decode   from the first token to the last

Metric labels say what they hold: ``api`` (chat | completions | ws), ``model``, ``target``
(an endpoint URL, ``edge``, ``cache`` or ``coalesced``), ``endpoint`` (an endpoint URL).
"""

from __future__ import annotations

import bisect
import logging
import re
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from gateway.diagnosis import Diagnosis
from gateway.diagnosis import Sample as DiagnosisSample
from gateway.slo import SLOs, Outcome

__all__ = ["Metrics", "Observer", "RedactSecrets", "Sample", "Series", "Timing", "redact_logs"]

access_log = logging.getLogger("edgegw.access")

# (metric name, help, labels, value): a gauge read from live state at scrape time
Sample = tuple[str, str, dict[str, str], float]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_GAP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Histogram:
    """A labelled Prometheus histogram for the event loop's hot path.

    ``prometheus_client.Histogram.observe`` takes a lock for the sum and another for the
    bucket and checks its state on every call (~3 µs); a request observes eight to ten of
    these. Here a child is two lists and an observation one ``bisect`` and two additions,
    safe because only the event loop's thread observes. Buckets are kept per bucket and
    summed into Prometheus's cumulative form at scrape time."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], *, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        values = tuple(str(v) for v in values)
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = _HistogramChild(self.bounds)
        return child

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
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Children(dict):
    def __init__(self, histogram: Histogram, kind: str) -> None:
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

    def upstream(self, queued: float, pool_wait: float, attempts: int, protocol: str = "") -> None:
        """Close the upstream stages: the gateway's queue, the pool (connect included; its
        desc names the protocol), then the time to the upstream's first byte."""
        now = time.perf_counter()
        self.stages.append(("queue", queued, None))
        self.stages.append(("pool", pool_wait, protocol or None))
        desc = "first byte" if attempts == 1 else f"first byte, attempt {attempts}"
        self.stages.append(("upstream", max(0.0, now - self._mark - pool_wait - queued), desc))
        self._mark = now

    def engine(self, queued: float) -> None:
        """Close the edge engine's stages: the gateway's queue, then the prompt rendered and
        tokenised (its time to first token shows in the TTFT histogram)."""
        now = time.perf_counter()
        self.stages.append(("queue", queued, None))
        self.stages.append(("engine", max(0.0, now - self._mark - queued), "prompt rendered and tokenised"))
        self._mark = now

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
        self.requests = Counter(
            "edgegw_requests", "Requests answered, by API, status (499: the client left) and tenant.", ["api", "status", "tenant"], registry=registry
        )
        self.ttft = Histogram(
            "edgegw_ttft_seconds",
            "Time from request arrival to the first relayed token (or full answer when not streaming).",
            ["model", "target"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "edgegw_inter_token_seconds",
            "Gap between consecutive relayed stream chunks.",
            ["model", "target"],
            buckets=_GAP_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
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
        self._series: dict[tuple[str, str], Series] = {}
        self.rate_limited = Counter(
            "edgegw_rate_limited", "Requests refused by a tenant's rate limit.", ["tenant", "limit"], registry=registry
        )
        self.queue_wait = Histogram(
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
        self.stage = Histogram(
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

    def watch(self, read: Callable[[], Iterable[Sample]]) -> None:
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


_SECRET = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key|cookie|set-cookie)(['\"]?\s*[:=,]\s*['\"]?(?:b['\"])?)[^\r\n'\"]*"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\"]+")


class RedactSecrets(logging.Filter):
    """Takes credentials out of a log record, whoever wrote it: the values of
    ``Authorization``, ``X-Api-Key``, ``Api-Key`` and cookie headers, and bearer tokens
    (uvicorn's protocol debug output prints handshake headers as they came)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _BEARER.sub(r"\1[redacted]", _SECRET.sub(r"\1\2[redacted]", message))
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_logs(*loggers: str) -> None:
    """Put ``RedactSecrets`` on every handler of the root logger and of ``loggers``."""
    for name in ("", *loggers):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(RedactSecrets())


class Observer:
    """Where a finished request's stage model goes: the stage histogram, the access log, the
    SLOs and the per-target diagnosis (``gateway.slo``, ``gateway.diagnosis``). One call per
    request, at its end (``Gate.done``)."""

    def __init__(self, metrics: Metrics, slos: SLOs, diagnosis: Diagnosis, access_log: bool, tracing=None) -> None:
        self.metrics = metrics
        self.slos = slos
        self.diagnosis = diagnosis
        self.access_log = access_log
        self.tracing = tracing  # gateway.tracing.Tracing when traces are on
        self._verdicts: dict[str, str] = {}

    def finished(self, ctx) -> None:
        """``ctx``: the request's ``gateway.admission.RequestContext``."""
        timing = ctx.timing
        total = timing.elapsed()
        kind = ctx.target_kind
        stages = {name: seconds for name, seconds, _ in timing.stages}
        children = self.metrics.stage_children(kind)
        for name, seconds in stages.items():
            children[name].observe(seconds)
        for name, seconds in ctx.target_stages:
            children[name].observe(seconds)
        children["total"].observe(total)
        tenant = ctx.tenant
        priority = tenant.priority if tenant is not None else "-"
        if ctx.status:
            outcome = Outcome(ctx.status, ctx.ttft, total, ctx.tokens, priority, tenant.name if tenant else "-", ctx.model, kind)
            self.slos.record(outcome, time.time())
        if kind in ("edge", "endpoint") and ctx.status:
            tpot = (total - ctx.ttft) / (ctx.tokens - 1) if ctx.ttft is not None and ctx.tokens > 1 else None
            ttft = ctx.ttft if ctx.ttft is not None else total  # a JSON answer's first token comes with its last
            self.diagnosis.record(
                ctx.via, kind, DiagnosisSample(time.monotonic(), stages, ttft, tpot, ctx.prompt_tokens, ctx.status < 500, ctx.gaps)
            )
        if self.tracing is not None:
            self.tracing.finish(ctx, total)
        if self.access_log:
            stage_text = ",".join(f"{name}:{seconds * 1000:.1f}" for name, seconds in (*stages.items(), *ctx.target_stages))
            ttft = "-" if ctx.ttft is None else f"{ctx.ttft * 1000:.1f}ms"
            access_log.info(
                "%s %s %s tenant=%s model=%s via=%s ttft=%s total=%.1fms trace=%s stages=%s",
                ctx.request_id.decode(),
                ctx.api,
                ctx.status,
                tenant.name if tenant is not None else "-",
                ctx.model,
                ctx.via,
                ttft,
                total * 1000,
                ctx.trace_id or "-",
                stage_text,
            )
