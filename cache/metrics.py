"""`CacheMetrics`: the cache's counters and histograms, in one object the gateway exports.

Prometheus objects are created against a caller-supplied `registry`; with the default
`registry=None` they are not registered anywhere (tests, and backends built without a
shared metrics object), so creating many never collides. The gateway creates one with
`prometheus_client.REGISTRY` (or its own registry) and passes it to every backend.

`counts` mirrors every counter as plain numbers ("hits", "hits:memory", ...) for tests,
`repr` and `edgegw explain`.
"""

from __future__ import annotations

import time

from collections import Counter as _Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "edgegw_cache"):
        self.counts: _Tally[str] = _Tally()
        self._children: dict[tuple, object] = {}
        r = registry
        self._hits = Counter(f"{prefix}_hits", "Cache hits", ["tier"], registry=r)
        self._misses = Counter(f"{prefix}_misses", "Cache misses", ["tier"], registry=r)
        self._bypasses = Counter(
            f"{prefix}_bypasses", "Requests that skipped the cache", ["reason"], registry=r
        )
        self._coalesced = Counter(
            f"{prefix}_coalesced_followers",
            "Requests that followed an identical in-flight request",
            ["scope"],
            registry=r,
        )
        self._stores = Counter(f"{prefix}_stores", "Entries stored", ["tier"], registry=r)
        self._stored_bytes = Counter(
            f"{prefix}_stored_bytes", "Bytes of entries stored", ["tier"], registry=r
        )
        self._evictions = Counter(
            f"{prefix}_evictions", "Entries evicted to stay within the byte bound", ["tier"],
            registry=r,
        )
        self._rejected = Counter(
            f"{prefix}_rejected", "Entries not stored", ["tier", "reason"], registry=r
        )
        self._errors = Counter(
            f"{prefix}_errors", "Backend errors (mapped to misses)", ["backend", "op"],
            registry=r,
        )
        self._skipped = Counter(
            f"{prefix}_skipped", "Backend calls skipped while its circuit is open",
            ["backend", "op"], registry=r,
        )
        self._lookup = Histogram(
            f"{prefix}_lookup_seconds", "Cache lookup latency", ["tier"],
            buckets=LOOKUP_BUCKETS, registry=r,
        )
        self._memory_bytes = Gauge(
            f"{prefix}_memory_bytes", "Bytes held by the in-memory tier", registry=r
        )
        self._memory_entries = Gauge(
            f"{prefix}_memory_entries", "Entries held by the in-memory tier", registry=r
        )

    def _child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once (``labels`` checks and locks per call)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _count(self, name: str, label: str, n: float = 1) -> None:
        self.counts[name] += n
        self.counts[f"{name}:{label}"] += n

    def hit(self, tier: str) -> None:
        self._child(self._hits, tier).inc()
        self._count("hits", tier)

    def miss(self, tier: str) -> None:
        self._child(self._misses, tier).inc()
        self._count("misses", tier)

    def bypass(self, reason: str) -> None:
        self._child(self._bypasses, reason).inc()
        self._count("bypasses", reason)

    def coalesced(self, scope: str) -> None:
        self._child(self._coalesced, scope).inc()
        self._count("coalesced", scope)

    def stored(self, tier: str, nbytes: int) -> None:
        self._child(self._stores, tier).inc()
        self._child(self._stored_bytes, tier).inc(nbytes)
        self._count("stores", tier)
        self._count("stored_bytes", tier, nbytes)

    def evicted(self, tier: str, n: int = 1) -> None:
        self._child(self._evictions, tier).inc(n)
        self._count("evictions", tier, n)

    def rejected(self, tier: str, reason: str) -> None:
        self._child(self._rejected, tier, reason).inc()
        self._count("rejected", f"{tier}:{reason}")

    def error(self, backend: str, op: str) -> None:
        self._child(self._errors, backend, op).inc()
        self._count("errors", f"{backend}:{op}")

    def skipped(self, backend: str, op: str) -> None:
        """A call not made because the backend's circuit is open (after an error)."""
        self._child(self._skipped, backend, op).inc()
        self._count("skipped", f"{backend}:{op}")

    def looked_up(self, tier: str, hit: bool, started: float) -> None:
        """One lookup in ``tier``: a hit or a miss, and its latency since ``started``
        (a ``time.perf_counter()`` reading)."""
        if hit:
            self.hit(tier)
        else:
            self.miss(tier)
        self.observe_lookup(tier, time.perf_counter() - started)

    def observe_lookup(self, tier: str, seconds: float) -> None:
        self._child(self._lookup, tier).observe(seconds)
        self.counts["lookups"] += 1

    def memory_usage(self, nbytes: int, entries: int) -> None:
        self._memory_bytes.set(nbytes)
        self._memory_entries.set(entries)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v:g}" for k, v in sorted(self.counts.items()) if ":" not in k)
        return f"<CacheMetrics {shown}>"
