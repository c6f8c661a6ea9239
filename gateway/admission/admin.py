"""Who may reach the admin paths: ``/metrics``, ``/debug/*``, ``/dashboard`` (and its feed)
and ``/admin/*``.

Two protections, alone or together (``AdminGuard``, pure ASGI middleware in front of the
small routes):

- ``listen.admin``: a listener of its own (``gateway.ingress.Server`` opens it). The admin
  paths are then served there only; the public listeners answer them 404, as paths they do
  not have. A network policy (or a port that is not published) keeps the admin port away
  from clients.
- ``admin.keys`` / ``keys_env`` / ``keys_file``: an admin path answers 401 without one of
  the keys, given as ``Authorization: Bearer <key>``, ``x-api-key: <key>`` or HTTP Basic
  auth with the key as the password (what a browser sends for ``/dashboard`` and its
  ``EventSource`` after asking once: the 401 carries ``WWW-Authenticate: Basic``; what
  Prometheus sends with ``authorization`` or ``basic_auth`` in its scrape config). Keys are
  kept and compared as SHA-256 digests, as the tenants' are.

With neither, ``/metrics``, ``/debug/latency`` and ``/dashboard`` stay open as before, and
``/admin/*`` (which changes the gateway or reads every tenant's usage) answers 403 until one
is configured. A node's own Unix sockets (a worker asking its siblings for their counts:
``gateway.node.siblings``) are private to the node (their directory is mode 0700) and pass.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from gateway.admission.tenants import api_key_of, digest_of, keys_of
from gateway.core.errors import error_body
from gateway.core.settings import Settings

__all__ = ["ADMIN_PREFIXES", "AdminGuard", "AdminKeys", "is_admin_path"]

ADMIN_PREFIXES = ("/metrics", "/debug/", "/dashboard", "/admin/")
_JSON = (b"content-type", b"application/json")
_CHALLENGE = (b"www-authenticate", b'Basic realm="edgegw admin", charset="UTF-8"')


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


class AdminKeys:
    """The admin keys as digests; ``allows(headers)`` checks a request's key."""

    def __init__(self, settings) -> None:
        self._digests = [digest_of(key) for key in keys_of(settings, "admin")]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        key = api_key_of(headers) or _basic_password(headers)
        if key is None:
            return False
        digest = hashlib.sha256(key).digest()
        found = False
        for known in self._digests:  # every one compared: the time says nothing of which matched
            found |= hmac.compare_digest(known, digest)
        return found


def _basic_password(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"basic":
                try:
                    decoded = base64.b64decode(token.strip(), validate=True)
                except (binascii.Error, ValueError):
                    return None
                password = decoded.partition(b":")[2]
                return password or None
    return None


class AdminGuard:
    """ASGI middleware: the admin paths answered only where ``listen.admin`` and
    ``admin.keys`` allow (see the module docstring); everything else passes untouched.
    ``reload(settings)`` takes new keys at once (the admin listener's port cannot change
    without a restart)."""

    def __init__(self, app, settings: Settings) -> None:
        self.app = app
        admin = settings.listen.admin
        self.port = admin.port if admin is not None else None
        self.keys = AdminKeys(settings.admin)

    def reload(self, settings: Settings) -> None:
        self.keys = AdminKeys(settings.admin)  # raises ValueError (an unreadable keys_file) before changing anything

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or not is_admin_path(scope["path"]):
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code, headers = refusal
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error_body(message, "invalid_request_error" if status != 401 else "authentication_error", None, code)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope) -> tuple[int, str, str, list] | None:
        """None when ``scope`` may reach its admin path; else (status, message, code, headers)."""
        server = scope.get("server")
        if server is not None and server[1] is None:
            return None  # the node's own Unix socket (a sibling worker)
        on_admin = self.port is not None and server is not None and server[1] == self.port
        if self.port is not None and not on_admin:
            return 404, f"no route for {scope.get('method', 'GET')} {scope['path']}", "not_found", []
        if self.keys:
            if self.keys.allows(scope["headers"]):
                return None
            return 401, "this path needs an admin key (admin.keys)", "invalid_admin_key", [_CHALLENGE]
        if scope["path"].startswith("/admin/") and not on_admin:
            return 403, "the admin API needs listen.admin or admin.keys in the configuration", "admin_not_configured", []
        return None
