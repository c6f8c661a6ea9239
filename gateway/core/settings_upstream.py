"""``clusters`` (the upstream inference servers: each endpoint's URL, protocol, pool,
timeouts, credentials) and ``forward_headers`` (what of a request passes upstream)."""

from __future__ import annotations

import base64
import os
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator

from gateway.core.settings_base import ConfigModel, readable_file

__all__ = [
    "ClusterSettings",
    "EndpointCompat",
    "EndpointSettings",
    "ForwardHeaderSettings",
    "endpoint_api_key",
    "endpoint_authorization",
]


class EndpointCompat(ConfigModel):
    """What an endpoint's server understands of the OpenAI API, where servers differ."""

    # the chat output cap sent as: both (a max_completion_tokens is sent as max_tokens too, the same
    # value: vLLM and SGLang read either, llama.cpp only max_tokens), max_tokens (servers that know only it),
    # max_completion_tokens (OpenAI's reasoning models refuse max_tokens), as_sent (unchanged)
    max_tokens_field: Literal["both", "max_tokens", "max_completion_tokens", "as_sent"] = "both"


class EndpointSettings(ConfigModel):
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
    compat: EndpointCompat = EndpointCompat()  # how requests are adapted to what this server understands

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
        return None if value is None else readable_file(value)

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


class ClusterSettings(ConfigModel):
    name: str  # cluster name, shown in metrics and x-edgegw-route
    models: tuple[str, ...] = ()  # model names served; empty: discovered from GET /v1/models
    endpoints: tuple[EndpointSettings, ...] = Field(min_length=1)  # replicas, tried in turn on failure
    # how often discovered models are refreshed (and at once when a request names a model
    # nobody listed); never while a request is in flight to the endpoint
    discovery_interval_s: float = Field(300.0, gt=0)
    discovery_timeout_s: float = Field(5.0, gt=0)  # an endpoint's GET <base>/models must answer within this


class ForwardHeaderSettings(ConfigModel):
    """Request headers passed upstream besides the hop-by-hop, credential and gateway ones,
    which never pass (gateway/forwarding.py)."""

    allow: tuple[str, ...] = ()  # empty: every end-to-end header; else only these names
    deny: tuple[str, ...] = ()  # never these names


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
