"""The small GETs: ``/v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` and JSON views
such as ``/debug/latency``."""

from __future__ import annotations

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import Tenants, request_id_of
from gateway.core.context import LISTENING
from gateway.core.errors import GatewayError, ModelNotFound, send_error
from gateway.core.tenant import Tenant
from gateway.observe import Metrics
from gateway.observe.node_metrics import WORKER_SCOPE, SiblingExpositions, node_families
from gateway.pipeline import Fleet

__all__ = ["HealthzApp", "JSONApp", "MetricsApp", "ModelsApp", "ReadyzApp"]

_JSON = (b"content-type", b"application/json")


async def _send_json(send, status: int, payload: object, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ModelsApp:
    """``GET /v1/models`` and ``GET /v1/models/{id}``: what the caller's key may ask for (the
    aliases such as ``auto``, the edge model, every cluster's models), behind the same keys
    as the completions (401 by ``auth.mode``); a model it may not use is not there (404)."""

    def __init__(self, fleet: Fleet, tenants: Tenants) -> None:
        self.fleet = fleet
        self.tenants = tenants

    def catalogue(self, tenant: Tenant) -> dict[str, dict]:
        models: dict[str, dict] = {}
        table = self.fleet.table
        served = set(table.models()) if table is not None else set()
        aliases = [a for a in table.config.aliases if a in served] if table is not None else []
        for model, owner in [*((a, "edgegw") for a in aliases), *self.fleet.models()]:
            if model not in models and (not tenant.policy.models or model in tenant.policy.models):
                models[model] = {"id": model, "object": "model", "created": 0, "owned_by": owner}
        edge = edge_mode(self.fleet)
        for entry in models.values():
            if entry["owned_by"] == "edge" and edge is not None:
                entry["metadata"] = edge  # the edge engine's mode (what edge.dtype: auto picked)
        return models

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"x-request-id", request_id_of(scope["headers"]))]
        try:
            tenant = self.tenants.identify(scope["headers"])
        except GatewayError as exc:
            await send_error(send, exc, headers)
            return
        models = self.catalogue(tenant)
        wanted = scope.get("path_params", {}).get("model")
        if wanted is None:
            await _send_json(send, 200, {"object": "list", "data": list(models.values())}, headers)
        elif not wanted:  # "/v1/models/": no model named, no route (never a redirect)
            await send_error(send, ModelNotFound("no route for GET /v1/models/", code="not_found"), headers)
        elif wanted in models:
            await _send_json(send, 200, models[wanted], headers)
        else:
            error = ModelNotFound(f"The model '{wanted}' does not exist or you do not have access to it.", param="model")
            await send_error(send, error, headers)


def edge_mode(fleet: Fleet) -> dict | None:
    """The edge engine's mode and why (``edge.dtype: auto``'s pick), from its stats; None
    without an engine, or before an engine process has answered."""
    snapshot = fleet.edge.snapshot() if fleet.edge is not None else None
    if not snapshot or "dtype" not in snapshot:
        return None
    return {"dtype": snapshot["dtype"], "dtype_reason": snapshot.get("dtype_reason", ""), "device": snapshot.get("device")}


class HealthzApp:
    async def __call__(self, scope, receive, send) -> None:
        await _send_json(send, 200, {"status": "ok"})


class ReadyzApp:
    """200 when the gateway can serve something; 503 while starting, draining or shedding
    for capacity, so a load balancer steers away."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway  # gateway.node.app.Gateway

    async def __call__(self, scope, receive, send) -> None:
        gateway = self.gateway
        edge = edge_mode(gateway.fleet) if gateway.started else None
        extra = {"edge": edge} if edge is not None else {}
        if gateway.gate.draining:
            await _send_json(send, 503, {"status": "draining", **extra})
        elif gateway.gate.shedding:
            await _send_json(send, 503, {"status": "shedding", **extra})
        elif scope.get("state", {}).get(LISTENING) is False:  # the server's other ports are being opened
            await _send_json(send, 503, {"status": "not ready", **extra})
        elif gateway.started and gateway.fleet.is_ready():
            await _send_json(send, 200, {"status": "ready", **extra})
        else:
            await _send_json(send, 503, {"status": "not ready", **extra})


class JSONApp:
    """A small GET answering what ``read()`` returns, as JSON."""

    def __init__(self, read) -> None:
        self.read = read

    async def __call__(self, scope, receive, send) -> None:
        await _send_json(send, 200, self.read())


class MetricsApp:
    """``GET /metrics``: this process's metrics or, on a node of workers (``siblings``), the
    node's (``gateway.observe.node_metrics``)."""

    def __init__(self, metrics: Metrics, siblings: SiblingExpositions | None = None) -> None:
        self.metrics = metrics
        self.siblings = siblings

    async def __call__(self, scope, receive, send) -> None:
        body = generate_latest(self.metrics.registry)
        if self.siblings is not None and WORKER_SCOPE not in scope["headers"]:
            body = generate_latest(_Families(await node_families(self.siblings, body.decode())))
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _Families:
    """Metric families already collected, as ``generate_latest`` reads a registry."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return self._families
