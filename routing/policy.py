"""The edge-or-escalate decision: ``decide(request, table, health, now) -> RouteDecision``.

A pure function of the request's features, the table, the live ``HealthState``, the
edge engine's ``EdgeStats`` snapshot and ``now``. It returns a decision and never acts
on it; the gateway does the I/O (cache replay, engine call, upstream request, hedging).

Rules, in order:

1. The model name is resolved through the aliases: ``auto`` (the gateway chooses), the
   edge model, or a central model. Unknown names raise ``UnknownModel``.
2. Central candidates: every cluster serving the model, each scored by its best
   available endpoint's cost (predicted TTFT × (in-flight + 1) × error penalty), best
   first; with an affinity key, the conversation's rendezvous choice among clusters
   within ``affinity_cluster_ratio`` of the best goes first. Prediction per endpoint, most
   trusted first: the TTFT EWMA measured from this gateway; else probe RTT +
   ``prior_ttft_ms``; else the great-circle distance from the client (or its home
   region) to the cluster's region / ``km_per_rtt_ms`` + ``prior_ttft_ms``. Inside the
   best cluster the balancer picks (power of two choices, affinity, bounded load).
   Clusters whose endpoints are all ejected are skipped; when every endpoint serving the
   model is ejected, all of them are scored anyway (``health.panic``, on by default).
   The servers' own load (``HealthState.record_load``, while fresher than
   ``load.stale_after_s``) replaces the in-flight count in the cost (merged: the server's
   count less this gateway's share when it was read, plus its in-flight count now); KV
   use past ``load.kv_knee`` multiplies it; the share of the prompt an endpoint's prefix
   index holds discounts it (``load.prefix_weight``). With prefix blocks the balancer
   picks by cached share, queued prefill and load (see ``balancer``).
3. Explicit models go where they are served. An ``auto`` request stays at the edge
   when it is short and simple (prompt ≤ ``edge_max_prompt_tokens``, max_tokens ≤
   ``edge_max_output_tokens``, no tools or attachments) and the edge is healthy, not
   queued beyond ``edge_max_queue_depth``, has KV room and is predicted within budget.
   Otherwise it escalates to the central model; if the central path is unhealthy or
   predicted over the budget, it degrades to the edge (``degraded=True``, with reason).
4. Hedge: when enabled and the retry budget allows, ``hedge_after_ms`` =
   ``budget_fraction × budget`` (at least ``min_delay_ms``), target = the first fallback.
5. Cascade: a non-streaming ``auto`` request served at the edge with a central fallback
   carries ``cascade_threshold`` (``policy.cascade_min_logprob``) when configured.

``cascade_verdict`` is rule 5's second half: given the edge's answer, escalate or keep.
``routing.explain`` runs address -> location -> features -> decide in one call and puts the
decision in words, for ``edgegw explain``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from .balancer import SHARED_RNG, pick_available, predicted_ttft_s, rendezvous_weight
from .config import AUTO, EDGE
from .errors import NoRoute, Unservable
from .features import mean_logprob
from .geo import GeoLocator, client_address
from .health import EndpointHealth, HealthState
from .table import Cluster, RoutingTable
from .types import EdgeStats, Location, RouteDecision, RouteRequest, Target, TargetKind

__all__ = ["cascade_verdict", "decide", "locate_client"]

_ENDPOINT = TargetKind.ENDPOINT
_EDGE = TargetKind.EDGE
EDGE_APIS = frozenset({"chat", "completions"})  # what the edge engine serves


def _distances(table: RoutingTable, request: RouteRequest, home: str) -> dict[str, float]:
    """Client → region distances; from the home region when the client is not located."""
    d = table.distances_km(request.location)
    if not d:
        r = table.regions[home]
        if r.latitude is not None and r.longitude is not None:
            d = table.distances_km(Location(latitude=r.latitude, longitude=r.longitude))
    return d


def _central_targets(
    table: RoutingTable,
    health: HealthState,
    model: str,
    request: RouteRequest,
    home: str,
    now: float,
    rng: random.Random | None,
    reasons: list[str],
    panic: bool = False,
) -> tuple[list[Target], str | None]:
    """Central targets for ``model``, best first, and the affinity outcome. With ``panic``,
    ejected endpoints are scored too (the caller has nothing else to offer)."""
    cfg = table.config
    pol = cfg.policy
    dist = _distances(table, request, home)
    penalty = cfg.balancer.error_penalty
    lcfg = cfg.load
    stale_s = lcfg.stale_after_s
    knee = lcfg.kv_knee
    kv_slope = lcfg.kv_penalty / (1.0 - knee)
    blocks = request.prefix_blocks if lcfg.prefix else ()
    nblocks = len(blocks)
    min_match = lcfg.prefix_min_blocks
    weight = lcfg.prefix_weight / nblocks if nblocks else 0.0
    block_tokens = health.block_tokens
    pw = lcfg.prefix_pending_weight
    loads: dict[str, float] = {}
    matches: dict[str, int] = {}
    kvs: dict[str, float] = {}
    scored: list[tuple[float, Cluster, float, list[EndpointHealth], dict[str, float], EndpointHealth]] = []
    ejected: list[str] = []
    available = health.available_records
    clusters = table.clusters_for(model)
    if panic:
        reasons.append(f"panic: every endpoint serving {model} is ejected, trying them anyway")
    for cluster in clusters:
        km = dist.get(cluster.region)
        prior_s = ((0.0 if km is None else km / pol.km_per_rtt_ms) + pol.prior_ttft_ms) / 1e3
        avail = [health.endpoint(e) for e in cluster.endpoints] if panic else available(cluster.endpoints, now)
        if not avail:
            ejected.append(cluster.name)
            continue
        measured = [h.ttft_s for h in avail if h.ttft_s is not None]
        if measured and len(measured) < len(avail):
            # a replica nobody has measured yet is assumed a little faster than the best
            # measured one of its cluster (the same model): else it is never chosen, so
            # never measured, and a fast neighbour starves it for good
            prior_s = min(prior_s, 0.9 * min(measured))
        costs = {}
        best = math.inf
        best_h = avail[0]
        for h in avail:
            # endpoint_cost(h, prior_s, penalty), inlined (the per-request hot loop), with
            # the server's own load merged in while its reading is fresh, its KV use, and
            # the prefill its prefix cache probably saves
            t = h.ttft_s
            if t is None:
                t = prior_s if h.rtt_s is None else h.rtt_s + prior_s
            n = len(h.outcomes)
            ld = h.load
            ep = h.endpoint
            if ld is not None and now - ld.at <= stale_s:
                # ServerLoad.merged_load, inlined: the server's others plus our in-flight now
                q = ld.running + ld.waiting - ld.inflight_at
                q = (q if q > 0.0 else 0.0) + h.inflight
                kv = ld.kv_usage
            else:
                q = h.inflight
                kv = None
            loads[ep] = q
            c = t * (q + 1) * (1.0 + penalty * (h.window_failures / n if n else 0.0))
            if kv is not None and kv > knee:
                c *= 1.0 + kv_slope * (kv - knee)
                kvs[ep] = (kv - knee) / (1.0 - knee)
            if nblocks and h.prefix is not None:
                m = matches[ep] = h.prefix.match(blocks)
                if m >= min_match:
                    c *= 1.0 - weight * m
            costs[ep] = c
            if c < best:
                best, best_h = c, h
        scored.append((best, cluster, prior_s, avail, costs, best_h))
    if ejected:
        reasons.append(f"skipped {','.join(ejected)}: all endpoints ejected")
    if not scored:
        return [], None
    if len(scored) > 1:
        scored.sort(key=lambda t: t[0])
        key = request.affinity_key
        if key is not None and cfg.balancer.affinity:
            # sticky across regions too: among clusters whose cost is within
            # affinity_cluster_ratio of the best, the conversation's rendezvous choice
            bound = scored[0][0] * cfg.balancer.affinity_cluster_ratio
            near = [t for t in scored if t[0] <= bound]
            if len(near) > 1:
                first = max(near, key=lambda t: rendezvous_weight(key, t[1].name))
                scored.remove(first)
                scored.insert(0, first)
    _, cluster, prior_s, avail, costs, _ = scored[0]
    chosen = pick_available(
        avail,
        config=cfg.balancer,
        prior_s=prior_s,
        affinity_key=request.affinity_key,
        rng=rng if rng is not None else SHARED_RNG,
        costs=costs,
        loads=loads,
        matches=matches,
        min_match=min_match,
        nblocks=nblocks,
        kv=kvs,
        pending={h.endpoint: pw * h.pending_tokens / block_tokens for h in avail} if nblocks and pw else None,
        load_weight=lcfg.prefix_load_weight,
        prefix_load_factor=lcfg.prefix_load_factor,
        prefix_load_slack=lcfg.prefix_load_slack,
    )
    assert chosen is not None  # the cluster has an available endpoint
    affinity = None
    if chosen.affinity == "prefix-none":
        pass  # nobody caches it: the least loaded took it
    elif chosen.affinity in ("prefix-cache", "prefix-cache-partial"):
        affinity = chosen.affinity
        m = matches.get(chosen.endpoint, 0)
        reasons.append(f"cached prefix {m}/{nblocks} blocks -> {chosen.endpoint}")
    elif chosen.affinity is not None:
        src = request.affinity_source or "key"
        if chosen.affinity == "hit":
            affinity = src
            reasons.append(f"{src} affinity -> {chosen.endpoint}")
        else:
            affinity = f"{src}-overflow"
            reasons.append(f"{src} affinity overflow to rank {chosen.affinity_rank} (load or latency)")
    by_ep = {h.endpoint: h for h in avail}
    region, name = cluster.region, cluster.name

    def target(c: Cluster, h: EndpointHealth, p_s: float) -> Target:
        return Target(_ENDPOINT, model, c.region, c.name, h.endpoint, predicted_ttft_s(h, p_s) * 1e3)

    limit = pol.max_fallbacks + 1
    targets = [target(cluster, by_ep[chosen.endpoint], prior_s)]
    others = chosen.others
    if others:  # one more replica of the same cluster first (cheap), then other regions
        targets.append(target(cluster, by_ep[others[0]], prior_s))
    for _, other, other_prior, _, _, best_h in scored[1:]:
        if len(targets) >= limit:
            break
        targets.append(target(other, best_h, other_prior))
    for ep in others[1:]:
        if len(targets) >= limit:
            break
        targets.append(target(cluster, by_ep[ep], prior_s))
    if len(scored) > 1 or home != region:
        reasons.append(f"region {region} ({name}) predicted {targets[0].predicted_ttft_ms:.0f}ms")
    return targets, affinity


def _edge_cannot(edge: EdgeStats | None, request: RouteRequest) -> str:
    """Why the edge engine can never honour ``request`` (its API, the structure it asks
    for), or "" when it can."""
    if request.api not in EDGE_APIS:
        return f"the edge engine serves chat and completions, not {request.api}"
    if request.structured is not None and not (edge is not None and edge.structured_output):
        return f"{request.structured} needs structured output, which the edge engine does not support"
    return ""


def _edge_assessment(
    table: RoutingTable, edge: EdgeStats | None, request: RouteRequest, budget_ms: float
) -> tuple[bool, bool, float, str]:
    """(fit for an auto request, usable at all, predicted TTFT ms, reason if not fit)."""
    pol = table.config.policy
    if not table.has_edge:
        return False, False, math.inf, "no edge engine here"
    cannot = _edge_cannot(edge, request)
    if cannot:
        return False, False, math.inf, cannot
    if edge is None:
        return True, True, pol.edge_prior_ttft_ms, ""
    if not edge.healthy:
        return False, False, math.inf, "edge engine unhealthy"
    out = request.max_tokens if request.max_tokens is not None else pol.edge_max_output_tokens
    need = -(-(request.prompt_tokens + out) // max(1, edge.block_size))
    if need > edge.kv_blocks_total:
        return False, False, math.inf, f"needs {need} KV blocks > edge total {edge.kv_blocks_total}"
    base = edge.recent_ttft_ms if edge.recent_ttft_ms is not None else pol.edge_prior_ttft_ms
    pred = base + edge.queue_depth * pol.edge_queue_cost_ms
    if edge.queue_depth > pol.edge_max_queue_depth:
        return False, True, pred, f"edge queue {edge.queue_depth} > {pol.edge_max_queue_depth}"
    if need > edge.kv_blocks_free:
        return False, True, pred, f"edge KV full ({edge.kv_blocks_free} free < {need} needed)"
    if pred > budget_ms:
        return False, True, pred, f"edge predicted {pred:.0f}ms > budget {budget_ms:.0f}ms"
    return True, True, pred, ""


def decide(
    request: RouteRequest,
    table: RoutingTable,
    health: HealthState,
    now: float,
    *,
    edge: EdgeStats | None = None,
    rng: random.Random | None = None,
) -> RouteDecision:
    """Decide where ``request`` goes. See the module docstring for the rules.

    ``edge``: a snapshot of the in-process engine (``None``: assume idle if the table
    has one). ``rng``: the balancer's random source (seed one for reproducible runs).
    Raises ``UnknownModel`` for a model served nowhere and ``NoRoute`` when nothing
    can serve the request (``retry_after_s`` set when breakers will half-open).
    """
    return _decide(request, table, health, now, edge, rng)


def _decide(
    request: RouteRequest,
    table: RoutingTable,
    health: HealthState,
    now: float,
    edge: EdgeStats | None,
    rng: random.Random | None,
) -> RouteDecision:
    cfg = table.config
    pol = cfg.policy
    reasons: list[str] = []
    budget = request.budget_ms if request.budget_ms else pol.default_budget_ms
    home = table.home_region(request.location)
    if request.location is None or request.location.latitude is None:
        reasons.append(f"location unknown -> default region {home}")
    route = table.resolve_model(request.model)
    degraded = False
    cascade = None
    affinity = None
    edge_target = None
    if table.has_edge:
        edge_target = Target(_EDGE, table.edge_model or "", table.local_region)

    if route.kind == EDGE:
        fit, usable, edge_pred, why = _edge_assessment(table, edge, request, budget)
        central, affinity = (
            _central_targets(table, health, route.model, request, home, now, rng, reasons)
            if table.clusters_for(route.model)
            else ([], None)
        )
        if usable:
            assert edge_target is not None
            target = Target(_EDGE, route.model, table.local_region, predicted_ttft_ms=edge_pred)
            reasons.insert(0, f"{route.model} is the edge model")
            fallbacks = central
        elif central:
            target, fallbacks = central[0], central[1:]
            reasons.insert(0, f"{route.model}: edge unusable ({why}), served centrally")
        elif _edge_cannot(edge, request) and not table.clusters_for(route.model):
            raise Unservable(f"the model {route.model!r} cannot serve this request: {why}", param=request.structured, explicit=True)
        else:
            raise NoRoute(f"edge model {route.model!r} unavailable: {why}")
    elif route.kind != AUTO:
        central, affinity = _central_targets(table, health, route.model, request, home, now, rng, reasons)
        if not central and cfg.health.panic:
            central, affinity = _central_targets(table, health, route.model, request, home, now, rng, reasons, True)
        if not central:
            eps = [e for c in table.clusters_for(route.model) for e in c.endpoints]
            raise NoRoute(
                f"every endpoint serving {route.model!r} is ejected",
                retry_after_s=health.retry_after_s(eps, now),
            )
        reasons.insert(0, f"{route.model} is a central model")
        target, fallbacks = central[0], central[1:]
    else:
        fit, usable, edge_pred, why = _edge_assessment(table, edge, request, budget)
        escalate: list[str] = []
        if request.prompt_tokens > pol.edge_max_prompt_tokens:
            escalate.append(f"prompt ~{request.prompt_tokens} tokens > edge limit {pol.edge_max_prompt_tokens}")
        if request.max_tokens is not None and request.max_tokens > pol.edge_max_output_tokens:
            escalate.append(f"max_tokens {request.max_tokens} > edge limit {pol.edge_max_output_tokens}")
        if request.has_tools and not pol.edge_handles_tools:
            escalate.append("tools requested")
        if request.has_attachments:
            escalate.append("attachments")
        if not fit:
            escalate.append(why)
        central: list[Target] = []
        if table.central_model is not None:
            central, affinity = _central_targets(
                table, health, route.model, request, home, now, rng, reasons
            )
        edge_fb = [] if edge_target is None or not usable else [
            Target(_EDGE, edge_target.model, table.local_region, predicted_ttft_ms=edge_pred)
        ]
        if not escalate:
            assert edge_fb
            target, fallbacks = edge_fb[0], central
            reasons.insert(
                0,
                f"auto: short simple request stays at the edge "
                f"(~{request.prompt_tokens} prompt tokens, edge predicted {edge_pred:.0f}ms)",
            )
            if pol.cascade_min_logprob is not None and not request.stream and central:
                cascade = pol.cascade_min_logprob
                reasons.append(f"cascade to {central[0].label()} if mean logprob < {cascade:g}")
        else:
            reasons.insert(0, "auto: escalate (" + "; ".join(escalate) + ")")
            central_pred = central[0].predicted_ttft_ms if central else None
            if central and central_pred is not None and central_pred <= budget:
                target, fallbacks = central[0], central[1:] + edge_fb
            elif edge_fb:
                degraded = True
                target, fallbacks = edge_fb[0], central
                if not central:
                    if table.central_model is None:
                        reasons.append("degraded to edge: no central cluster")
                    else:
                        reasons.append("degraded to edge: central path unhealthy")
                else:
                    reasons.append(
                        f"degraded to edge: central predicted {central_pred:.0f}ms > budget {budget:.0f}ms"
                    )
            elif central:
                target, fallbacks = central[0], central[1:]
                reasons.append(
                    f"central predicted {central_pred:.0f}ms > budget {budget:.0f}ms; no edge to degrade to"
                )
            elif table.central_model is not None and cfg.health.panic and (
                panicked := _central_targets(table, health, route.model, request, home, now, rng, reasons, True)[0]
            ):
                target, fallbacks = panicked[0], panicked[1:]
            else:
                eps = [e for c in table.clusters_for(route.model) for e in c.endpoints]
                cannot = _edge_cannot(edge, request) if table.has_edge else ""
                if cannot and (table.central_model is None or not eps):
                    raise Unservable(f"auto: no central cluster here, and {cannot}", param=request.structured, explicit=False)
                if cannot:
                    raise Unservable(
                        f"auto: no healthy central endpoint, and {cannot}", param=request.structured, explicit=False
                    )
                raise NoRoute(
                    "auto: no healthy central endpoint and no usable edge engine",
                    retry_after_s=health.retry_after_s(eps, now),
                )

    fallbacks = fallbacks[: pol.max_fallbacks]
    model_fallbacks = _model_fallbacks(table, health, request, target, edge, budget, home, now, rng, reasons)
    hedge_after = hedge_target = None
    hcfg = cfg.hedging
    if hcfg.enabled and fallbacks:
        if health.can_retry(now):
            hedge_target = fallbacks[0]
            hedge_after = max(hcfg.min_delay_ms, hcfg.budget_fraction * budget)
            reasons.append(f"hedge to {hedge_target.label()} after {hedge_after:.0f}ms without a token")
        else:
            reasons.append("no hedge: retry budget spent")
    return RouteDecision(
        target=target,
        fallbacks=tuple(fallbacks),
        model_fallbacks=tuple(model_fallbacks),
        reasons=tuple(reasons),
        model=target.model,
        requested_model=request.model,
        region=home,
        client_ip=request.client_ip,
        location=request.location,
        budget_ms=budget,
        degraded=degraded,
        hedge_after_ms=hedge_after,
        hedge_target=hedge_target,
        cascade_threshold=cascade,
        affinity=affinity,
        prefix_blocks=request.prefix_blocks,
    )


def _model_fallbacks(
    table: RoutingTable,
    health: HealthState,
    request: RouteRequest,
    target: Target,
    edge: EdgeStats | None,
    budget: float,
    home: str,
    now: float,
    rng: random.Random | None,
    reasons: list[str],
) -> list[Target]:
    """The best target of each model ``routing.fallbacks`` lists for the decision's model
    (by its resolved name, else the name asked), in order: tried when every target of the
    model itself failed before its first byte, or refused the prompt as too long. A model
    served nowhere now, or an edge that cannot honour the request, is skipped."""
    listed = table.config.fallbacks.get(target.model) or table.config.fallbacks.get(request.model)
    if not listed:
        return []
    out: list[Target] = []
    skipped: list[str] = []
    for model in listed:
        if model == target.model:
            continue
        if model == table.edge_model:
            _, usable, pred, why = _edge_assessment(table, edge, request, budget)
            if usable:
                out.append(Target(_EDGE, model, table.local_region, predicted_ttft_ms=pred))
            else:
                skipped.append(f"{model} ({why})")
            continue
        central, _ = _central_targets(table, health, model, request, home, now, rng, [])
        if central:
            out.append(central[0])
        else:
            skipped.append(f"{model} (no available endpoint)" if table.clusters_for(model) else f"{model} (served nowhere)")
    if out:
        reasons.append("model fallbacks " + ",".join(t.model for t in out))
    if skipped:
        reasons.append("fallback skipped: " + ", ".join(skipped))
    return out


def locate_client(
    table: RoutingTable,
    geo: GeoLocator | None,
    peer_ip: str | None,
    headers: Mapping[str, str],
) -> tuple[str | None, Location | None]:
    """(client address, location) for a connection: trusted-proxy walk, then GeoIP.

    An address the database does not know gives location ``None``; ``decide`` then
    uses the default region.
    """
    ip = client_address(peer_ip, headers, table.trusted_proxies)
    location = geo.locate(ip) if geo is not None and ip is not None else None
    return ip, location



def cascade_verdict(answer: Mapping[str, Any], threshold: float) -> tuple[bool, float | None]:
    """(escalate?, mean token logprob) for an edge ``answer`` under a decision's
    ``cascade_threshold``: escalate when the answer's mean token logprob is below it. An
    answer without logprobs is kept (nothing says it is unsure)."""
    mean = mean_logprob(answer)
    return (mean is not None and mean < threshold), mean
