"""Polling the inference servers' own load: ``GET <origin>/metrics`` -> ``HealthState``.

Each endpoint whose ``load_source`` is known (``vllm``, ``sglang``, ``llamacpp``, set in
its settings or detected from the ``owned_by`` of the model list that discovery fetches
anyway) is polled every ``routing.load.poll_interval_s`` through the endpoint's control
pool (the two connections that probes and discovery use, so a pool full of streams never
delays a poll, and a poll never takes a stream's connection), with the gateway's own
HTTP client on it (``pool_fetch``), not httpx's. The text is
read by ``routing.signals.read_load`` and handed to ``HealthState.record_load``; a poll
that fails or times out records nothing, and the last reading ages out of routing after
``routing.load.stale_after_s`` by itself.

What it never does: poll an endpoint whose source is ``none`` or unknown. llama-cpp-python's
server ends its running generation when any request arrives, and hosted APIs have no
such metrics; auto-detection sends no request of its own.

Cheap for both sides: one small GET per endpoint per interval (the servers render their
registry; the gateway splits only the lines of its source's prefix), the polls of all
endpoints run concurrently, and nothing is polled while no endpoint has a source.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from gateway.upstream.base import Pool
from gateway.upstream.transport import get_read
from routing import HealthState
from routing.config import LoadConfig
from routing.signals import LOAD_SOURCES, MetricsError, ServerLoad, read_load

__all__ = ["Fetch", "LoadPoller", "PolledEndpoint", "httpx_fetch", "pool_fetch"]

logger = logging.getLogger("edgegw.load")

# GET a path on the server's origin -> (status, body); raises on a transport failure
Fetch = Callable[[str], Awaitable[tuple[int, bytes]]]

MAX_METRICS_BYTES = 8 << 20  # a server's whole registry, histograms included, fits many times over


def pool_fetch(pool: Pool, headers: list[tuple[bytes, bytes]], timeout: float) -> Fetch:
    """GET through one of the gateway's own pools (the endpoint's control pool): a few
    tens of microseconds of CPU, where httpx's client costs about a millisecond."""

    async def fetch(path: str) -> tuple[int, bytes]:
        response = await pool.request(b"GET", path.encode(), headers, b"", timeout)
        try:
            return response.status, await response.body.read_all(timeout, MAX_METRICS_BYTES)
        finally:
            await response.aclose()

    return fetch


def httpx_fetch(client: httpx.AsyncClient) -> Fetch:
    """GET with an httpx client whose ``base_url`` is the server's origin."""

    async def fetch(path: str) -> tuple[int, bytes]:
        response = await get_read(client, path)
        return response.status_code, response.content

    return fetch


@dataclass(slots=True)
class PolledEndpoint:
    url: str  # the endpoint's id in HealthState
    fetch: Fetch  # GET on the server's origin
    source: str | None  # vllm | sglang | llamacpp; None: not polled (none, or not detected yet)
    path: str = "/metrics"
    auto: bool = False  # the source comes from discovery's owned_by
    failures: int = 0  # consecutive failed polls (logged once per run of failures)
    polls: int = 0


class LoadPoller:
    """Polls the endpoints' metrics and feeds ``health``; ``run()`` is its one task."""

    def __init__(
        self, health: HealthState, config: LoadConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.health = health
        self.config = config
        self.clock = clock
        self.endpoints: dict[str, PolledEndpoint] = {}
        self._changed = asyncio.Event()

    def add(self, url: str, fetch: Fetch | httpx.AsyncClient, source: str, path: str = "/metrics") -> None:
        """An endpoint with ``source`` from its settings: ``auto`` (from discovery),
        ``none`` (never polled) or a server kind; ``fetch``: how to GET on its origin
        (``pool_fetch`` of its control pool, or an httpx client)."""
        if isinstance(fetch, httpx.AsyncClient):
            fetch = httpx_fetch(fetch)
        if source not in LOAD_SOURCES and source != "auto":
            raise ValueError(f"load_source must be auto or one of {', '.join(LOAD_SOURCES)}, not {source!r}")
        polled = None if source in ("auto", "none") else source
        self.endpoints[url] = PolledEndpoint(url, fetch, polled, path, auto=source == "auto")
        self._changed.set()

    def detected(self, url: str, source: str | None) -> None:
        """Discovery read the endpoint's model list: ``source`` is what its ``owned_by``
        names (``routing.signals.detect_source``). Only endpoints set to ``auto`` follow it."""
        e = self.endpoints.get(url)
        if e is None or not e.auto or e.source == source:
            return
        e.source = source
        if source is not None:
            logger.info("load source of %s: %s (detected from its model list)", url, source)
        self._changed.set()

    async def poll(self, e: PolledEndpoint) -> ServerLoad | None:
        """One poll of ``e``; the reading is recorded in ``health`` and returned (None: no
        answer, an error status, or text without the source's metrics)."""
        source = e.source
        if source is None:
            return None
        h = self.health.endpoint(e.url)
        inflight = h.inflight  # before the request: the server's counts are from about now
        try:
            status, body = await asyncio.wait_for(e.fetch(e.path), self.config.poll_timeout_s)
            if status != 200:
                raise MetricsError(f"GET {e.path} answered {status}")
            load = read_load(source, body.decode(), self.clock(), inflight=inflight, previous=h.load)
        except (asyncio.TimeoutError, httpx.HTTPError, OSError, MetricsError, UnicodeDecodeError) as exc:
            if e.failures == 0:
                why = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
                logger.warning("load poll of %s%s failed: %s", e.url, e.path, why)
            e.failures += 1
            return None
        except Exception as exc:  # a pool's own error types: same as a failed poll
            if e.failures == 0:
                logger.warning("load poll of %s%s failed: %s", e.url, e.path, exc)
            e.failures += 1
            return None
        if e.failures:
            logger.info("load poll of %s answers again", e.url)
        e.failures = 0
        e.polls += 1
        self.health.record_load(e.url, load, load.at)
        return load

    async def poll_all(self) -> list[ServerLoad | None]:
        """Poll every endpoint with a source, concurrently."""
        due = [e for e in self.endpoints.values() if e.source is not None]
        return list(await asyncio.gather(*(self.poll(e) for e in due)))

    async def run(self) -> None:
        """Poll every ``poll_interval_s`` (sleeping until some endpoint has a source)."""
        interval = self.config.poll_interval_s
        while True:
            if not any(e.source is not None for e in self.endpoints.values()):
                self._changed.clear()
                await self._changed.wait()
                continue
            started = self.clock()
            await self.poll_all()
            await asyncio.sleep(max(0.0, interval - (self.clock() - started)))

    def __repr__(self) -> str:
        polled = sum(e.source is not None for e in self.endpoints.values())
        return f"<LoadPoller endpoints={len(self.endpoints)} polled={polled}>"
