"""The fleet under a new configuration (a live reload): clusters, endpoints, routing.

``prepare`` builds what the new configuration needs that may fail (the pools of added or
changed endpoints, a new GeoIP database) without touching the running fleet; ``commit``
then swaps it all in at once, between two requests:

- an endpoint that stays with the same settings keeps its pool, its queue (requests
  waiting keep their places; a new ``max_concurrency`` applies at once) and what routing
  has measured of it;
- an added endpoint gets a pool (warmed in the background) and a queue; a changed one a new
  pool under the same queue;
- a removed endpoint leaves routing at once (new requests are never sent there), but its
  pool and queue stay for the requests that were routed to it before (and their fallbacks
  and hedges) until ``retire`` closes them, once every request admitted under the old
  configuration has finished (``gateway.admission.Generation``): in-flight streams finish;
- clusters whose models are discovered keep what their remaining endpoints listed, and are
  asked again at once;
- routing's table is rebuilt; its health, balancer and load settings retuned in place.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from gateway.core.settings import Settings
from gateway.pipeline.fleet import ClusterPool, Fleet, _open_geo
from gateway.pipeline.queue import TargetQueue
from gateway.upstream import Upstream
from gateway.upstream.load import pool_fetch

__all__ = ["FleetChange", "commit", "prepare", "retire"]


@dataclass
class FleetChange:
    """What a reload does to the fleet: built by ``prepare``, applied by ``commit``, its
    leftovers closed by ``retire``."""

    settings: Settings
    upstreams: dict[str, Upstream]  # URL -> the pool it uses from now on
    built: list[Upstream] = field(default_factory=list)  # of those, the new ones
    geo: object = None  # a new GeoIP database (None: the same)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    retired: list[Upstream] = field(default_factory=list)  # pools closed by ``retire``
    old_geo: object = None

    def summary(self) -> str:
        parts = [f"{word} {', '.join(urls)}" for word, urls in (("added", self.added), ("removed (draining)", self.removed), ("changed", self.changed)) if urls]
        return "; ".join(parts)


async def prepare(fleet: Fleet, settings: Settings) -> FleetChange:
    """Build the new pools and GeoIP database; raises (and closes what it built) when one
    cannot be made. The running fleet is untouched."""
    change = FleetChange(settings, {})
    high_water = settings.limits.stream_buffer_bytes
    try:
        for cluster in settings.clusters:
            for endpoint in cluster.endpoints:
                if endpoint.url in change.upstreams:
                    continue
                current = fleet.upstreams.get(endpoint.url)
                if current is not None and current.settings == endpoint and current.cluster == cluster.name:
                    change.upstreams[endpoint.url] = current
                else:
                    upstream = change.upstreams[endpoint.url] = Upstream(endpoint, cluster.name, high_water=high_water)
                    change.built.append(upstream)
        if settings.routing.geoip_db != fleet.routing.geoip_db:
            change.geo = await asyncio.to_thread(_open_geo, settings.routing)
    except BaseException:
        await asyncio.gather(*(u.aclose() for u in change.built), return_exceptions=True)
        raise
    return change


def commit(fleet: Fleet, change: FleetChange) -> None:
    """Swap the new configuration in (nothing here awaits: no request sees half of it)."""
    settings = change.settings
    old = fleet.upstreams
    change.added = [url for url in change.upstreams if url not in old]
    change.removed = [url for url in old if url not in change.upstreams]
    change.changed = [url for url in change.upstreams if url in old and change.upstreams[url] is not old[url]]
    change.retired = [u for url, u in old.items() if change.upstreams.get(url) is not u]
    for upstream in change.retired:
        if upstream.url not in change.upstreams:
            fleet.retired_upstreams[upstream.url] = upstream
    old.clear()
    old.update(change.upstreams)  # in place: others hold the dict

    admission = settings.admission
    queues: dict[str, TargetQueue] = {}
    for cluster in settings.clusters:
        for endpoint in cluster.endpoints:
            max_limit = endpoint.max_concurrency or endpoint.pool_size
            queue = fleet.queues.get(endpoint.url)
            if queue is None:
                queue = TargetQueue(
                    endpoint.url, endpoint.max_concurrency, adaptive=endpoint.adaptive, max_limit=max_limit,
                    ageing_s=admission.ageing_s, max_queue=admission.max_queue,
                )
            else:
                queue.reconfigure(
                    endpoint.max_concurrency, adaptive=endpoint.adaptive, max_limit=max_limit,
                    ageing_s=admission.ageing_s, max_queue=admission.max_queue,
                )
            queues[endpoint.url] = queue
    edge = fleet.queues.get("edge")
    if edge is not None:
        edge.reconfigure(
            settings.edge.max_concurrency or settings.edge.max_num_seqs, adaptive=False, max_limit=None,
            ageing_s=admission.ageing_s, max_queue=admission.max_queue,
        )
        queues["edge"] = edge
    for url in change.removed:
        fleet.retired_queues[url] = fleet.queues[url]
    fleet.queues.clear()
    fleet.queues.update(queues)

    clusters = _clusters(fleet, settings, change.upstreams)
    for cluster, task in list(fleet.discovery.items()):
        if cluster not in clusters:
            task.cancel()
            del fleet.discovery[cluster]
    fleet.clusters[:] = clusters

    fleet.settings = settings
    fleet.routing = settings.routing
    fleet.health.retune(settings.routing)
    fleet.load.config = settings.routing.load
    for url in change.removed:
        fleet.load.endpoints.pop(url, None)
    for url in (*change.added, *change.changed):
        upstream = change.upstreams[url]
        auth = [h for h in upstream.headers if h[0] == b"authorization"]
        fetch = pool_fetch(upstream.control, auth, settings.routing.load.poll_timeout_s)
        fleet.load.add(url, fetch, upstream.settings.load_source, upstream.settings.metrics_path)
    if change.geo is not None:
        change.old_geo, fleet.geo = fleet.geo, change.geo
    fleet.build_table()

    for upstream in change.built:
        fleet.spawn(upstream.pool.warm())
    for cluster in clusters:
        if cluster.discovers and cluster not in fleet.discovery:
            fleet.discovery[cluster] = fleet.spawn(fleet._discover(cluster, asyncio.Event()))
    fleet.start_loops()


def _clusters(fleet: Fleet, settings: Settings, upstreams: dict[str, Upstream]) -> list[ClusterPool]:
    old = {c.name: c for c in fleet.clusters}
    clusters = []
    for cluster_settings in settings.clusters:
        pools = [upstreams[e.url] for e in cluster_settings.endpoints]
        current = old.get(cluster_settings.name)
        if current is not None and current.settings == cluster_settings and all(a is b for a, b in zip(current.upstreams, pools)):
            clusters.append(current)
            continue
        cluster = ClusterPool(cluster_settings, pools)
        if current is not None and cluster.discovers:  # keep what the remaining endpoints listed
            urls = {u.url for u in pools}
            cluster._listed = {url: models for url, models in current._listed.items() if url in urls}
            cluster.detected = {url: source for url, source in current.detected.items() if url in urls}
            cluster.models = tuple(sorted(set().union(*cluster._listed.values())))
        clusters.append(cluster)
    return clusters


async def retire(fleet: Fleet, change: FleetChange) -> None:
    """Close what only requests admitted before the reload could use (call once they have
    all finished): the removed and replaced pools, the removed queues, the old GeoIP
    database, the removed endpoints' health records."""
    for upstream in change.retired:
        if fleet.retired_upstreams.get(upstream.url) is upstream:
            del fleet.retired_upstreams[upstream.url]
    for url in change.removed:
        if url not in fleet.upstreams:
            fleet.retired_queues.pop(url, None)
            fleet.health.forget(url)
    await asyncio.gather(*(u.aclose() for u in change.retired), return_exceptions=True)
    if change.old_geo is not None:
        with contextlib.suppress(Exception):
            change.old_geo.close()
