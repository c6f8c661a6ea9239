"""The inference servers' own load signals: their Prometheus text -> ``ServerLoad``.

vLLM, SGLang and llama.cpp's C++ server publish on ``GET /metrics`` what a router would
most like to know about them: how many requests are running, how many wait, how full the
KV cache is and how often the prefix cache hits. The gateway fetches that text (its I/O,
on an interval, in ``gateway/upstream/load.py``); this module reads it, sans-I/O, into one
``ServerLoad`` per endpoint that ``HealthState.record_load`` keeps and the balancer merges
with what the gateway measures itself (EWMA TTFT, its own in-flight count).

Names, as the servers publish them today (checked against their source):

=========  ==========================================  ===========================================
source     metric                                      meaning here
=========  ==========================================  ===========================================
vllm       ``vllm:num_requests_running`` (gauge)        running
vllm       ``vllm:num_requests_waiting`` (gauge)        waiting
vllm       ``vllm:kv_cache_usage_perc`` (gauge, 0-1)    KV use (older releases:
                                                       ``vllm:gpu_cache_usage_perc``)
vllm       ``vllm:prefix_cache_queries_total`` /        prefix hit rate, from the counters' change
           ``vllm:prefix_cache_hits_total`` (counters)  between two polls (tokens hit / queried)
sglang     ``sglang:num_running_reqs`` (gauge)          running
sglang     ``sglang:num_queue_reqs`` (gauge)            waiting
sglang     ``sglang:token_usage`` (gauge, 0-1)          KV use
sglang     ``sglang:cache_hit_rate`` (gauge, 0-1)       prefix hit rate
llamacpp   ``llamacpp:requests_processing`` (gauge)     running (``--metrics``)
llamacpp   ``llamacpp:requests_deferred`` (gauge)       waiting
llamacpp   ``llamacpp:kv_cache_usage_ratio`` (gauge)    KV use (builds before the KV-cache view
                                                       was removed; absent in current ones)
=========  ==========================================  ===========================================

vLLM labels every sample with ``model_name`` and ``engine`` (one series per data-parallel
engine), SGLang with ``model_name`` (and ``engine_type``, ``tp_rank``, ``pp_rank``, or
``dp_rank``): counts are summed over engines / data-parallel ranks, duplicates of one
engine across tensor- or pipeline-parallel ranks are counted once, ratios are averaged.

``detect_source`` reads the ``owned_by`` of a ``GET /v1/models`` answer (``vllm``,
``sglang``, ``llamacpp``): the gateway already fetches that list to discover models, so
auto-detection sends no request of its own. A server that names itself otherwise
(llama-cpp-python answers ``me``, and interrupts its running generation on *any* new
request) is never polled unless configured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LOAD_SOURCES",
    "MetricsError",
    "ServerLoad",
    "detect_source",
    "parse_prometheus",
    "read_load",
]

# the values of an endpoint's `load_source`: where its load is read (none: not polled)
LOAD_SOURCES = ("vllm", "sglang", "llamacpp", "none")

_OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}

# labels that tell one engine (summed) from another; tp/pp ranks repeat the same engine
_REPLICA_LABELS = frozenset({"tp_rank", "pp_rank"})


class MetricsError(ValueError):
    """The text is not the Prometheus exposition format, or carries none of the metrics of
    its source (a wrong ``load_source``, or a server started without its metrics)."""


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One reading of a server's load. ``None`` = the server does not publish it.

    ``at``: when it was read (the gateway's monotonic clock); ``inflight_at``: the
    gateway's own in-flight count to this endpoint at that moment, so the balancer can
    tell the server's load from other clients from its own (see ``merged_load``).
    ``hit_counters``: vLLM's (queries, hits) token counters, kept for the next reading's
    rate.
    """

    source: str
    running: float
    waiting: float
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None
    at: float = 0.0
    inflight_at: int = 0
    hit_counters: tuple[float, float] | None = None
    kv_capacity_tokens: int | None = None  # the KV cache's size, where the server says

    @property
    def queued(self) -> float:
        """Requests on the server: running + waiting."""
        return self.running + self.waiting

    def merged_load(self, inflight_now: int) -> float:
        """Requests on the server now, as best known: what it reported (which counted our
        requests in flight then) less our share then, plus our in-flight count now."""
        others = max(0.0, self.queued - self.inflight_at)
        return others + inflight_now

    def is_fresh(self, now: float, stale_after_s: float) -> bool:
        return now - self.at <= stale_after_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "prefix_hit_rate": self.prefix_hit_rate,
            "at": self.at,
        }


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """``a="x",b="y"`` -> (("a", "x"), ("b", "y")); quoted values may hold , } and \\"."""
    out = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in " ,":
            i += 1
        if i >= n:
            break
        eq = text.find("=", i)
        if eq < 0:
            raise MetricsError(f"bad label set {{{text}}}")
        name = text[i:eq].strip()
        j = eq + 1
        while j < n and text[j] == " ":
            j += 1
        if j >= n or text[j] != '"':
            raise MetricsError(f"label {name!r} has no quoted value")
        j += 1
        start = j
        while j < n and text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        if j >= n:
            raise MetricsError(f"label {name!r}: unterminated value")
        out.append((name, _unescape(text[start:j])))
        i = j + 1
    return tuple(out)


def _float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        low = raw.lower()
        if low in ("+inf", "inf"):
            return math.inf
        if low == "-inf":
            return -math.inf
        if low == "nan":
            return math.nan
        raise MetricsError(f"not a sample value: {raw!r}") from None


def parse_prometheus(
    text: str, prefixes: tuple[str, ...] | None = None
) -> dict[str, list[tuple[tuple[tuple[str, str], ...], float]]]:
    """The samples of a Prometheus text exposition (format 0.0.4, which these servers
    write): ``{name: [(labels, value), ...]}``. Comments, ``# HELP`` and ``# TYPE`` lines
    and timestamps are skipped. ``prefixes``: keep only names starting with one of them
    (the rest of the text, histograms mostly, is not even split)."""
    out: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] == "#":
            continue
        if prefixes is not None and not line.startswith(prefixes):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            close = line.rfind("}")
            if close < brace:
                raise MetricsError(f"unterminated label set: {line[:80]!r}")
            name = line[:brace]
            labels = _labels(line[brace + 1 : close])
            rest = line[close + 1 :].split()
        else:
            parts = line.split()
            name, labels, rest = parts[0], (), parts[1:]
        if not rest:
            raise MetricsError(f"sample without a value: {line[:80]!r}")
        out.setdefault(name, []).append((labels, _float(rest[0])))
    return out


def _per_engine(samples: Iterable[tuple[tuple[tuple[str, str], ...], float]]) -> list[float]:
    """One value per engine: series differing only in tp/pp rank are one engine (max)."""
    engines: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, value in samples:
        if math.isnan(value):
            continue
        key = tuple(kv for kv in labels if kv[0] not in _REPLICA_LABELS)
        engines[key] = max(value, engines.get(key, value))
    return list(engines.values())


def _sum(samples, name: str) -> float | None:
    values = _per_engine(samples.get(name, ()))
    return sum(values) if values else None


def _mean(samples, name: str) -> float | None:
    values = _per_engine(samples.get(name, ()))
    return sum(values) / len(values) if values else None


def _first(samples, names: tuple[str, ...], reduce) -> float | None:
    for name in names:
        value = reduce(samples, name)
        if value is not None:
            return value
    return None


def read_load(
    source: str,
    text: str,
    now: float,
    *,
    inflight: int = 0,
    previous: ServerLoad | None = None,
) -> ServerLoad:
    """Read one ``/metrics`` answer of a server of ``source`` (``vllm``, ``sglang``,
    ``llamacpp``). ``previous``: the last reading, for vLLM's hit-rate counters.
    Raises ``MetricsError`` when the text has no running/waiting count of that source."""
    if source == "vllm":
        s = parse_prometheus(text, ("vllm:",))
        running = _sum(s, "vllm:num_requests_running")
        waiting = _sum(s, "vllm:num_requests_waiting")
        kv = _first(s, ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), _mean)
        queries = _first(s, ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"), _sum)
        hits = _first(s, ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"), _sum)
        counters = None if queries is None or hits is None else (queries, hits)
        capacity = _vllm_capacity(s)
        rate = None
        if counters is not None and previous is not None and previous.hit_counters is not None:
            dq = counters[0] - previous.hit_counters[0]
            dh = counters[1] - previous.hit_counters[1]
            if dq > 0 and dh >= 0:  # counters reset when the server restarts: no rate then
                rate = min(1.0, dh / dq)
            elif dq == 0 and dh == 0:
                rate = previous.prefix_hit_rate  # nothing queried since: the last rate holds
    elif source == "sglang":
        s = parse_prometheus(text, ("sglang:",))
        running = _sum(s, "sglang:num_running_reqs")
        waiting = _sum(s, "sglang:num_queue_reqs")
        kv = _mean(s, "sglang:token_usage")
        rate = _mean(s, "sglang:cache_hit_rate")
        counters = None
        total = _sum(s, "sglang:max_total_num_tokens")
        capacity = int(total) if total else None
    elif source == "llamacpp":
        s = parse_prometheus(text, ("llamacpp:",))
        running = _sum(s, "llamacpp:requests_processing")
        waiting = _sum(s, "llamacpp:requests_deferred")
        kv = _mean(s, "llamacpp:kv_cache_usage_ratio")
        rate = None
        counters = None
        capacity = None
    else:
        raise ValueError(f"unknown load source {source!r} (one of {', '.join(LOAD_SOURCES[:-1])})")
    if running is None and waiting is None:
        raise MetricsError(f"no {source} load metrics in the answer (is this a {source} server with metrics on?)")
    if kv is not None:
        kv = min(1.0, max(0.0, kv))
    return ServerLoad(
        source,
        max(0.0, running or 0.0),
        max(0.0, waiting or 0.0),
        kv,
        rate,
        now,
        inflight,
        counters,
        capacity,
    )


def _vllm_capacity(samples) -> int | None:
    """Tokens of KV cache, from ``vllm:cache_config_info``'s ``num_gpu_blocks`` ×
    ``block_size`` labels (summed over engines)."""
    total = 0
    for labels, _ in samples.get("vllm:cache_config_info", ()):
        d = dict(labels)
        try:
            total += int(d["num_gpu_blocks"]) * int(d["block_size"])
        except (KeyError, ValueError):
            continue
    return total or None


def detect_source(models: Mapping[str, Any] | Any) -> str | None:
    """The load source a ``GET /v1/models`` answer names by its ``owned_by`` (``vllm``,
    ``sglang``, ``llamacpp``), or ``None`` when it names none of them (llama-cpp-python's
    ``me``, hosted APIs' ``openai``/``system``, an edgegw): such servers are not polled."""
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        return None
    found = {
        _OWNERS.get(m.get("owned_by")) for m in data if isinstance(m, Mapping) and isinstance(m.get("owned_by"), str)
    }
    found.discard(None)
    return found.pop() if len(found) == 1 else None
