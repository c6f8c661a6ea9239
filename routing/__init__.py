"""edgegw routing: where a request should go. Sans-I/O: pure decisions + live state.

Typical use by the gateway::

    table = RoutingTable.build(config, clusters, edge_model="smollm2-135m-instruct")
    health = HealthState.from_config(config, table.endpoint_ids())
    geo = GeoLocator.open(config.geoip_db)          # once, in the lifespan
    ip, loc = locate_client(table, geo, peer, headers)
    req = request_from_openai(body, headers, config, client_ip=ip, location=loc)
    decision = decide(req, table, health, now, edge=edge_stats)
    response.headers["x-edgegw-route"] = decision.header_value()

and it feeds ``health.record_start / record_first_token / record_end / record_probe``
with what happened, probing ``health.endpoints_to_probe(now)``; the servers' own load
(``signals.read_load`` of their ``/metrics``) goes to ``health.record_load``, and the
prompt a decision sent to an endpoint to ``health.record_routed(endpoint,
decision.prefix_blocks, now)`` (its prefix index).
"""

from .balancer import Pick, pick, rendezvous_order
from .config import (
    BalancerConfig,
    HealthConfig,
    HedgingConfig,
    LoadConfig,
    PolicyConfig,
    RegionConfig,
    RoutingConfig,
)
from .errors import InvalidTransition, NoRoute, RoutingError, TableError, UnknownModel, Unservable
from .explain import describe, explain
from .features import budget_of, estimate_prompt_tokens, mean_logprob, request_from_openai, structured_field
from .geo import DBIP_ATTRIBUTION, GeoLocator, TrustedProxies, client_address, haversine_km
from .health import BreakerState, HealthState, RetryBudget
from .policy import cascade_verdict, decide, locate_client
from .prefix import PrefixIndex, prompt_blocks, prompt_text
from .signals import LOAD_SOURCES, MetricsError, ServerLoad, detect_source, parse_prometheus, read_load
from .table import RoutingTable
from .types import (
    ClusterSpec,
    EdgeStats,
    Location,
    RouteDecision,
    RouteRequest,
    Target,
    TargetKind,
)

__all__ = [
    "BalancerConfig",
    "BreakerState",
    "ClusterSpec",
    "DBIP_ATTRIBUTION",
    "EdgeStats",
    "GeoLocator",
    "HealthConfig",
    "HealthState",
    "HedgingConfig",
    "InvalidTransition",
    "LOAD_SOURCES",
    "LoadConfig",
    "Location",
    "MetricsError",
    "NoRoute",
    "Pick",
    "PolicyConfig",
    "PrefixIndex",
    "RegionConfig",
    "RetryBudget",
    "RouteDecision",
    "RouteRequest",
    "RoutingConfig",
    "RoutingError",
    "RoutingTable",
    "ServerLoad",
    "TableError",
    "Target",
    "TargetKind",
    "TrustedProxies",
    "UnknownModel",
    "Unservable",
    "budget_of",
    "cascade_verdict",
    "client_address",
    "decide",
    "describe",
    "detect_source",
    "estimate_prompt_tokens",
    "explain",
    "haversine_km",
    "locate_client",
    "mean_logprob",
    "parse_prometheus",
    "pick",
    "prompt_blocks",
    "prompt_text",
    "read_load",
    "rendezvous_order",
    "request_from_openai",
    "structured_field",
]
