"""Where a request goes and opening its answer there.

The ``Dispatcher`` owns what the routing package decides over: the upstream pools (one
``Upstream`` per endpoint URL), the in-process edge engine, the routing table, the live
``HealthState`` (fed from every request and from active probes) and the GeoIP database.
Per request it asks ``routing.decide`` for a ``RouteDecision``, then opens a ``Reply`` on
the target, walking the decision's fallbacks on a connect error, a pool timeout or a 5xx
before the first byte (within the retry budget), and hedging when the decision says so:
if no first byte by ``hedge_after_ms``, the same request starts on the hedge target and
whichever answers first is kept, the other cancelled.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import time
from collections.abc import Iterator, Mapping

import orjson

from gateway.backends import Reply, UpstreamReply
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyUpstream,
    Overloaded,
    PoolTimeout,
    UpstreamConnectError,
)
from gateway.observability import Metrics, Sample
from gateway.protocol import ParsedRequest
from gateway.settings import ClusterSettings, Settings
from gateway.upstream import Upstream
from routing import (
    ClusterSpec,
    EdgeStats,
    GeoLocator,
    HealthState,
    NoRoute,
    RouteDecision,
    RoutingTable,
    Target,
    TargetKind,
    UnknownModel,
    decide,
    locate_client,
    request_from_openai,
)

__all__ = ["Cluster", "Dispatcher"]

logger = logging.getLogger("edgegw.dispatch")

_PATHS = {"chat": b"/v1/chat/completions", "completion": b"/v1/completions"}
_BREAKER_DOC = "Circuit breaker of the endpoint: 0 closed, 1 half-open, 2 open (ejected)."
_BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}


class Cluster:
    def __init__(self, settings: ClusterSettings, upstreams: list[Upstream]) -> None:
        self.name = settings.name
        self.settings = settings
        self.upstreams = upstreams
        self.models: tuple[str, ...] = tuple(settings.models)
        self.discovers = not settings.models

    def spec(self) -> ClusterSpec:
        return ClusterSpec(self.name, self.models, tuple(u.url for u in self.upstreams))

    async def discover(self) -> bool:
        """Refresh the model list from the endpoints' ``GET /v1/models``; True if it changed."""
        found: set[str] = set()
        for upstream in self.upstreams:
            try:
                response = await upstream.client.get("/v1/models")
                if response.status_code == 200:
                    found.update(m["id"] for m in orjson.loads(response.content).get("data", []) if "id" in m)
            except Exception as exc:  # best effort: an endpoint that is down lists nothing
                logger.warning("model discovery on %s failed: %s", upstream.url, exc)
        models = tuple(sorted(found))
        if not models or models == self.models:
            return False
        self.models = models
        return True


class Dispatcher:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.routing = settings.routing
        self.clusters: list[Cluster] = []
        self.upstreams: dict[str, Upstream] = {}
        self.edge = None  # gateway.edge.EdgeBackend when edge.enabled
        self.geo: GeoLocator | None = None
        self.table: RoutingTable | None = None
        self.health: HealthState | None = None
        self._rng = random.Random()
        self._tasks: list[asyncio.Task] = []

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
            self.clusters.append(Cluster(cluster_settings, upstreams))
        if settings.edge.enabled:
            # imported here, not at the top: the engine needs torch, a relay-only gateway does not
            edge = importlib.import_module("gateway.edge")
            self.edge = await edge.EdgeBackend.start(settings.edge)
        self.geo = await asyncio.to_thread(GeoLocator.open, self.routing.geoip_db)
        await asyncio.gather(*(u.pool.warm() for u in self.upstreams.values()))
        discovering = [c for c in self.clusters if c.discovers]
        await asyncio.gather(*(c.discover() for c in discovering))
        self._build_table()
        self.health = HealthState.from_config(self.routing, list(self.upstreams), seed=None)
        for cluster in discovering:
            self._tasks.append(asyncio.create_task(self._rediscover(cluster)))
        if self.upstreams:
            self._tasks.append(asyncio.create_task(self._probe_loop()))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(u.aclose() for u in self.upstreams.values()), return_exceptions=True)
        if self.edge is not None:
            await self.edge.aclose()
        if self.geo is not None:
            self.geo.close()

    def _build_table(self) -> None:
        edge_model = self.edge.model_name if self.edge is not None else None
        self.table = RoutingTable.build(self.routing, [c.spec() for c in self.clusters], edge_model)

    async def _rediscover(self, cluster: Cluster) -> None:
        while True:
            await asyncio.sleep(cluster.settings.discovery_interval_s)
            if await cluster.discover():
                self._build_table()

    async def _probe_loop(self) -> None:
        """Active health checks: probe what ``HealthState`` says is due, record the result."""
        config = self.routing.health
        while True:
            now = time.monotonic()
            due = self.health.endpoints_to_probe(now)
            if due:
                await asyncio.gather(*(self._probe(self.upstreams[url], config) for url in due if url in self.upstreams))
            next_at = self.health.next_probe_at()
            delay = config.probe_interval_s if next_at is None else next_at - time.monotonic()
            await asyncio.sleep(min(max(delay, 0.05), config.probe_interval_s))

    async def _probe(self, upstream: Upstream, config) -> None:
        started = time.monotonic()
        try:
            # the pool transport does not apply httpx's per-request timeout: bound it here
            response = await asyncio.wait_for(upstream.client.get(config.probe_path), config.probe_timeout_s)
            ok = response.status_code < 500
        except Exception:
            ok = False
        rtt = time.monotonic() - started
        self.health.record_probe(upstream.url, ok, rtt if ok else None, time.monotonic())

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

    def live_metrics(self) -> Iterator[Sample]:
        """Gauges for /metrics: each endpoint's breaker, load and latency estimates, and the
        edge engine's queue and KV cache."""
        now = time.monotonic()
        for url, view in self.health.snapshot(now)["endpoints"].items():
            labels = {"endpoint": url}
            yield "edgegw_endpoint_breaker_state", _BREAKER_DOC, labels, _BREAKER_VALUE.get(view["state"], -1)
            yield "edgegw_endpoint_in_flight", "Requests in flight to the endpoint.", labels, view["inflight"]
            yield "edgegw_endpoint_error_rate", "Recent error rate of the endpoint.", labels, view["error_rate"]
            if view["ttft_ms"] is not None:
                yield "edgegw_endpoint_ttft_ewma_seconds", "Measured TTFT (EWMA).", labels, view["ttft_ms"] / 1e3
        if self.edge is not None:
            stats = self.edge.engine.stats()
            yield "edgegw_edge_waiting", "Sequences waiting in the edge engine.", {}, stats.num_waiting
            yield "edgegw_edge_running", "Sequences running in the edge engine.", {}, stats.num_running
            yield "edgegw_edge_kv_blocks_used", "KV cache blocks in use.", {}, stats.num_kv_blocks_used
            yield "edgegw_edge_kv_blocks_total", "KV cache blocks in the pool.", {}, stats.num_kv_blocks_total
            yield "edgegw_edge_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.", {}, stats.prefix_cache_hit_rate
            yield "edgegw_edge_preemptions", "Sequences preempted since start.", {}, stats.num_preemptions
            if stats.ttft_ms_p50 is not None:
                yield "edgegw_edge_ttft_p50_seconds", "Recent median TTFT of the engine.", {}, stats.ttft_ms_p50 / 1e3
            if stats.tpot_ms_p50 is not None:
                yield "edgegw_edge_tpot_p50_seconds", "Recent median time per output token.", {}, stats.tpot_ms_p50 / 1e3

    def edge_stats(self) -> EdgeStats | None:
        return self.edge.stats() if self.edge is not None else None

    # -- per request -----------------------------------------------------------------

    def route(
        self, parsed: ParsedRequest, peer: str | None, headers: Mapping[str, str], cache_hit: bool = False
    ) -> RouteDecision:
        table = self.table
        ip, location = locate_client(table, self.geo, peer, headers)
        request = request_from_openai(parsed.data, headers, self.routing, client_ip=ip, location=location, cache_hit=cache_hit)
        try:
            return decide(request, table, self.health, time.monotonic(), edge=self.edge_stats(), rng=self._rng)
        except UnknownModel:
            raise ModelNotFound(f"the model '{parsed.model}' does not exist or is not served here", param="model") from None
        except NoRoute as exc:
            if self.edge is not None and parsed.model == self.edge.model_name:
                # a request the engine can never serve (prompt or max_tokens past the context)
                # is the client's error: let the engine name the parameter (400)
                self.edge.check(parsed.kind, parsed.data)
            retry_after = exc.retry_after_s or self.settings.limits.retry_after_s
            raise NoHealthyUpstream(f"no healthy route for model '{parsed.model}': {exc}", retry_after=retry_after) from None

    async def open(
        self, decision: RouteDecision, parsed: ParsedRequest, forward: list[tuple[bytes, bytes]], request_id: str
    ) -> tuple[Reply, Target, int]:
        """The first reply that starts well, hedged if the decision says so; returns it,
        its target and the number of attempts made."""
        if decision.hedge_after_ms is None or decision.hedge_target is None or not parsed.stream:
            # only a stream's first byte is its first token: a JSON answer arrives whole, after
            # the full generation, and hedging on it would double every long request
            return await self._open_with_fallbacks(decision, parsed, forward, request_id)
        started = time.monotonic()
        primary = asyncio.ensure_future(
            _first_byte(self._open_with_fallbacks(decision, parsed, forward, request_id), parsed.stream)
        )
        done, _ = await asyncio.wait((primary,), timeout=decision.hedge_after_ms / 1000)
        if done or not self.health.try_retry(time.monotonic()):
            return await primary
        self.metrics.hedges.inc()
        hedge = asyncio.ensure_future(
            _first_byte(self._open_one(decision.hedge_target, parsed, forward, request_id), parsed.stream)
        )
        result = await _race(primary, hedge)
        if result[1] is decision.hedge_target and result[2] == 2:
            self.metrics.hedge_wins.inc()
            primary_target = decision.target
            if primary_target.kind is TargetKind.ENDPOINT:
                # the loser never produced a first token: what it took so far is a lower bound
                # of its TTFT, and without it the balancer would keep preferring it
                now = time.monotonic()
                self.health.record_first_token(primary_target.endpoint, now - started, now)
        return result

    async def _open_one(
        self, target: Target, parsed: ParsedRequest, forward: list[tuple[bytes, bytes]], request_id: str
    ) -> tuple[Reply, Target, int]:
        return await self.open_target(target, parsed, forward, request_id), target, 2

    async def _open_with_fallbacks(
        self, decision: RouteDecision, parsed: ParsedRequest, forward: list[tuple[bytes, bytes]], request_id: str
    ) -> tuple[Reply, Target, int]:
        targets = (decision.target, *decision.fallbacks)
        attempts = targets[: self.settings.limits.max_attempts]
        last_error: GatewayError | None = None
        for attempt, target in enumerate(attempts, 1):
            if attempt > 1:
                if not self.health.try_retry(time.monotonic()):
                    break
                self.metrics.failovers.inc()
            try:
                reply = await self.open_target(target, parsed, forward, request_id)
            except (PoolTimeout, UpstreamConnectError) as exc:
                last_error = exc
                continue
            except (NoHealthyUpstream, Overloaded) as exc:  # the engine is closed or its queue is full
                last_error = exc
                continue
            if reply.status >= 500 and attempt < len(attempts):
                await reply.aclose()
                continue
            return reply, target, attempt
        message = f"no endpoint for model '{parsed.model}' could be reached"
        if last_error is not None:
            message += f" (last error: {last_error.message})"
            retry_after = last_error.retry_after or self.settings.limits.retry_after_s
        else:
            retry_after = self.settings.limits.retry_after_s
        raise NoHealthyUpstream(message, retry_after=retry_after)

    async def open_target(
        self, target: Target, parsed: ParsedRequest, forward: list[tuple[bytes, bytes]], request_id: str
    ) -> Reply:
        if parsed.model != target.model:
            parsed = parsed.with_fields(model=target.model)  # an alias resolved by routing
        limits = self.settings.limits
        if target.kind is TargetKind.EDGE:
            if self.edge is None:
                raise NoHealthyUpstream("no edge engine in this gateway", retry_after=limits.retry_after_s)
            return self.edge.reply(parsed.kind, parsed.data, request_id, limits.keepalive_interval_s)
        upstream = self.upstreams[target.endpoint]
        health = self.health
        now = time.monotonic()
        health.record_start(upstream.url, now)
        try:
            response = await upstream.request(_PATHS[parsed.kind], forward, parsed.body)
        except (PoolTimeout, UpstreamConnectError) as exc:
            kind = "pool_timeout" if isinstance(exc, PoolTimeout) else "connect"
            self.metrics.upstream_errors.labels(upstream.url, kind).inc()
            health.record_end(upstream.url, False, 0, time.monotonic() - now, time.monotonic())
            raise
        except GatewayError:
            health.record_end(upstream.url, False, 0, time.monotonic() - now, time.monotonic())
            raise
        except BaseException:  # cancelled (a hedge's loser, a client gone): not the endpoint's fault
            health.record_end(upstream.url, True, 0, time.monotonic() - now, time.monotonic())
            raise
        reply = UpstreamReply(
            response, upstream, health, now, limits.keepalive_interval_s, limits.max_event_bytes, limits.max_response_bytes
        )
        self.metrics.upstream_requests.labels(upstream.url, response.protocol).inc()
        if response.status >= 500:
            self.metrics.upstream_errors.labels(upstream.url, f"http_{response.status}").inc()
            reply.end(False, 0)
        return reply

    def record_first_token(self, reply: Reply, ttft: float) -> None:
        if reply.upstream is not None:
            self.health.record_first_token(reply.upstream.url, ttft, time.monotonic())

    def record_end(self, reply: Reply, ok: bool, chunks: int, duration: float) -> None:
        if isinstance(reply, UpstreamReply):
            reply.end(ok, chunks, duration)


async def _first_byte(opening, stream: bool) -> tuple[Reply, Target, int]:
    """Open a reply and, for a stream, wait for its first events (kept in ``reply.first``)."""
    result = await opening
    reply = result[0]
    if not stream or reply.status >= 400:
        return result
    try:
        events = None
        while events is None:
            events = await reply.next_events()
        reply.first = events
    except BaseException:
        await reply.aclose()
        raise
    return result


async def _race(primary: asyncio.Future, hedge: asyncio.Future) -> tuple[Reply, Target, int]:
    """Whichever attempt gets a good first byte first wins; the other is cancelled."""
    pending = {primary, hedge}
    winner = None
    error: BaseException | None = None
    try:
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    error = error or task.exception()
                elif winner is None and task.result()[0].status < 500:
                    winner = task.result()
                else:
                    await task.result()[0].aclose()
    finally:
        for task in pending:
            task.cancel()
            try:
                result = await task
            except BaseException:
                continue
            await result[0].aclose()
    if winner is None:
        raise error if error is not None else NoHealthyUpstream("neither the request nor its hedge got an answer")
    return winner
