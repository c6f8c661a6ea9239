"""Tenants and their keys: who a request is for.

A request's API key (``Authorization: Bearer <key>``, ``x-api-key`` or ``api-key``) is
hashed once (SHA-256) and looked up among the configured tenants' key digests, and the
match is confirmed with ``hmac.compare_digest``. What is compared is a digest, never the
key, so how long a refusal takes says nothing about how close a guess was; keys are kept
as digests only, and a key is never logged, forwarded or put in a metric (metrics carry
the tenant's *name*).

``auth.mode``: ``off`` (keys are not checked: a key of a configured tenant selects it,
anything else is the ``anonymous`` tenant), ``optional`` (no key: anonymous; an unknown key:
401), ``required`` (no key or an unknown key: 401).
"""

from __future__ import annotations

import hashlib
import hmac
import os

from gateway.core.errors import AuthenticationError
from gateway.core.settings import AuthSettings, TenantSettings
from gateway.core.tenant import Tenant

__all__ = ["Tenants", "api_key_of"]

_KEY_HEADERS = (b"authorization", b"x-api-key", b"api-key")


def api_key_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name in _KEY_HEADERS:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    continue
                value = token
            value = value.strip()
            if value:
                return value
    return None


class Tenants:
    def __init__(self, auth: AuthSettings, tenants: tuple[TenantSettings, ...]) -> None:
        self.by_name: dict[str, Tenant] = {}
        self.reload(auth, tenants)

    def reload(self, auth: AuthSettings, tenants: tuple[TenantSettings, ...]) -> None:
        """Take a new configuration at once (a reload): keys no longer listed are refused
        from the next request on, new ones accepted. A tenant that stays keeps its
        ``Tenant`` (its requests in flight count against its new ``max_concurrency``).
        Every keys_file is read before anything changes: ``ValueError`` leaves all as it was."""
        keys = [(settings, _keys_of(settings)) for settings in tenants]
        by_name = {}
        for name, policy in (("anonymous", auth.anonymous), *((t.name, t) for t, _ in keys)):
            tenant = self.by_name.get(name)
            if tenant is None:
                tenant = Tenant(name, policy)
            else:
                tenant.update(policy)
            by_name[name] = tenant
        by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        for settings, tenant_keys in keys:
            for key in tenant_keys:
                digest = _digest_of(key)
                by_digest[digest] = (digest, by_name[settings.name])
        self.mode = auth.mode
        self.anonymous = by_name["anonymous"]
        self.by_name = by_name
        self._by_digest = by_digest

    def identify(self, headers: list[tuple[bytes, bytes]]) -> Tenant:
        """The tenant a request's key names, or ``AuthenticationError`` (401) by ``auth.mode``."""
        key = api_key_of(headers)
        if key is None:
            if self.mode == "required":
                raise AuthenticationError(
                    "You didn't provide an API key. Provide it in the Authorization header (Bearer auth)."
                )
            return self.anonymous
        digest = hashlib.sha256(key).digest()
        found = self._by_digest.get(digest)
        if found is not None and hmac.compare_digest(found[0], digest):
            return found[1]
        if self.mode == "off":
            return self.anonymous
        raise AuthenticationError("Incorrect API key provided.")


def _keys_of(settings: TenantSettings) -> list[str]:
    return keys_of(settings, f"tenant {settings.name}")


def keys_of(settings, owner: str) -> list[str]:
    """The keys of ``settings`` (a tenant's or ``admin``: ``keys``, ``keys_env``,
    ``keys_file``), read now; ``ValueError`` naming ``owner`` when the file cannot be read."""
    keys = [k.get_secret_value() for k in settings.keys]
    if settings.keys_env:
        keys += [k.strip() for k in os.environ.get(settings.keys_env, "").split(",") if k.strip()]
    if settings.keys_file:
        try:
            with open(settings.keys_file, encoding="utf-8") as file:
                text = file.read()
        except OSError as exc:
            raise ValueError(f"{owner}: keys_file {settings.keys_file}: {exc.strerror or exc}") from None
        keys += [k.strip() for line in text.splitlines() for k in line.split(",") if k.strip()]
    return keys


def digest_of(key: str) -> bytes:
    """The SHA-256 digest a key is kept as (``sha256:<hex>`` is one already)."""
    return _digest_of(key)


def _digest_of(key: str) -> bytes:
    if key.startswith("sha256:"):
        return bytes.fromhex(key[len("sha256:"):])
    return hashlib.sha256(key.encode()).digest()
