"""Which upstream serves a model, and opening a response on it with failover.

Failover happens only before the first byte of a response: a connect error, a pool
timeout or a 5xx answer moves the request to the next endpoint of the cluster, up to
``limits.max_attempts`` endpoints. Once a response is chosen it is the caller's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import orjson

from gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyUpstream,
    PoolTimeout,
    UpstreamConnectError,
)
from gateway.observability import Metrics
from gateway.settings import ClusterSettings, Settings
from gateway.upstream import Upstream, UpstreamResponse

__all__ = ["Cluster", "Dispatcher"]

logger = logging.getLogger("edgegw.dispatch")


class Cluster:
    def __init__(self, settings: ClusterSettings, upstreams: list[Upstream]) -> None:
        self.name = settings.name
        self.settings = settings
        self.upstreams = upstreams
        self.models: set[str] = set(settings.models)
        self.discovers = not settings.models
        self._turn = itertools.count()

    def candidates(self, now: float) -> list[Upstream]:
        """Available endpoints, starting at the next in turn (round robin)."""
        upstreams = self.upstreams
        start = next(self._turn) % len(upstreams)
        ordered = upstreams[start:] + upstreams[:start]
        return [u for u in ordered if u.is_available(now)]

    async def discover(self) -> None:
        """Refresh the model list from the endpoints' ``GET /v1/models``."""
        found: set[str] = set()
        for upstream in self.upstreams:
            try:
                response = await upstream.client.get("/v1/models")
                if response.status_code == 200:
                    found.update(m["id"] for m in orjson.loads(response.content).get("data", []) if "id" in m)
            except Exception as exc:  # discovery is best effort: an endpoint that is down lists nothing
                logger.warning("model discovery on %s failed: %s", upstream.url, exc)
        if found or not self.models:
            self.models = found


class Dispatcher:
    """The clusters, their upstreams, and the model -> cluster table."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.clusters: list[Cluster] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        high_water = self.settings.limits.stream_buffer_bytes
        for cluster_settings in self.settings.clusters:
            upstreams = [Upstream(e, cluster_settings.name, high_water=high_water) for e in cluster_settings.endpoints]
            self.clusters.append(Cluster(cluster_settings, upstreams))
        await asyncio.gather(*(u.pool.warm() for c in self.clusters for u in c.upstreams))
        discovering = [c for c in self.clusters if c.discovers]
        await asyncio.gather(*(c.discover() for c in discovering))
        for cluster in discovering:
            self._tasks.append(asyncio.create_task(self._rediscover(cluster)))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(u.aclose() for c in self.clusters for u in c.upstreams), return_exceptions=True)

    async def _rediscover(self, cluster: Cluster) -> None:
        while True:
            await asyncio.sleep(cluster.settings.discovery_interval_s)
            await cluster.discover()

    def models(self) -> list[tuple[str, str]]:
        """(model, cluster) pairs, in configuration order."""
        return [(m, c.name) for c in self.clusters for m in sorted(c.models)]

    def cluster_for(self, model: str) -> Cluster:
        for cluster in self.clusters:
            if model in cluster.models:
                return cluster
        raise ModelNotFound(f"the model '{model}' does not exist or is not served here", param="model")

    def is_ready(self) -> bool:
        now = time.monotonic()
        return any(c.models and c.candidates(now) for c in self.clusters)

    async def open(
        self, cluster: Cluster, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[UpstreamResponse, Upstream, int]:
        """A response from the first endpoint that answers without a 5xx; returns it, its
        upstream and the number of attempts made."""
        now = time.monotonic()
        candidates = cluster.candidates(now)
        retry_after = self.settings.limits.retry_after_s
        if not candidates:
            raise NoHealthyUpstream(f"no healthy endpoint in cluster '{cluster.name}'", retry_after=retry_after)
        attempts = candidates[: self.settings.limits.max_attempts]
        last_error: GatewayError | None = None
        for attempt, upstream in enumerate(attempts, 1):
            if attempt > 1:
                self.metrics.failovers.inc()
            try:
                response = await upstream.request(path, headers, body)
            except PoolTimeout as exc:
                self.metrics.upstream_errors.labels(upstream.url, "pool_timeout").inc()
                last_error = exc
                continue
            except UpstreamConnectError as exc:
                self.metrics.upstream_errors.labels(upstream.url, "connect").inc()
                upstream.record_failure(time.monotonic())
                last_error = exc
                continue
            if response.status >= 500:
                self.metrics.upstream_errors.labels(upstream.url, f"http_{response.status}").inc()
                upstream.record_failure(time.monotonic())
                if attempt < len(attempts):
                    response.close()
                    continue
                return response, upstream, attempt  # the last one's 5xx is passed through
            upstream.record_success()
            return response, upstream, attempt
        message = f"no endpoint of cluster '{cluster.name}' could be reached"
        if last_error is not None:
            message += f" (last error: {last_error.message})"
        raise NoHealthyUpstream(message, retry_after=retry_after)
