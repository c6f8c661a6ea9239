"""``create_app(settings)``: the Starlette application and its lifespan.

The lifespan owns everything with a connection or a thread: the upstream pools (opened and
warmed before the first request), later the cache, the geo database and the edge engine.
On shutdown (after uvicorn has stopped accepting and let in-flight streams finish, up to
``limits.drain_timeout_s``) it closes them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from gateway import endpoints
from gateway.errors import error_body
from gateway.observability import Metrics
from gateway.protocol import CHAT, COMPLETION
from gateway.settings import Settings
from gateway.state import State
from gateway.websocket import WebSocketEndpoint

__all__ = ["create_app"]

logger = logging.getLogger("edgegw")


def create_app(settings: Settings, *, metrics: Metrics | None = None) -> FastPath:
    state = State(settings, metrics or Metrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        logger.info(
            "edgegw ready: %d cluster(s), models: %s",
            len(state.dispatcher.clusters),
            ", ".join(m for m, _ in state.dispatcher.models()) or "(none yet)",
        )
        try:
            yield
        finally:
            state.draining = True
            await state.aclose()

    routes = [
        Route("/v1/chat/completions", endpoints.CompletionsEndpoint(state, CHAT), methods=["POST"]),
        Route("/v1/completions", endpoints.CompletionsEndpoint(state, COMPLETION), methods=["POST"]),
        Route("/v1/models", endpoints.Models(state), methods=["GET"]),
        Route("/healthz", endpoints.Healthz(state), methods=["GET"]),
        Route("/readyz", endpoints.Readyz(state), methods=["GET"]),
        Route("/metrics", endpoints.MetricsEndpoint(state), methods=["GET"]),
        WebSocketRoute("/v1/ws", WebSocketEndpoint(state)),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: _http_error, 405: _http_error},
    )
    app.state.gateway = state
    return FastPath(app, {path: route.app for route in routes[:2] for path in [route.path]})


class FastPath:
    """``POST`` to a completion path goes straight to its endpoint; everything else
    (lifespan, WebSocket, the small GETs, 404/405) through Starlette. The completion
    endpoints handle their own errors, so Starlette's routing and middleware layers are
    pure per-request cost on the hot path (BENCHMARKS.md)."""

    def __init__(self, app: Starlette, completions: dict[str, object]) -> None:
        self.app = app
        self.state = app.state
        self._completions = completions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._completions.get(scope["path"])
            if endpoint is not None:
                return await endpoint(scope, receive, send)
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else "method_not_allowed"
    message = f"no route for {request.method} {request.url.path}"
    return Response(
        error_body(message, "invalid_request_error", None, code),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers,
    )
