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
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from gateway.admission import AdmissionApp, Gate
from gateway.core.errors import error_body
from gateway.core.openai import CHAT, COMPLETIONS
from gateway.core.settings import Settings
from gateway.handlers import CompletionsApp, HealthzApp, JSONApp, MetricsApp, ModelsApp, ReadyzApp, WebSocketApp
from gateway.node.siblings import Node, Siblings
from gateway.observe import Diagnosis, Metrics, Observer, SLOs
from gateway.observe.dashboard import DashboardApp, live_snapshot
from gateway.pipeline import CacheLayer, Dispatcher, Fleet, Pipeline

__all__ = ["Gateway", "GatewayApp", "create_app"]

logger = logging.getLogger("edgegw")


class Gateway:
    """Everything the running gateway holds, built once and started by the lifespan."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None, node: Node | None = None) -> None:
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
        self.gate = Gate(settings, metrics, self.observer, tracing)
        self.dispatcher = Dispatcher(self.fleet, metrics, on_shed=self.gate.shed_for_capacity)
        self.cache = CacheLayer(settings.cache, metrics.registry)
        self.pipeline = Pipeline(self.dispatcher, self.cache, settings.limits.keepalive_interval_s)
        self.started = False

    async def start(self) -> None:
        await self.fleet.start()
        self.metrics.watch(self.fleet.gauges)
        self.metrics.watch(self.slos.gauges)
        self.metrics.watch(self.diagnosis_gauges)
        if self.node is not None:
            self.metrics.watch(self.worker_gauges)
            self.node.beat()  # the parent's proof that this worker's loop runs
        await self.slos.start()
        await self.cache.start()
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

    def worker_gauges(self):
        yield "edgegw_worker_pid", "The process id of the worker (one series per worker of the node).", {}, os.getpid()

    def diagnosis_gauges(self):
        for target in self.latency()["targets"]:
            verdict = target["diagnosis"]["verdict"]
            yield "edgegw_diagnosis", "The target's bottleneck diagnosis (1 for its current verdict).", {"target": target["name"], "verdict": verdict}, 1.0

    async def aclose(self) -> None:
        self.gate.drain()
        await self.slos.aclose()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
        await self.cache.aclose()
        await self.gate.limiter.aclose()
        await self.fleet.aclose()
        if self.siblings is not None:
            await self.siblings.aclose()


class GatewayApp:
    def __init__(self, gateway: Gateway, app: Starlette, completions: dict[str, AdmissionApp]) -> None:
        self.gateway = gateway
        self.app = app
        self._completions = completions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._completions.get(scope["path"])
            if handler is not None:
                return await handler(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(settings: Settings, *, metrics: Metrics | None = None, node: Node | None = None) -> GatewayApp:
    """``node``: this worker's place on a node of several (``gateway.node.workers``); None for a
    single-process gateway."""
    gateway = Gateway(settings, metrics, node)

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
        Route("/v1/models", ModelsApp(gateway.fleet), methods=["GET"]),
        Route("/healthz", HealthzApp(), methods=["GET"]),
        Route("/readyz", ReadyzApp(gateway), methods=["GET"]),
        Route("/metrics", MetricsApp(gateway.metrics, gateway.siblings), methods=["GET"]),
        Route("/debug/latency", JSONApp(gateway.latency), methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/dashboard/feed", dashboard, methods=["GET"]),
        WebSocketRoute("/v1/ws", AdmissionApp(WebSocketApp(pipeline, gate, gateway.metrics), gate, "ws", None)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _http_error, 405: _http_error})
    # Starlette answers "/v1/models/" with a redirect built from the client's Host header
    # (Host: evil.example -> http://evil.example/v1/models): a 404 here, never a redirect
    app.router.redirect_slashes = False
    return GatewayApp(gateway, app, completions)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    message = f"no route for {request.method} {request.url.path}"
    return Response(
        error_body(message, "invalid_request_error", None, code),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers,
    )
