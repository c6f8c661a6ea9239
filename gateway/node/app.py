"""``create_app(settings)``: the gateway as one ASGI application, and its lifespan.

``Gateway`` holds what runs: the admission ``Gate``, the ``Fleet`` (pools, engine, routing
state), the ``Dispatcher``, the cache layer and the ``Pipeline`` over them. The lifespan
starts them before the first request and, on shutdown (after uvicorn has stopped accepting
and let in-flight streams finish, up to ``limits.drain_timeout_s``), closes them.

``GatewayApp`` sends ``POST`` to a completion path straight to its admitted handler;
everything else (lifespan, WebSocket, the small GETs, 404/405) goes through Starlette. The
completion handlers handle their own errors, so Starlette's routing and middleware layers
would be pure per-request cost on the hot path (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from urllib.parse import urlencode

import orjson

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from gateway.admission import AdminGuard, AdmissionApp, CORSMiddleware, Gate
from gateway.core.errors import error_body
from gateway.core.openai import CHAT, COMPLETIONS, PASSTHROUGH
from gateway.core.settings import PASSTHROUGH_PATHS, ConfigError, Settings
from gateway.handlers import CompletionsApp, HealthzApp, JSONApp, MetricsApp, ModelsApp, ReadyzApp, ReloadApp, UsageApp, WebSocketApp
from gateway.node import reload as reloading
from gateway.node.reload import ConfigSource, Reloader
from gateway.node.siblings import Node, Siblings
from gateway.observe import Diagnosis, Metrics, Observer, SLOs
from gateway.observe.dashboard import DashboardApp, live_snapshot
from gateway.observe.usage import Usage, merge_rows
from gateway.pipeline import CacheLayer, Dispatcher, Fleet, Pipeline

__all__ = ["Gateway", "GatewayApp", "create_app"]

logger = logging.getLogger("edgegw")


class Gateway:
    """Everything the running gateway holds, built once and started by the lifespan."""

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, node: Node | None = None, source: ConfigSource | None = None
    ) -> None:
        self.settings = settings
        self.node = node
        self.siblings = Siblings(node) if node is not None else None  # the node's /metrics
        self.metrics = metrics = metrics or Metrics()
        self.fleet = Fleet(settings, metrics, node.engine_socket if node is not None else None)
        self.slos = SLOs(settings.slo)
        self.diagnosis = Diagnosis(queue_of=self.fleet.queues.get, rtt_of=self.fleet.rtt_of)
        # traces need the tracing extra (the OpenTelemetry SDK): imported only when asked for
        tracing = None
        if settings.tracing.otlp_url:
            tracing = importlib.import_module("gateway.observe.tracing").Tracing(settings.tracing)
        self.fleet.tracing = self.tracing = tracing
        self.observer = Observer(metrics, self.slos, self.diagnosis, settings.listen.access_log, tracing)
        self.usage = self.observer.usage = Usage(settings.usage, metrics.registry)  # the tenants' tokens
        self.gate = Gate(settings, metrics, self.observer, tracing, usage=self.usage)
        self.dispatcher = Dispatcher(self.fleet, metrics, on_shed=self.gate.shed_for_capacity)
        self.cache = CacheLayer(settings.cache, metrics.registry)
        self.pipeline = Pipeline(self.dispatcher, self.cache, settings.limits.keepalive_interval_s)
        self.started = False
        self.admin: AdminGuard | None = None  # create_app puts it in front of the small routes
        self.reloader = Reloader(source, settings, self.reload)  # SIGHUP, POST /admin/reload, a changed file
        self._retiring: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.fleet.start()
        self.metrics.watch(self.fleet.gauges)
        self.metrics.watch(self.slos.gauges)
        self.metrics.watch(self.diagnosis_gauges)
        self.metrics.watch(self.gate_gauges)
        if self.node is not None:
            self.metrics.watch(self.worker_gauges)
            self.node.beat()  # the parent's proof that this worker's loop runs
        await self.slos.start()
        await self.cache.start()
        await self.usage.start()
        source, watch = self.reloader.source, self.settings.reload
        if self.node is None and source is not None and source.path is not None and watch.watch:
            self.fleet.spawn(self.reloader.watch(watch.interval_s))  # a node's parent watches for its workers
        self.started = True
        logger.info(
            "edgegw ready: %d cluster(s), models: %s",
            len(self.fleet.clusters),
            ", ".join(m for m, _ in self.fleet.models()) or "(being discovered)",
        )

    def latency(self) -> dict:
        """``GET /debug/latency``: per target, the last minute's stage percentiles, its queue and
        the diagnosis; the objectives and their burn rates."""
        targets = []
        clusters = {url: upstream.cluster for url, upstream in self.fleet.upstreams.items()}
        names = [*self.fleet.queues, *(t for t in self.diagnosis.targets() if t not in self.fleet.queues)]
        for name in names:
            kind = "edge" if name == "edge" else "endpoint"
            targets.append({"name": name, "kind": kind, "cluster": clusters.get(name), **self.diagnosis.view(name)})
        return {"time": time.time(), "targets": targets, "slo": self.slos.snapshot()}

    def gate_gauges(self):
        yield "edgegw_in_flight_requests", "Requests being served.", {}, self.gate.in_flight

    def worker_gauges(self):
        yield "edgegw_worker_pid", "The process id of the worker (one series per worker of the node).", {}, os.getpid()

    def diagnosis_gauges(self):
        for target in self.latency()["targets"]:
            verdict = target["diagnosis"]["verdict"]
            yield "edgegw_diagnosis", "The target's bottleneck diagnosis (1 for its current verdict).", {"target": target["name"], "verdict": verdict}, 1.0

    # -- live reload (gateway/node/reload.py) -------------------------------------------

    async def reload(self, new: Settings) -> str:
        return await reloading.apply(self, new)

    def retire(self, coro) -> None:
        """Run ``coro`` (it closes what a reload left to the requests admitted before it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def admin_reload(self, why: str) -> tuple[int, dict]:
        """``POST /admin/reload``: this process's reload, or on a node of workers, the file
        checked here and the parent asked (SIGHUP) to reload every process."""
        if self.node is None:
            outcome = await self.reloader.reload(why)
            return (200 if outcome.ok else 400), outcome.to_dict()
        source = self.reloader.source
        try:
            if source is None:
                raise ConfigError("no configuration file to read again (started without --config)")
            await asyncio.to_thread(source.load)
        except ConfigError as exc:
            return 400, {"status": "refused", "error": str(exc)}
        os.kill(os.getppid(), signal.SIGHUP)  # the supervisor: it reloads the workers and the engine
        return 202, {"status": "reloading", "workers": self.node.workers}

    async def usage_rows(self, start: float, end: float, tenant: str | None, worker_only: bool) -> list[dict]:
        """``GET /admin/usage``: from Redis (every replica's), or this process's memory plus,
        on a node of workers, its siblings'."""
        rows = await self.usage.query(start, end, tenant)
        if self.usage.shared or worker_only or self.siblings is None:
            return rows
        query = urlencode({"from": start, "to": end, **({"tenant": tenant} if tenant else {})}).encode()
        others = [i for i in range(self.node.workers) if i != self.node.index]
        answers = await asyncio.gather(*(self.siblings.get(i, b"/admin/usage?" + query) for i in others))
        return merge_rows(rows, *(orjson.loads(a)["data"] for a in answers if a is not None))

    async def aclose(self) -> None:
        self.gate.drain()
        await self.slos.aclose()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        for task in list(self._retiring):
            task.cancel()  # each closes what it holds as it ends
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.usage.aclose()
        await self.cache.aclose()
        await self.gate.limiter.aclose()
        await self.fleet.aclose()
        if self.siblings is not None:
            await self.siblings.aclose()


class GatewayApp:
    """``completions``: POST paths answered straight by their admitted handler (the pass-through
    ones' exact paths included); ``prefixes``: (path prefix, handler) for the pass-through
    paths ending in ``*``. With ``cors`` configured, ``CORSMiddleware`` is in front of it all."""

    def __init__(
        self,
        gateway: Gateway,
        app: Starlette,
        completions: dict[str, AdmissionApp],
        prefixes: tuple[tuple[str, AdmissionApp], ...] = (),
    ) -> None:
        self.gateway = gateway
        self.app = app
        self._completions = completions
        self._prefixes = prefixes
        cors = gateway.settings.cors
        self._entry = CORSMiddleware(self._route, cors) if cors.enabled else self._route

    async def __call__(self, scope, receive, send) -> None:
        await self._entry(scope, receive, send)

    async def _route(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            endpoint = self._completions.get(path)
            if endpoint is not None:
                return await endpoint(scope, receive, send)
            for prefix, endpoint in self._prefixes:
                if path.startswith(prefix) and len(path) > len(prefix):
                    return await endpoint(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(
    settings: Settings, *, metrics: Metrics | None = None, node: Node | None = None, source: ConfigSource | None = None
) -> GatewayApp:
    """``node``: this worker's place on a node of several (``gateway.node.workers``); None for a
    single-process gateway. ``source``: where the configuration is read again on a reload
    (None: it cannot be)."""
    gateway = Gateway(settings, metrics, node, source)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.aclose()

    pipeline, gate = gateway.pipeline, gateway.gate
    dashboard = DashboardApp(live_snapshot(gateway), stop=lambda: gate.draining)
    completions = {
        "/v1/chat/completions": AdmissionApp(CompletionsApp(pipeline, gateway.metrics), gate, "chat", CHAT),
        "/v1/completions": AdmissionApp(CompletionsApp(pipeline, gateway.metrics), gate, "completions", COMPLETIONS),
    }
    routes = [
        *(Route(path, app, methods=["POST"]) for path, app in completions.items()),
        Route("/v1/models", models := ModelsApp(gateway.fleet, gate.tenants), methods=["GET"]),
        Route("/v1/models/{model:path}", models, methods=["GET"]),
        Route("/healthz", HealthzApp(), methods=["GET"]),
        Route("/readyz", ReadyzApp(gateway), methods=["GET"]),
        Route("/metrics", MetricsApp(gateway.metrics, gateway.siblings), methods=["GET"]),
        Route("/debug/latency", JSONApp(gateway.latency), methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/feed", dashboard, methods=["GET"]),
        WebSocketRoute("/v1/ws", AdmissionApp(WebSocketApp(pipeline, gate, gateway.metrics), gate, "ws", None)),
        Route("/admin/reload", ReloadApp(gateway.admin_reload), methods=["POST"]),
        Route("/admin/usage", UsageApp(gateway.usage_rows, lambda: "redis" if gateway.usage.shared else "memory"), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _http_error, 405: _http_error})
    # Starlette answers "/v1/models/" with a redirect built from the client's Host header
    # (Host: evil.example -> http://evil.example/v1/models): a 404 here, never a redirect
    app.router.redirect_slashes = False
    # the other OpenAI APIs, forwarded by model with the same admission, limits and accounting
    passthrough = AdmissionApp(CompletionsApp(pipeline, gateway.metrics), gate, "passthrough", PASSTHROUGH)
    paths = dict.fromkeys((*PASSTHROUGH_PATHS, *settings.passthrough))
    exact = {path: passthrough for path in paths if not path.endswith("*") and path not in completions}
    prefixes = tuple((path[:-1], passthrough) for path in paths if path.endswith("*"))
    gateway.admin = AdminGuard(app, settings)  # /metrics, /debug, /dashboard, /admin/*: listen.admin, admin.keys
    return GatewayApp(gateway, gateway.admin, {**completions, **exact}, prefixes)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    message = f"no route for {request.method} {request.url.path}"
    return Response(
        error_body(message, "invalid_request_error", None, code),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers,
    )
