"""Cross-origin requests from browsers: ``CORSMiddleware``, in front of everything.

A page on another origin calling the gateway with ``fetch`` first sends a preflight
(``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``): it carries no API key,
so it is answered here, before authentication, rate limits and routing, and costs nothing
else. The actual request then goes through admission like any other, and its response,
whatever it is (a stream, a JSON answer, a 401 or a 429 refusal, ``/v1/models``, the
dashboard's feed), gets the CORS headers on its way out when its ``Origin`` is allowed: a
page can read an error's body and ``Retry-After``, not only a success. Headers an upstream
sent under ``Access-Control-*`` never reach the client: the gateway's policy is the one.

Pure ASGI (Starlette's ``middleware/cors.py`` habit: configuration in ``__init__``, one
decision per request); a request without ``Origin`` (every non-browser client) goes
straight through with its own ``send``, so the hot path pays one header lookup.
"""

from __future__ import annotations

from gateway.core.errors import error_body
from gateway.core.settings import CORSSettings

__all__ = ["CORSMiddleware"]

_VARY = (b"vary", b"Origin")


class CORSMiddleware:
    def __init__(self, app, settings: CORSSettings) -> None:
        self.app = app
        self.any_origin = "*" in settings.allow_origins
        self.origins = frozenset(o.encode() for o in settings.allow_origins if o != "*")
        self.methods = frozenset(m.upper().encode() for m in settings.allow_methods)
        self.any_header = "*" in settings.allow_headers
        self.headers = frozenset(h.lower().encode() for h in settings.allow_headers if h != "*")
        self.credentials = settings.allow_credentials
        self.max_age = str(settings.max_age).encode()
        self.expose = ", ".join(settings.expose_headers).encode()
        self.methods_value = ", ".join(sorted(settings.allow_methods)).encode()

    def allowed(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    def _allow_origin(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        # with credentials a browser refuses "*": the origin is echoed (and the answer varies by it)
        if self.any_origin and not self.credentials:
            headers = [(b"access-control-allow-origin", b"*")]
        else:
            headers = [(b"access-control-allow-origin", origin), _VARY]
        if self.credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        return headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = method = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                method = value
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and method is not None:
            await self._preflight(scope, send, origin, method)
            return
        await self.app(scope, receive, self._sender(send, origin))

    def _sender(self, send, origin: bytes):
        """``send`` with the CORS headers added to the response's head (an allowed origin),
        and any upstream's ``Access-Control-*`` taken out."""
        extra = [*self._allow_origin(origin), (b"access-control-expose-headers", self.expose)] if self.allowed(origin) else []

        async def cors_send(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if not k.lower().startswith(b"access-control-")]
                message = {**message, "headers": headers + extra}
            await send(message)

        return cors_send

    async def _preflight(self, scope, send, origin: bytes, method: bytes) -> None:
        requested = b""
        for name, value in scope["headers"]:
            if name == b"access-control-request-headers":
                requested = value
        asked = [h.strip().lower() for h in requested.split(b",") if h.strip()]
        refused = []
        if not self.allowed(origin):
            refused.append("origin")
        if method.upper() not in self.methods:
            refused.append("method")
        if not self.any_header and any(h not in self.headers for h in asked):
            refused.append("headers")
        if refused:
            body = error_body(f"CORS preflight refused: disallowed {', '.join(refused)}", "invalid_request_error", None, "cors_refused")
            head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), _VARY]
            await send({"type": "http.response.start", "status": 403, "headers": head})
            await send({"type": "http.response.body", "body": body})
            return
        headers = [
            *self._allow_origin(origin),
            (b"access-control-allow-methods", self.methods_value),
            (b"access-control-max-age", self.max_age),
            (b"content-length", b"0"),
        ]
        if asked:
            headers.append((b"access-control-allow-headers", b", ".join(asked)))
        if not any(k == b"vary" for k, _ in headers):
            headers.append(_VARY)
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
