"""Which request headers go upstream: a transparent proxy's rules (RFC 9110 section 7.6.1).

End-to-end headers pass unchanged (``OpenAI-Organization``, ``OpenAI-Project``,
``traceparent``, vLLM's and users' own). These never do:

- hop-by-hop headers, any header the client's ``Connection`` header names, and a
  WebSocket handshake's ``Sec-WebSocket-*``;
- the client's credentials and cookies (each endpoint has its own ``api_key``);
- the gateway's own: framing (``host``, ``content-length``, ``content-type``), content
  codings (the gateway reads the answers it relays, so it asks for them uncompressed),
  ``x-request-id`` and ``x-latency-budget-ms`` (the gateway sends its own values), and the
  forwarding headers (the gateway is where the client's address is decided).

``forward_headers.allow`` (when not empty) narrows the rest to the names listed;
``forward_headers.deny`` adds names that never pass.
"""

from __future__ import annotations

__all__ = ["HeaderPolicy", "NEVER_FORWARDED"]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
    }
)
CREDENTIALS = frozenset({b"authorization", b"x-api-key", b"api-key", b"cookie", b"cookie2"})
GATEWAY_OWN = frozenset(
    {
        b"host",
        b"content-length",
        b"content-type",
        b"content-encoding",
        b"accept-encoding",
        b"x-request-id",
        b"x-latency-budget-ms",
        b"forwarded",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-real-ip",
        b"via",
    }
)
NEVER_FORWARDED = HOP_BY_HOP | CREDENTIALS | GATEWAY_OWN


class HeaderPolicy:
    """``forward(headers)``: the (name, value) pairs of a request's headers (ASGI form:
    lower-case bytes names) that go upstream, in their order."""

    __slots__ = ("_never", "_allow")

    def __init__(self, allow: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> None:
        self._never = NEVER_FORWARDED | {name.lower().encode("latin-1") for name in deny}
        self._allow = frozenset(name.lower().encode("latin-1") for name in allow) or None

    def forward(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        never = self._never
        allow = self._allow
        listed: set[bytes] | None = None
        out = []
        for name, value in headers:
            if name in never or name.startswith(b"sec-websocket-"):
                if name == b"connection":
                    listed = (listed or set()) | {t.strip().lower() for t in value.split(b",")}
                continue
            if allow is not None and name not in allow:
                continue
            out.append((name, value))
        if listed:
            out = [(n, v) for n, v in out if n not in listed]
        return out
