"""Canonical request → cache key.

A key is `v1:<kind>:<hex>` where `<hex>` is a blake2b digest over length-prefixed parts:
the tenant, the route kind, the model and the canonical bytes of the request's semantic
fields. Canonical means: keys sorted, `null` members dropped (absent and null mean the same
to the OpenAI API), integral floats written as integers (`0.0` == `0`, `-0.0` == `0`),
`stop: "x"` == `stop: ["x"]`, `n: 1` == no `n`. Fields that do not change the answer
(`stream`, `stream_options`, `user`, request ids, metadata...) are left out, so a streamed
and a non-streamed ask of the same thing share one entry. The tenant is hashed in, so two
tenants never share an entry.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import Any

import orjson

SCHEMA_VERSION = "v1"
KINDS = ("chat", "completions", "embeddings")

# Top-level request fields that do not change the response content.
IGNORED_FIELDS = frozenset(
    {
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "request_id",
        "safety_identifier",
        "prompt_cache_key",
    }
)


def _normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    if isinstance(value, bool):  # before the number check: True is an int
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 0.0, -0.0 and 0 are one value
    return value


def canonical_body(body: dict[str, Any]) -> bytes:
    """The request's semantic fields as canonical JSON bytes."""
    semantic = {
        k: v for k, v in body.items() if k not in IGNORED_FIELDS and v is not None
    }
    stop = semantic.get("stop")
    if isinstance(stop, str):
        semantic["stop"] = [stop]
    if semantic.get("n") == 1:
        del semantic["n"]
    return orjson.dumps(_normalise(semantic), option=orjson.OPT_SORT_KEYS)


def make_key(
    tenant: str, kind: str, body: dict[str, Any], vary: tuple[tuple[str, str], ...] = ()
) -> str:
    """The cache key of a request `body` for `tenant` on route `kind` ("chat"|"completions").

    `vary`: (name, value) of the request headers that change the answer (the `Vary` idea:
    the gateway forwards headers, and an upstream may answer differently by them), names
    lower-cased, in a fixed order; a header absent from the request is absent here."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    model = body.get("model")
    parts = (
        tenant.encode(),
        kind.encode(),
        str(model).encode() if model is not None else b"",
        canonical_body(body),
        *(f"{name}:{value}".encode() for name, value in vary),
    )
    h = blake2b(digest_size=32, person=b"edgegw.cache.v1")
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return f"{SCHEMA_VERSION}:{kind}:{h.hexdigest()}"
