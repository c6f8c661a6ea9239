"""Configuration: the YAML file and the command line, read once and validated.

Only ``gateway.core`` reads configuration files or the environment. ``load_settings(path)``
returns a frozen ``Settings`` value or raises ``ConfigError`` whose message names the bad
key and its line (``config_file.py``).

``Settings`` is assembled here from one module per side: ``settings_listen`` (listen,
limits), ``settings_upstream`` (clusters and their endpoints, forward_headers),
``settings_edge`` (edge), ``settings_tenants`` (auth, tenants, rate_limits, admission),
``settings_admin`` (admin, reload, usage), ``settings_api`` (cors, passthrough),
``settings_observe`` (slo, tracing); ``cache`` and ``routing`` bring their own. Every name
is importable from this module, as before.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator

from cache import CacheConfig
from gateway.core.config_file import describe, read_yaml
from gateway.core.cpus import cpu_set, usable_cpus
from gateway.core.settings_admin import AdminSettings, ReloadSettings, UsageSettings
from gateway.core.settings_api import PASSTHROUGH_PATHS, CORSSettings
from gateway.core.settings_base import ConfigError, ConfigModel
from gateway.core.settings_edge import DEFAULT_EDGE_MODEL, EdgeSettings
from gateway.core.settings_listen import AdminListenSettings, HTTP3ListenSettings, LimitSettings, ListenSettings, TLSListenSettings
from gateway.core.settings_observe import BurnWindowSettings, ObjectiveSettings, SLOSettings, TracingSettings
from gateway.core.settings_tenants import (
    AdmissionSettings,
    AuthSettings,
    Priority,
    RateLimitSettings,
    TenantPolicy,
    TenantSettings,
    TokenQuotaSettings,
)
from gateway.core.settings_upstream import (
    ClusterSettings,
    EndpointCompat,
    EndpointSettings,
    ForwardHeaderSettings,
    endpoint_api_key,
    endpoint_authorization,
)
from routing import ClusterSpec, RoutingConfig, RoutingTable, TableError

__all__ = [
    "ConfigError",
    "cpu_set",
    "usable_cpus",
    "AdminListenSettings",
    "AdminSettings",
    "ListenSettings",
    "ReloadSettings",
    "TokenQuotaSettings",
    "UsageSettings",
    "TLSListenSettings",
    "HTTP3ListenSettings",
    "LimitSettings",
    "EndpointSettings",
    "ClusterSettings",
    "endpoint_authorization",
    "endpoint_api_key",
    "DEFAULT_EDGE_MODEL",
    "EdgeSettings",
    "ForwardHeaderSettings",
    "AuthSettings",
    "Priority",
    "TenantPolicy",
    "TenantSettings",
    "RateLimitSettings",
    "AdmissionSettings",
    "ObjectiveSettings",
    "BurnWindowSettings",
    "SLOSettings",
    "TracingSettings",
    "CORSSettings",
    "EndpointCompat",
    "PASSTHROUGH_PATHS",
    "Settings",
    "load_settings",
    "quickstart_settings",
]


class Settings(ConfigModel):
    listen: ListenSettings = ListenSettings()  # where the gateway serves
    limits: LimitSettings = LimitSettings()  # body sizes, buffers, timeouts, retries
    clusters: tuple[ClusterSettings, ...] = ()  # upstream inference servers
    edge: EdgeSettings = EdgeSettings()  # the small-model engine (in-process, or in a process of its own)
    forward_headers: ForwardHeaderSettings = ForwardHeaderSettings()  # request headers passed upstream
    auth: AuthSettings = AuthSettings()  # API keys
    tenants: tuple[TenantSettings, ...] = ()  # who may ask, how much, and how urgently
    rate_limits: RateLimitSettings = RateLimitSettings()  # where the tenants' rate limits are counted
    admin: AdminSettings = AdminSettings()  # keys for /metrics, /debug/latency, /dashboard and /admin/*
    reload: ReloadSettings = ReloadSettings()  # live configuration reload (SIGHUP, POST /admin/reload, a changed file)
    usage: UsageSettings = UsageSettings()  # tokens per tenant: counters, GET /admin/usage, monthly quotas
    admission: AdmissionSettings = AdmissionSettings()  # queueing and shedding in front of every target
    slo: SLOSettings = SLOSettings()  # objectives, and the burn rates that page
    tracing: TracingSettings = Field(default_factory=TracingSettings)  # OpenTelemetry traces (the tracing extra)
    cache: CacheConfig = CacheConfig()  # exact-response cache (cache/config.py)
    routing: RoutingConfig = RoutingConfig()  # regions, geo, balancing, health, policy (routing/config.py)
    cors: CORSSettings = CORSSettings()  # cross-origin requests from browsers (off unless allow_origins is set)
    passthrough: tuple[str, ...] = ()  # more POST paths forwarded by model, besides PASSTHROUGH_PATHS ("/v1/score", "/v1/x/*")

    @field_validator("passthrough")
    @classmethod
    def _passthrough_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            if not path.startswith("/v1/") or "*" in path[:-1] or path in ("/v1/chat/completions", "/v1/completions"):
                raise ValueError(f"{path!r}: a pass-through path starts with /v1/ (the part after it is appended to each endpoint's base URL), may end in *, and is not a completions path")
        return value

    @model_validator(mode="after")
    def _unique_cluster_names(self) -> Settings:
        names = [c.name for c in self.clusters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate cluster names: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _unique_tenant_names(self) -> Settings:
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1} | ({"anonymous"} & set(names)))
        if duplicates:
            raise ValueError(f"duplicate or reserved tenant names: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _admin_port_of_its_own(self) -> Settings:
        admin = self.listen.admin
        if admin is not None:
            taken = {self.listen.port: "listen.port"}
            if self.listen.tls is not None:
                taken[self.listen.tls.port] = "listen.tls.port"
            if admin.port in taken:
                raise ValueError(f"listen.admin.port {admin.port} is {taken[admin.port]}: the admin listener needs a port of its own")
        return self

    @property
    def engine_in_own_process(self) -> bool:
        return self.edge.enabled and (self.edge.process or self.listen.workers > 1)

    @model_validator(mode="after")
    def _engine_cpus_need_its_process(self) -> Settings:
        if self.edge.cpus is not None and self.edge.enabled and not self.engine_in_own_process:
            raise ValueError("edge.cpus pins the engine's own process: set edge.process: true or listen.workers > 1")
        return self

    @model_validator(mode="after")
    def _routing_matches_clusters(self) -> Settings:
        specs = [ClusterSpec(c.name, c.models, tuple(e.url for e in c.endpoints)) for c in self.clusters]
        edge_model = self.edge.served_name if self.edge.enabled else None
        try:
            RoutingTable.build(self.routing, specs, edge_model)
        except TableError as exc:
            raise ValueError(f"routing does not match the clusters: {exc}") from None
        return self



def load_settings(path: str | os.PathLike[str]) -> Settings:
    path = Path(path)
    data, node = read_yaml(path)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe(path, node, exc)) from None


def quickstart_settings(
    upstreams: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    protocol: str = "http1",
    cache: str | None = None,
) -> Settings:
    """Settings for ``edgegw serve --upstream URL ... [--cache memory|off|redis://...]``: one
    cluster whose models are discovered; the in-memory cache unless asked otherwise."""
    try:
        cache_config = CacheConfig.from_cli(cache) if cache else CacheConfig(backend="memory")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    clusters = []
    if upstreams:
        clusters.append({"name": "default", "endpoints": [{"url": url, "protocol": protocol} for url in upstreams]})
    try:
        return Settings.model_validate(
            {"listen": {"host": host, "port": port}, "clusters": clusters, "cache": cache_config}
        )
    except ValidationError as exc:
        raise ConfigError(describe("--upstream", None, exc)) from None

