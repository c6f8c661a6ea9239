"""What may be cached, for how long, and what the client's `Cache-Control` asks for.

Only deterministic requests are cached: `temperature` 0 (or absent where the models'
default is greedy), or an explicit `seed`; `n` > 1 never. Only complete, non-error
responses are stored (`is_complete_body`, `is_complete_stream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

# finish_reason values that mean the response is not a real, complete answer
FAILED_FINISH_REASONS = frozenset({"error", "abort", "aborted", "cancelled"})


@dataclass(frozen=True, slots=True)
class Directives:
    """The request's `Cache-Control` directives that the cache honours."""

    no_cache: bool = False  # skip the lookup, store the fresh answer
    no_store: bool = False  # neither read nor write
    max_age: float | None = None  # accept an entry at most this many seconds old
    only_if_cached: bool = False  # answer from the cache or not at all (gateway: 504)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with one request: look up? store the answer? how old may a hit be?
    ``only_if_cached``: a miss must not go upstream (the gateway answers 504)."""

    lookup: bool
    store: bool
    max_age: float | None
    ttl: float
    reason: str
    only_if_cached: bool = False


def parse_cache_control(header: str | None) -> Directives:
    """Parse a request `Cache-Control` header. Unknown or malformed directives are ignored."""
    if not header:
        return Directives()
    no_cache = no_store = only_if_cached = False
    max_age: float | None = None
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        name = name.strip().lower()
        value = value.strip().strip('"')
        if name == "no-cache":
            no_cache = True
        elif name == "no-store":
            no_store = True
        elif name == "only-if-cached":
            only_if_cached = True
        elif name == "max-age" and value.isdigit():
            seconds = float(int(value))
            max_age = seconds if max_age is None else min(max_age, seconds)
    return Directives(no_cache, no_store, max_age, only_if_cached)


def is_deterministic(body: dict[str, Any], default_greedy: bool = True) -> tuple[bool, str]:
    """Whether the request always produces the same answer, and why not."""
    n = body.get("n")
    if n is not None and n != 1:
        return False, "n>1"
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            return False, "invalid"
        return True, "seed"
    temperature = body.get("temperature")
    if temperature is None:
        return (True, "greedy") if default_greedy else (False, "nondeterministic")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return False, "invalid"
    if temperature == 0:
        return True, "greedy"
    return False, "nondeterministic"


def plan(
    body: dict[str, Any], directives: Directives, ttl: float, default_greedy: bool = True
) -> Plan:
    """Decide lookup/store for a request `body` with route TTL `ttl` (seconds)."""
    only = directives.only_if_cached
    if directives.no_store:
        return Plan(False, False, None, ttl, "no-store", only)
    ok, why = is_deterministic(body, default_greedy)
    if not ok:
        return Plan(False, False, None, ttl, why, only)
    if ttl <= 0:
        return Plan(False, False, None, ttl, "ttl=0", only)
    if directives.no_cache:
        return Plan(False, True, None, ttl, "no-cache", only)
    if directives.max_age is not None:
        if directives.max_age <= 0:
            return Plan(False, True, 0.0, ttl, "max-age=0", only)
        return Plan(True, True, directives.max_age, ttl, "max-age", only)
    return Plan(True, True, None, ttl, "cacheable", only)


def usage_fields(body: dict[str, Any]) -> dict[str, Any] | None:
    """Fields that make a stream's upstream end with its usage chunk, or None (not a stream,
    or the client asked for it already). The client that did not ask must not see it
    (``replay.is_usage_chunk`` finds it)."""
    if body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        return None
    return {"stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}


def recording_fields(body: dict[str, Any], plan: Plan) -> dict[str, Any] | None:
    """Fields to set on the request sent upstream so that its answer can be stored whole, or
    None: a stored stream keeps its usage chunk (stored entries answer clients that want it)."""
    return usage_fields(body) if plan.store else None


def _choices_complete(choices: Any, finished: dict[int, Any]) -> bool:
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            return False
        reason = choice.get("finish_reason")
        if reason is not None:
            finished[choice.get("index", 0)] = reason
    return True


def _finished_ok(finished: dict[int, Any], indices: set[int]) -> bool:
    if not indices or indices - finished.keys():
        return False
    return not any(str(r) in FAILED_FINISH_REASONS for r in finished.values())


def is_complete_body(body: bytes) -> bool:
    """A JSON completion response that may be stored: no error, every choice finished (or
    an embeddings list: a vector per input)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(doc, dict) or "error" in doc:
        return False
    if doc.get("object") == "list":  # embeddings: a vector per input, nothing to finish
        data = doc.get("data")
        return isinstance(data, list) and bool(data) and all(isinstance(d, dict) and "embedding" in d for d in data)
    choices = doc.get("choices")
    finished: dict[int, Any] = {}
    if not choices or not _choices_complete(choices, finished):
        return False
    indices = {c.get("index", 0) for c in choices}
    return _finished_ok(finished, indices)


def is_complete_stream(chunks: list[bytes], saw_done: bool = True) -> bool:
    """A streamed response (SSE data payloads, without `[DONE]`) that may be stored:
    the stream ended with `[DONE]`, no chunk is an error, every choice has a finish_reason."""
    if not saw_done or not chunks:
        return False
    finished: dict[int, Any] = {}
    indices: set[int] = set()
    for chunk in chunks:
        try:
            doc = orjson.loads(chunk)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(doc, dict) or "error" in doc:
            return False
        choices = doc.get("choices", [])
        if not _choices_complete(choices, finished):
            return False
        indices.update(c.get("index", 0) for c in choices)
    return _finished_ok(finished, indices)
