"""What one client connection may cost the gateway, and the answers the listeners give of their own.

HTTP/2 and HTTP/3 let one connection ask for work that no request pays for: a stream opened
and reset at once (the 2023 "rapid reset", CVE-2023-44487), PINGs and SETTINGS the server
must answer, empty frames, endless header blocks. A ``FloodGuard`` counts them per
connection, as nghttp2's reset limiter, Envoy's ``max_*_frames`` and Go's and h2o's fixes do:
for each kind a token bucket that holds ``limit`` frames and refills at ``limit`` per
``limits.flood_interval_s``. A connection that empties one is told GOAWAY
(ENHANCE_YOUR_CALM; HTTP/3: H3_EXCESSIVE_LOAD) and closed by its listener. Sans-I/O: the
caller passes ``now``.

The rest of this module is what every listener answers by itself, in the OpenAI error
shape: ``error_body`` and ``refusal`` (an ASGI app answering one fixed error), and
``header_problem`` (``limits.max_header_count`` / ``max_header_bytes`` applied to an HTTP/2
or HTTP/3 header list, as ``http1.py`` applies them to HTTP/1.1 heads).
"""

from __future__ import annotations

import math
from typing import Any

from gateway.core.errors import error_body as openai_error_body
from gateway.core.settings import LimitSettings

__all__ = [
    "CONTROL",
    "EMPTY",
    "PINGS",
    "RESETS",
    "SETTINGS",
    "FloodGuard",
    "error_body",
    "header_block_cap",
    "header_problem",
    "refusal",
    "too_many_bytes",
    "too_many_connections",
]

# the kinds of work a FloodGuard counts (indices into its buckets)
RESETS, PINGS, SETTINGS, EMPTY, CONTROL = range(5)
_NAMES = ("stream resets", "PING frames", "SETTINGS frames", "empty frames", "control frames")
_KEYS = ("max_stream_resets", "max_pings", "max_settings", "max_empty_frames", "max_control_frames")


class FloodGuard:
    """Per-connection token buckets, one per kind (``RESETS`` ... ``CONTROL``)."""

    __slots__ = ("_caps", "_rates", "_tokens", "_stamps", "exceeded")

    def __init__(self, limits: LimitSettings, now: float) -> None:
        self._caps = [float(getattr(limits, key)) for key in _KEYS]
        self._rates = [cap / limits.flood_interval_s for cap in self._caps]
        self._tokens = list(self._caps)
        self._stamps = [now] * len(_KEYS)
        self.exceeded: int | None = None  # the first kind found over its limit

    def spend(self, kind: int, now: float) -> bool:
        """Count one frame of ``kind``; False (and ``exceeded`` set) when over the limit."""
        tokens = self._tokens[kind] + (now - self._stamps[kind]) * self._rates[kind]
        cap = self._caps[kind]
        if tokens > cap:
            tokens = cap
        self._stamps[kind] = now
        if tokens < 1.0:
            self._tokens[kind] = tokens
            if self.exceeded is None:
                self.exceeded = kind
            return False
        self._tokens[kind] = tokens - 1.0
        return True

    def describe(self, limits: LimitSettings) -> str:
        """What was exceeded, for the log and the GOAWAY's debug data."""
        kind = self.exceeded
        if kind is None:
            return ""
        return f"more than {getattr(limits, _KEYS[kind])} {_NAMES[kind]} per {limits.flood_interval_s:g} s (limits.{_KEYS[kind]})"

    def __repr__(self) -> str:
        tokens = ", ".join(f"{key}={tokens:.0f}" for key, tokens in zip(_KEYS, self._tokens))
        return f"<FloodGuard {tokens}{' exceeded' if self.exceeded is not None else ''}>"


# -- answers of the listeners' own ----------------------------------------------------------


def error_body(status: int, code: str, message: str) -> bytes:
    """The OpenAI-shaped body of a listener's own refusal (``gateway.core.errors.error_body``)."""
    return openai_error_body(message, "server_error" if status >= 500 else "invalid_request_error", None, code)


def refusal(status: int, code: str, message: str, headers: list[tuple[bytes, bytes]] = ()):
    """An ASGI app answering every request with ``status`` and an OpenAI error; it never
    reads the request body (the listener returns its flow-control credit)."""
    body = error_body(status, code, message)
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers],
    }
    end = {"type": "http.response.body", "body": body}

    async def app(scope: dict[str, Any], receive, send) -> None:
        await send(start)
        await send(end)

    return app


def too_many_connections(limits: LimitSettings):
    retry_after = b"%d" % max(1, math.ceil(limits.retry_after_s))
    return refusal(
        503,
        "too_many_connections",
        "the gateway has as many connections as it accepts; retry shortly",
        [(b"retry-after", retry_after)],
    )


def too_many_bytes(limit: int) -> str:
    return f"the request line and headers may take at most {limit} bytes"


def header_problem(headers: list[tuple[bytes, bytes]], limits: LimitSettings) -> str | None:
    """Why an HTTP/2 or HTTP/3 header list (pseudo-headers included) is over the limits, or
    None. Sizes count as HTTP/1.1's do: name, value and 4 bytes (``: `` and CRLF) each;
    the count is of the regular fields."""
    size = 0
    count = 0
    for name, value in headers:
        size += len(name) + len(value) + 4
        if name[:1] != b":":
            count += 1
    if count > limits.max_header_count:
        return f"a request may have at most {limits.max_header_count} headers"
    if size > limits.max_header_bytes:
        return too_many_bytes(limits.max_header_bytes)
    return None


def header_block_cap(limits: LimitSettings) -> int:
    """The largest HTTP/2 header block a connection may send: its HEADERS and CONTINUATION
    payloads, and the decoded list as HPACK counts it (names, values and 32 bytes a field).
    It admits every list within ``max_header_bytes`` and ``max_header_count``, and one
    with up to twice the fields: those are decoded and answered 431 on their stream. Past
    it the connection is closed (ENHANCE_YOUR_CALM): a block must be decoded to keep
    HPACK's table in step with the client, and decoding is what costs (hpack is pure
    Python: about 1 ms per KiB), so its size is what bounds that cost (Go's fix for
    CVE-2023-45288 closes the connection the same way)."""
    return limits.max_header_bytes + 32 * (2 * limits.max_header_count + 8)
