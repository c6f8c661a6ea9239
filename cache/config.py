"""`CacheConfig`: the cache section of the gateway config (built by gateway/core/settings.py)."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MiB = 1024 * 1024


class CacheConfig(BaseModel):
    """Exact-response cache and single-flight settings; every field has a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # where entries live: in-process LRU, shared Redis, memory in front of Redis, or no cache
    backend: Literal["memory", "redis", "tiered", "off"] = "memory"
    # upper bound on the in-memory tier, in bytes of stored payload (plus keys)
    memory_max_bytes: int = Field(default=256 * MiB, gt=0)
    # responses larger than this are never stored (in any tier)
    max_entry_bytes: int = Field(default=4 * MiB, gt=0)
    # seconds an entry lives when its route has no TTL of its own
    default_ttl: float = Field(default=300.0, ge=0)
    # per-route TTL in seconds ("chat", "completions", "embeddings"; "completion", the first
    # name of completions, still works with a warning); 0 disables caching for that route
    route_ttl: dict[Literal["chat", "completions", "embeddings"], float] = Field(default_factory=dict)
    # whether a request without `temperature` is greedy on the models behind this gateway
    # (OpenAI, vLLM and the edge engine default to temperature 1: not greedy)
    default_greedy: bool = False
    # Redis URL for the "redis"/"tiered" backends and cross-replica single-flight
    redis_url: str = "redis://127.0.0.1:6379/0"
    # per-command Redis timeout in seconds (raise it for a cross-region Redis); a slower
    # answer counts as an error and a miss
    redis_timeout: float = Field(default=0.1, gt=0)
    # Redis connect timeout in seconds
    redis_connect_timeout: float = Field(default=0.2, gt=0)
    # seconds Redis is skipped after an error (circuit open) before it is tried again
    redis_cooldown: float = Field(default=5.0, ge=0)
    # coalesce identical cacheable requests in flight (in-process; across replicas with Redis)
    singleflight: bool = True
    # seconds a single-flight leader's Redis lock lives without a heartbeat (leader death bound)
    lock_ttl: float = Field(default=10.0, gt=0)
    # seconds a leader's Redis chunk stream is kept after its last write
    stream_ttl: float = Field(default=60.0, gt=0)
    # key prefix in Redis, so several deployments can share one Redis
    namespace: str = Field(default="edgegw", min_length=1)
    # request headers that change the answer (the gateway forwards headers upstream): their
    # values become part of the key, like HTTP's Vary; names are case-insensitive
    vary_headers: tuple[str, ...] = ()

    @field_validator("route_ttl", mode="before")
    @classmethod
    def _old_route_name(cls, value):
        """``route_ttl.completion`` (the key's first name) still works, with a warning: the
        API is "completions" everywhere."""
        if isinstance(value, dict) and "completion" in value:
            warnings.warn("cache.route_ttl.completion is deprecated: use completions", FutureWarning, stacklevel=2)
            value = dict(value)
            old = value.pop("completion")
            value.setdefault("completions", old)
        return value

    @field_validator("vary_headers")
    @classmethod
    def _lower(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted({name.strip().lower() for name in value if name.strip()}))

    @model_validator(mode="after")
    def _check_bounds(self) -> CacheConfig:
        if self.max_entry_bytes > self.memory_max_bytes:
            raise ValueError("max_entry_bytes must not exceed memory_max_bytes")
        for route, ttl in self.route_ttl.items():
            if ttl < 0:
                raise ValueError(f"route_ttl.{route} must be >= 0")
        return self

    def ttl_for(self, kind: str) -> float:
        """The TTL in seconds for a route kind ("chat" or "completions")."""
        return self.route_ttl.get(kind, self.default_ttl)  # type: ignore[call-overload]

    @property
    def uses_redis(self) -> bool:
        return self.backend in ("redis", "tiered")

    @classmethod
    def from_cli(cls, value: str, **overrides: object) -> CacheConfig:
        """Parse `edgegw serve --cache VALUE`.

        `memory`, `off`, `redis://HOST:PORT/DB` (also `rediss://`, `unix://`), or
        `tiered+redis://HOST:PORT/DB` for memory in front of Redis.
        """
        value = value.strip()
        if value in ("memory", "off"):
            return cls(backend=value, **overrides)  # type: ignore[arg-type]
        backend = "redis"
        url = value
        if value.startswith("tiered+"):
            backend, url = "tiered", value[len("tiered+"):]
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--cache: expected 'memory', 'off', 'redis://HOST:PORT/DB' or "
                f"'tiered+redis://HOST:PORT/DB', got {value!r}"
            )
        return cls(backend=backend, redis_url=url, **overrides)  # type: ignore[arg-type]
