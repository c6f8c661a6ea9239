"""The exact-response cache on the gateway's path: plan, look up, coalesce, record, store.

``cache/`` owns keys, policy (what is cacheable, ``only-if-cached``, what to ask upstream so
an answer can be stored), backends, replay and single-flight; this module applies them to
one request: its tenant and the headers that vary the answer, a hit replayed in the shape
asked for, and the answer of the request that goes upstream (the single-flight leader)
recorded, published to its followers and stored once complete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import orjson
from prometheus_client import CollectorRegistry

import cache
from cache import CacheConfig, CacheMetrics, Entry, Flight, Plan, as_chunks, as_json
from gateway.core.openai import ParsedRequest
from gateway.core.sse import sse_payloads
from gateway.replies import FollowerReply, ReplayReply

__all__ = ["BYPASS", "CACHED_APIS", "HIT", "MISS", "CacheLayer", "Lookup", "Recorder", "fresh_ids"]

logger = logging.getLogger("edgegw.cache")

CACHED_APIS = frozenset({"embeddings"})  # the pass-through APIs whose answers are deterministic


def fresh_ids(payloads: list[bytes], request_id: bytes) -> tuple[list[bytes], bytes | None]:
    """``payloads`` (a body, or a stream's chunks) with the stored ``id`` replaced by one
    made from this request's id (same prefix: ``chatcmpl-``, ``cmpl-``) and ``created`` by
    now; and the stored id (None when the answer has none, as embeddings have not)."""
    original: str | None = None
    new_id: str | None = None
    now = int(time.time())
    out = []
    for payload in payloads:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            out.append(payload)
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("id"), str):
            out.append(payload)
            continue
        if new_id is None:
            original = doc["id"]
            prefix, dash, _ = original.partition("-")
            new_id = (prefix + "-" if dash else "") + request_id.decode("ascii", "replace")
        doc["id"] = new_id
        if "created" in doc:
            doc["created"] = now
        out.append(orjson.dumps(doc))
    return out, None if original is None else original.encode("ascii", "replace")

HIT, MISS, BYPASS = b"HIT", b"MISS", b"BYPASS"


class Lookup:
    """One request's plan and key; ``fields``: what to change in the request sent upstream
    so that its answer can be stored (None: nothing)."""

    __slots__ = ("plan", "key", "fields")

    def __init__(self, plan: Plan, key: str | None, fields: dict | None) -> None:
        self.plan = plan
        self.key = key
        self.fields = fields


class CacheLayer:
    def __init__(self, config: CacheConfig, registry: CollectorRegistry, metrics: CacheMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else CacheMetrics(registry=registry)  # a reload's new layer keeps the counters
        self.backend = cache.build(config, self.metrics)
        self.flights = cache.build_singleflight(config, self.metrics)

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    async def start(self) -> None:
        ping = getattr(self.backend, "ping", None) or getattr(getattr(self.backend, "back", None), "ping", None)
        if ping is not None:
            await ping()  # connect now, so the first request does not pay for it

    async def aclose(self) -> None:
        if self.flights is not None:
            await self.flights.close()
        if self.backend is not None:
            await self.backend.close()

    def plan(self, parsed: ParsedRequest, tenant: str, headers: Mapping[str, str]) -> Lookup:
        directives = cache.parse_cache_control(headers.get("cache-control"))
        if parsed.passthrough and parsed.kind not in CACHED_APIS:
            plan = cache.Plan(False, False, None, 0.0, "api", directives.only_if_cached)
            self.metrics.bypass(plan.reason)
            return Lookup(plan, None, None)
        # embeddings are deterministic: no sampling to make an answer differ
        greedy = self.config.default_greedy or parsed.kind == "embeddings"
        plan = cache.plan(parsed.data, directives, self.config.ttl_for(parsed.kind), greedy)
        if not plan.lookup and not plan.store:
            self.metrics.bypass(plan.reason)
            return Lookup(plan, None, None)
        vary = tuple((name, headers[name]) for name in self.config.vary_headers if name in headers)
        key = cache.make_key(tenant, parsed.kind, parsed.data, vary)
        return Lookup(plan, key, cache.recording_fields(parsed.data, plan))

    async def get(self, lookup: Lookup) -> Entry | None:
        return await self.backend.get(lookup.key, max_age=lookup.plan.max_age)

    def replay(self, entry: Entry, parsed: ParsedRequest, request_id: bytes) -> tuple[ReplayReply, bytes | None]:
        """The hit as a reply, with an ``id`` and ``created`` of its own (a client may key on
        them; two answers never share one), and the stored answer's ``id``."""
        if parsed.stream:
            chunks, original = fresh_ids(as_chunks(entry, parsed.include_usage), request_id)
            return ReplayReply(None, chunks), original
        body, original = fresh_ids([as_json(entry)], request_id)
        return ReplayReply(body[0], None), original

    async def join(self, key: str) -> Flight | None:
        if self.flights is None:
            return None
        return await self.flights.join(key)

    def follower(self, flight: Flight, parsed: ParsedRequest, ping: float) -> FollowerReply:
        return FollowerReply(flight, parsed.stream, parsed.include_usage, ping)

    async def store(self, lookup: Lookup, entry: Entry) -> None:
        await self.backend.set(lookup.key, entry, lookup.plan.ttl)


class Recorder:
    """Records the leader's answer as it is relayed (every chunk, the usage chunk included:
    a stored entry answers clients that want usage), publishes it to followers, and stores
    it when it completed."""

    __slots__ = ("layer", "lookup", "flight", "kind", "chunks", "saw_done", "body")

    def __init__(self, layer: CacheLayer, lookup: Lookup, flight: Flight | None, kind: str) -> None:
        self.layer = layer
        self.lookup = lookup
        self.flight = flight
        self.kind = kind
        self.chunks: list[bytes] = []  # the flight holds them for followers anyway
        self.saw_done = False
        self.body: bytes | None = None

    async def feed(self, events: bytes) -> None:
        """Record a run of SSE events."""
        for payload in sse_payloads(events):
            if payload == b"[DONE]":
                self.saw_done = True
                continue
            self.chunks.append(payload)
            if self.flight is not None:
                await self.flight.publish(payload)

    async def finish(self, ok: bool) -> bool:
        """Hand the entry to the followers and store it (the backend refuses one over
        ``max_entry_bytes``) if the answer is complete; else abort the flight."""
        entry = None
        if ok:
            if self.body is not None:
                if cache.is_complete_body(self.body):
                    entry = Entry(self.kind, body=self.body, created_at=time.time())
            elif self.chunks and cache.is_complete_stream(self.chunks, self.saw_done):
                entry = Entry(self.kind, chunks=self.chunks, created_at=time.time())
        if entry is None:
            if self.flight is not None:
                await self.flight.abort("the answer was not complete")
            return False
        if self.flight is not None:
            await self.flight.finish(entry)
        await self.layer.store(self.lookup, entry)
        return True
