"""edgegw's exact-response cache: keys, policy, backends (memory, Redis, tiered),
replay in the shape asked for, and single-flight coalescing of identical requests."""

from __future__ import annotations

from cache.base import CacheBackend, Entry
from cache.config import CacheConfig
from cache.errors import CacheError, FlightAborted
from cache.keys import make_key
from cache.memory import MemoryCache
from cache.metrics import CacheMetrics
from cache.policy import Directives, Plan, is_complete_body, is_complete_stream, parse_cache_control, plan, recording_fields, usage_fields
from cache.redis import RedisCache
from cache.replay import as_chunks, as_json, is_usage_chunk
from cache.singleflight import Flight, SingleFlight
from cache.tiered import TieredCache

__all__ = [
    "CacheBackend",
    "CacheConfig",
    "CacheError",
    "CacheMetrics",
    "Directives",
    "Entry",
    "Flight",
    "FlightAborted",
    "MemoryCache",
    "Plan",
    "RedisCache",
    "SingleFlight",
    "TieredCache",
    "as_chunks",
    "as_json",
    "build",
    "build_singleflight",
    "is_complete_body",
    "is_complete_stream",
    "is_usage_chunk",
    "make_key",
    "parse_cache_control",
    "plan",
    "recording_fields",
    "usage_fields",
]


def _memory(config: CacheConfig, metrics: CacheMetrics) -> MemoryCache:
    return MemoryCache(config.memory_max_bytes, config.max_entry_bytes, metrics=metrics)


def _redis(config: CacheConfig, metrics: CacheMetrics) -> RedisCache:
    return RedisCache(
        config.redis_url,
        timeout=config.redis_timeout,
        connect_timeout=config.redis_connect_timeout,
        cooldown=config.redis_cooldown,
        namespace=config.namespace,
        max_entry_bytes=config.max_entry_bytes,
        metrics=metrics,
    )


def build(config: CacheConfig, metrics: CacheMetrics | None = None) -> CacheBackend | None:
    """The backend `config` asks for, or None when the cache is off. Redis is connected
    lazily, so building never blocks or fails on an unreachable Redis."""
    metrics = metrics if metrics is not None else CacheMetrics()
    if config.backend == "off":
        return None
    if config.backend == "memory":
        return _memory(config, metrics)
    if config.backend == "redis":
        return _redis(config, metrics)
    return TieredCache(_memory(config, metrics), _redis(config, metrics))


def build_singleflight(
    config: CacheConfig, metrics: CacheMetrics | None = None
) -> SingleFlight | None:
    """Request coalescing as configured (across replicas when the backend uses Redis), or
    None when single-flight or the cache is off."""
    if not config.singleflight or config.backend == "off":
        return None
    return SingleFlight(
        config.redis_url if config.uses_redis else None,
        namespace=config.namespace,
        lock_ttl=config.lock_ttl,
        stream_ttl=config.stream_ttl,
        timeout=config.redis_timeout,
        connect_timeout=config.redis_connect_timeout,
        cooldown=config.redis_cooldown,
        metrics=metrics,
    )
