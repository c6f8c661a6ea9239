"""A routing decision in words: what ``edgegw explain`` prints and ``x-edgegw-route`` sums up.

``explain(...)`` runs client address -> location -> request features -> ``decide`` in one
call, with no gateway running: fresh health (nothing measured, every breaker closed) unless
one is passed. ``describe(decision)`` renders a decision as the lines an operator reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .config import RoutingConfig
from .features import budget_of, request_from_openai
from .geo import GeoLocator
from .health import HealthState
from .policy import decide, locate_client
from .table import RoutingTable
from .types import ClusterSpec, EdgeStats, RouteDecision, Target, TargetKind

__all__ = ["describe", "explain"]


def explain(
    config: RoutingConfig,
    clusters: Sequence[ClusterSpec],
    peer_ip: str,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    now: float,
    *,
    edge_model: str | None = None,
    edge: EdgeStats | None = None,
    health: HealthState | None = None,
    geo: GeoLocator | None = None,
) -> RouteDecision:
    """Resolve the client, locate it, extract features and decide, in one call.

    With no ``geo`` the configured database (or the embedded DB-IP) is opened for the call
    and closed after; pass a ``GeoLocator`` to reuse one.
    """
    table = RoutingTable.build(config, clusters, edge_model)
    if health is None:
        health = HealthState.from_config(config, table.endpoint_ids())
    own_geo = geo is None
    locator = GeoLocator.open(config.geoip_db) if own_geo else geo
    try:
        ip, location = locate_client(table, locator, peer_ip, headers)
    finally:
        if own_geo and locator is not None:
            locator.close()
    request = request_from_openai(body, headers, config, client_ip=ip, location=location, budget_ms=budget_of(headers))
    return decide(request, table, health, now, edge=edge)


def describe(d: RouteDecision) -> str:
    """The decision as the lines ``edgegw explain`` prints."""
    loc = d.location
    if loc is None:
        where = "unknown (not in the GeoIP database)"
    else:
        place = ", ".join(p for p in (loc.city, loc.country) if p) or "?"
        coords = "" if loc.latitude is None else f" ({loc.latitude:.2f}, {loc.longitude:.2f})"
        where = f"{place}{coords}"
    lines = [
        f"client ip:  {d.client_ip or '-'}",
        f"location:   {where}",
        f"region:     {d.region}",
        f"model:      {d.requested_model} -> {d.model}",
        f"target:     {_target(d.target)}",
    ]
    if d.fallbacks:
        lines.append("fallbacks:")
        lines += [f"  {i}. {_target(t)}" for i, t in enumerate(d.fallbacks, 1)]
    else:
        lines.append("fallbacks:  none")
    if d.model_fallbacks:
        lines.append("model fallbacks (routing.fallbacks):")
        lines += [f"  {i}. {_target(t)}" for i, t in enumerate(d.model_fallbacks, 1)]
    lines.append(f"budget:     {d.budget_ms:.0f} ms")
    if d.hedge_target is not None and d.hedge_after_ms is not None:
        lines.append(f"hedge:      {d.hedge_target.label()} after {d.hedge_after_ms:.0f} ms without a first token")
    else:
        lines.append("hedge:      none")
    if d.cascade_threshold is not None:
        lines.append(f"cascade:    escalate if the edge answer's mean logprob < {d.cascade_threshold:g}")
    else:
        lines.append("cascade:    none")
    if d.degraded:
        lines.append("degraded:   yes")
    if d.affinity is not None:
        lines.append(f"affinity:   {d.affinity}")
    lines.append("reasons:")
    lines += [f"  - {r}" for r in d.reasons]
    lines.append(f"header:     x-edgegw-route: {d.header_value()}")
    return "\n".join(lines) + "\n"


def _target(t: Target) -> str:
    pred = "" if t.predicted_ttft_ms is None else f", predicted TTFT {t.predicted_ttft_ms:.0f} ms"
    if t.kind is TargetKind.ENDPOINT:
        return f"{t.cluster} @ {t.endpoint} (region {t.region}, model {t.model}{pred})"
    return f"{t.kind.value} (region {t.region}, model {t.model}{pred})"
