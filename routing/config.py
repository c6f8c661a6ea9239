"""Routing configuration: pydantic models, the ``routing:`` section of the gateway YAML.

Every field has a default, so an empty ``routing:`` section (or none) gives a working
single-region gateway. ``gateway/core/settings.py`` builds a ``RoutingConfig`` from the YAML;
nothing here reads files or the environment. Cross-checks against the cluster list
(region → cluster names) happen in ``routing.table.RoutingTable.build``.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AUTO",
    "BalancerConfig",
    "EDGE",
    "HealthConfig",
    "HedgingConfig",
    "LoadConfig",
    "PolicyConfig",
    "RegionConfig",
    "RoutingConfig",
]

AUTO = "auto"  # alias target: the gateway chooses edge or central per request
EDGE = "edge"  # alias target: whatever model the in-process edge engine serves


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RegionConfig(_Model):
    name: str = "local"  # region name, shown in decisions and metrics
    lat: float | None = Field(default=None, ge=-90, le=90)  # latitude, degrees
    lon: float | None = Field(default=None, ge=-180, le=180)  # longitude, degrees
    edge: bool = False  # gateways in this region run an in-process edge engine
    clusters: list[str] = []  # names of the central clusters located in this region


class PolicyConfig(_Model):
    edge_max_prompt_tokens: int = Field(default=1024, ge=0)  # longer `auto` prompts escalate
    edge_max_output_tokens: int = Field(default=512, ge=0)  # larger `auto` max_tokens escalates
    edge_max_queue_depth: int = Field(default=16, ge=0)  # deeper edge queue: `auto` escalates
    edge_handles_tools: bool = False  # the edge model may take requests with tools
    default_budget_ms: float = Field(default=2000.0, gt=0)  # TTFT budget without header/tenant
    central_model: str | None = None  # model for escalated `auto` requests (None: first served)
    prior_ttft_ms: float = Field(default=400.0, ge=0)  # assumed server TTFT before measuring
    edge_prior_ttft_ms: float = Field(default=150.0, ge=0)  # assumed edge TTFT before measuring
    edge_queue_cost_ms: float = Field(default=50.0, ge=0)  # added edge TTFT per queued request
    km_per_rtt_ms: float = Field(default=66.0, gt=0)  # unmeasured RTT = distance / this
    max_fallbacks: int = Field(default=3, ge=0)  # fallbacks listed in a decision
    cascade_min_logprob: float | None = None  # non-streaming `auto` at edge: escalate below
    chars_per_token: float = Field(default=4.0, gt=0)  # prompt token estimate from characters


class BalancerConfig(_Model):
    ewma_alpha: float = Field(default=0.3, gt=0, le=1)  # weight of a new TTFT/TPOT sample
    affinity: bool = True  # rendezvous-hash sessions / prompt prefixes onto replicas
    session_header: str = "x-session-id"  # header naming the conversation (else body `user`)
    affinity_prefix_messages: int = Field(default=2, ge=1)  # leading messages hashed as prefix
    affinity_load_factor: float = Field(default=0.25, ge=0)  # bounded load: (1+f)·mean in-flight
    affinity_load_slack: int = Field(default=2, ge=0)  # in-flight allowed above that bound
    affinity_max_ttft_ratio: float = Field(default=2.0, ge=1)  # skip a replica this much slower
    affinity_cluster_ratio: float = Field(default=1.25, ge=1)  # sticky cluster if cost within
    error_penalty: float = Field(default=4.0, ge=0)  # cost multiplier per unit error rate


class HealthConfig(_Model):
    probe_interval_s: float = Field(default=5.0, gt=0)  # active probe period per endpoint
    # active probes on this path of each endpoint's origin (e.g. /health); null: passive
    # health only (requests' own outcomes), which never disturbs a server that interrupts its
    # running generation on a new request (llama.cpp's server). Never sent while a request is in flight there.
    probe_path: str | None = None
    probe_timeout_s: float = Field(default=2.0, gt=0)  # a probe unanswered by then may restart
    failure_threshold: int = Field(default=5, ge=1)  # consecutive failures that open the breaker
    error_rate_threshold: float = Field(default=0.5, gt=0, le=1)  # windowed error rate that opens
    error_window_s: float = Field(default=30.0, gt=0)  # window of the recent error rate
    min_requests: int = Field(default=10, ge=1)  # requests in window before the rate counts
    open_duration_s: float = Field(default=10.0, gt=0)  # first ejection; doubles per re-open
    max_open_duration_s: float = Field(default=120.0, gt=0)  # cap of the doubling
    half_open_probes: int = Field(default=2, ge=1)  # trial successes to close (also max in flight)
    retry_budget_ratio: float = Field(default=0.2, ge=0, le=1)  # retries+hedges per request
    retry_budget_min: int = Field(default=5, ge=0)  # retries always allowed per window
    retry_window_s: float = Field(default=10.0, gt=0)  # window of the retry budget
    # when every endpoint serving a model is ejected, try them anyway (panic routing, as
    # Envoy does) instead of refusing everything until a breaker half-opens: a burst of
    # failures (a restart dropping every stream) must not outlast its cause
    panic: bool = True


class HedgingConfig(_Model):
    enabled: bool = True  # hedge a request whose first token is late
    budget_fraction: float = Field(default=0.5, gt=0, le=1)  # hedge after this part of budget
    min_delay_ms: float = Field(default=20.0, ge=0)  # never hedge earlier than this


class LoadConfig(_Model):
    """The servers' own load signals (``routing.signals``) and the prefix index
    (``routing.prefix``). An endpoint is polled only when its ``load_source`` (set per
    endpoint, or detected from its model list) names a server that publishes metrics."""

    poll_interval_s: float = Field(default=1.0, gt=0)  # GET <origin>/metrics this often per polled endpoint
    poll_timeout_s: float = Field(default=1.0, gt=0)  # a poll unanswered by then counts as no reading
    stale_after_s: float = Field(default=3.0, gt=0)  # a reading older than this is ignored
    kv_knee: float = Field(default=0.9, ge=0, lt=1)  # KV use above this raises an endpoint's cost
    kv_penalty: float = Field(default=4.0, ge=0)  # cost multiplier at 100 % KV use is 1 + this
    prefix: bool = True  # route prompts to the replica holding their longest cached prefix
    prefix_block_chars: int = Field(default=256, ge=16)  # characters per prefix block (~64 tokens)
    prefix_max_blocks: int = Field(default=512, ge=1)  # blocks hashed per prompt at most
    prefix_min_blocks: int = Field(default=2, ge=1)  # a shorter cached prefix is no reason to go there
    prefix_weight: float = Field(default=0.5, ge=0, le=1)  # cluster cost discount for a fully cached prompt
    prefix_load_weight: float = Field(default=0.03, ge=0)  # a fully cached prompt is worth 1/this requests of load
    prefix_pending_weight: float = Field(default=0.3, ge=0)  # weight of prefill already queued on a replica
    prefix_load_factor: float = Field(default=2.0, ge=1)  # replicas above this × mean load are passed over
    prefix_load_slack: int = Field(default=4, ge=0)  # in-flight allowed above that bound
    prefix_capacity_tokens: int = Field(default=262144, ge=1)  # assumed KV cache per endpoint (server's own figure wins)


class RoutingConfig(_Model):
    geoip_db: str | None = None  # MaxMind-format .mmdb; None: embedded DB-IP City Lite
    trusted_proxies: list[str] = []  # CIDRs whose X-Forwarded-For / Forwarded are believed
    default_region: str | None = None  # region for unknown locations (None: the first region)
    local_region: str | None = None  # region this gateway runs in (None: default region)
    regions: list[RegionConfig] = []  # empty: one implicit local region with every cluster
    aliases: dict[str, str] = {AUTO: AUTO}  # model name → `auto`, `edge` or a model name
    # model → the models tried, in order, when every target of it fails before its first
    # byte (an error, a timeout) or refuses the prompt as too long (context_length_exceeded)
    fallbacks: dict[str, list[str]] = {}
    policy: PolicyConfig = PolicyConfig()  # edge-or-escalate thresholds
    balancer: BalancerConfig = BalancerConfig()  # endpoint choice inside a cluster
    health: HealthConfig = HealthConfig()  # probes, ejection, circuit breakers, retry budget
    hedging: HedgingConfig = HedgingConfig()  # late-first-token hedging
    load: LoadConfig = LoadConfig()  # the servers' load metrics and the prefix index

    @field_validator("trusted_proxies")
    @classmethod
    def _check_cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ValueError(f"not a CIDR: {cidr!r}") from exc
        return value

    @model_validator(mode="after")
    def _check_regions(self) -> "RoutingConfig":
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate region names in {names}")
        for key in ("default_region", "local_region"):
            value = getattr(self, key)
            if value is not None and self.regions and value not in names:
                raise ValueError(f"{key} {value!r} is not one of the regions {names}")
        for r in self.regions:
            if (r.lat is None) != (r.lon is None):
                raise ValueError(f"region {r.name!r}: give both lat and lon, or neither")
        return self
