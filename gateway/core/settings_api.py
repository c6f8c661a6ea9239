"""``cors`` and ``passthrough``: what of the HTTP API browsers may use, and which other
OpenAI APIs are forwarded by model."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from gateway.core.settings_base import ConfigModel

__all__ = ["CORSSettings", "EXPOSED_HEADERS", "PASSTHROUGH_PATHS"]


# the OpenAI rate-limit headers and the gateway's own, which a page on another origin may read
EXPOSED_HEADERS = (
    "server-timing", "x-request-id", "x-edgegw-route", "x-cache", "age", "retry-after",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens", "x-edgegw-cache-original-id",
)


class CORSSettings(ConfigModel):
    """Cross-origin requests from browsers (``gateway.admission.cors``). Off unless
    ``allow_origins`` names an origin: a page on another origin gets no CORS headers."""

    allow_origins: tuple[str, ...] = ()  # origins allowed ("https://app.example.com"; "*": any); empty: CORS off
    allow_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")  # methods a preflight may ask for
    allow_headers: tuple[str, ...] = ("*",)  # request headers a page may send; "*": whatever its preflight asks (the SDKs' x-stainless-*)
    expose_headers: tuple[str, ...] = EXPOSED_HEADERS  # response headers a page may read
    allow_credentials: bool = False  # let pages send cookies or HTTP auth (the origin is then echoed, never "*")
    max_age: int = Field(600, ge=0)  # seconds a browser may cache a preflight's answer

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for origin in value:
            if origin != "*" and (urlsplit(origin).scheme not in ("http", "https") or urlsplit(origin).path not in ("", "/")):
                raise ValueError(f"not an origin: {origin!r} (scheme://host[:port], or *)")
        return tuple(o.rstrip("/") for o in value)

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)


# the pass-through APIs forwarded by model to the clusters serving it (a trailing * : every path below)
PASSTHROUGH_PATHS = (
    "/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/moderations", "/v1/rerank", "/v1/audio/*", "/v1/images/*",
)
