"""``listen`` (where the gateway serves: plain HTTP, HTTPS with HTTP/2, HTTP/3, workers)
and ``limits`` (sizes, timeouts, floods: what one request or connection may cost)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.core.cpus import usable_cpus
from gateway.core.settings_base import ConfigModel, readable_file

__all__ = ["AdminListenSettings", "HTTP3ListenSettings", "LimitSettings", "ListenSettings", "TLSListenSettings"]


# -- listen.tls and listen.http3 (issue 13): the gateway-to-gateway listeners ------------------


class _CertificateSettings(ConfigModel):
    certfile: str  # PEM certificate (chain)
    keyfile: str  # PEM private key

    @field_validator("certfile", "keyfile")
    @classmethod
    def _files_exist(cls, value: str) -> str:
        return readable_file(value)


class TLSListenSettings(_CertificateSettings):
    port: int = Field(8443, ge=1, le=65535)  # TCP port serving HTTP/1.1 and HTTP/2 over TLS (ALPN)


class HTTP3ListenSettings(_CertificateSettings):
    port: int = Field(8443, ge=1, le=65535)  # UDP port serving HTTP/3 (may equal listen.tls.port)


class AdminListenSettings(ConfigModel):
    host: str | None = None  # address to bind; null: listen.host
    port: int = Field(ge=1, le=65535)  # TCP port of the admin listener (HTTP/1.1)


class ListenSettings(ConfigModel):
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
    # a separate listener for /metrics, /debug/latency, /dashboard and /admin/* (which the
    # public port then answers 404); null: those are served on the public port (gateway/admission/admin.py)
    admin: AdminListenSettings | None = None
    pid_file: str | None = None  # write the serving process's pid here (edgegw reload --pid-file reads it)

    @field_validator("workers")
    @classmethod
    def _resolve_workers(cls, value: int | str) -> int:
        if value == "auto":  # the cores this process may use (affinity and a container's CPU quota), not the machine's
            return usable_cpus()
        if value < 1:
            raise ValueError("must be at least 1, or auto")
        return value


class LimitSettings(ConfigModel):
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
