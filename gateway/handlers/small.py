"""The small GETs: ``/v1/models``, ``/healthz``, ``/readyz``, ``/metrics`` and JSON views
such as ``/debug/latency``."""

from __future__ import annotations

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import request_id_of
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
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def __call__(self, scope, receive, send) -> None:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": c} for m, c in self.fleet.models()]
        edge = edge_mode(self.fleet)
        for entry in data:
            if entry["owned_by"] == "edge" and edge is not None:
                entry["metadata"] = edge  # the edge engine's mode (what edge.dtype: auto picked)
        await _send_json(send, 200, {"object": "list", "data": data}, [(b"x-request-id", request_id_of(scope["headers"]))])


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
