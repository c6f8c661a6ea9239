from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

import cache
from cache import (
    CacheConfig,
    MemoryCache,
    RedisCache,
    SingleFlight,
    TieredCache,
    build,
    build_singleflight,
)


def test_defaults_are_the_embedded_memory_cache() -> None:
    config = CacheConfig()
    assert config.backend == "memory" and not config.uses_redis
    assert config.ttl_for("chat") == config.default_ttl == 300.0
    assert config.max_entry_bytes <= config.memory_max_bytes


def test_every_field_has_a_default_and_a_comment() -> None:
    source = Path(cache.config.__file__).read_text()
    for name, field in CacheConfig.model_fields.items():
        assert not field.is_required(), name
        line = next(i for i, l in enumerate(source.splitlines()) if l.strip().startswith(f"{name}:"))
        assert source.splitlines()[line - 1].strip().startswith("#"), name


def test_route_ttls() -> None:
    config = CacheConfig(default_ttl=60, route_ttl={"completions": 10, "chat": 0})
    assert config.ttl_for("completions") == 10 and config.ttl_for("chat") == 0
    with pytest.warns(FutureWarning, match="route_ttl.completion is deprecated"):
        old = CacheConfig(default_ttl=60, route_ttl={"completion": 10})  # the key's first name
    assert old.route_ttl == {"completions": 10} and old.ttl_for("completions") == 10
    with pytest.raises(pydantic.ValidationError):
        CacheConfig(route_ttl={"images": 10})
    with pytest.raises(pydantic.ValidationError):
        CacheConfig(route_ttl={"chat": -1})


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"backend": "memcached"}, id="backend"),
        pytest.param({"colour": "blue"}, id="extra"),
        pytest.param({"memory_max_bytes": 10, "max_entry_bytes": 20}, id="entry>memory"),
        pytest.param({"redis_timeout": 0}, id="timeout"),
    ],
)
def test_invalid_config_names_the_key(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        CacheConfig(**bad)
    assert any(k in str(info.value) for k in (*bad, "max_entry_bytes"))


@pytest.mark.parametrize(
    ("value", "backend", "url"),
    [
        pytest.param("memory", "memory", "redis://127.0.0.1:6379/0", id="memory"),
        pytest.param("off", "off", "redis://127.0.0.1:6379/0", id="off"),
        pytest.param("redis://10.0.0.5:6380/2", "redis", "redis://10.0.0.5:6380/2", id="redis"),
        pytest.param("tiered+redis://h:1/0", "tiered", "redis://h:1/0", id="tiered"),
    ],
)
def test_from_cli(value: str, backend: str, url: str) -> None:
    config = CacheConfig.from_cli(value)
    assert (config.backend, config.redis_url) == (backend, url)


def test_from_cli_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="--cache"):
        CacheConfig.from_cli("memcached://h:1")


async def test_build() -> None:
    assert build(CacheConfig(backend="off")) is None
    assert build_singleflight(CacheConfig(backend="off")) is None
    assert build_singleflight(CacheConfig(singleflight=False)) is None
    mem = build(CacheConfig(memory_max_bytes=1000, max_entry_bytes=100))
    assert isinstance(mem, MemoryCache) and mem.max_bytes == 1000 and mem.max_entry_bytes == 100
    red = build(CacheConfig.from_cli("redis://127.0.0.1:6379/15", namespace="ns1"))
    assert isinstance(red, RedisCache) and red.namespace == "ns1"
    tiered = build(CacheConfig.from_cli("tiered+redis://127.0.0.1:6379/15"))
    assert isinstance(tiered, TieredCache)
    assert isinstance(tiered.front, MemoryCache) and isinstance(tiered.back, RedisCache)
    sf = build_singleflight(CacheConfig.from_cli("redis://127.0.0.1:6379/15"))
    assert isinstance(sf, SingleFlight) and sf.redis_url == "redis://127.0.0.1:6379/15"
    local = build_singleflight(CacheConfig())
    assert isinstance(local, SingleFlight) and local.redis_url is None
    for closable in (mem, red, tiered, sf, local):
        await closable.close()


def test_exports() -> None:
    for name in cache.__all__:
        assert hasattr(cache, name), name
    assert sorted(cache.__all__) == cache.__all__


def test_cache_imports_no_other_edgegw_package() -> None:
    import pathlib
    import re

    for path in pathlib.Path(cache.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+(gateway|routing|edge_engine)\b", text, re.M), path


async def test_metrics_export_through_a_caller_registry() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from cache.base import Entry
    from cache.metrics import CacheMetrics

    registry = CollectorRegistry()
    metrics = CacheMetrics(registry=registry)
    CacheMetrics()  # unregistered ones never collide with it
    CacheMetrics()
    mem = MemoryCache(1000, 100, metrics=metrics)
    await mem.set("k", Entry(kind="chat", body=b"{}"), ttl=10)
    await mem.get("k")
    await mem.get("nope")
    metrics.bypass("nondeterministic")
    text = generate_latest(registry).decode()
    assert 'edgegw_cache_hits_total{tier="memory"} 1.0' in text
    assert 'edgegw_cache_misses_total{tier="memory"} 1.0' in text
    assert 'edgegw_cache_bypasses_total{reason="nondeterministic"} 1.0' in text
    assert "edgegw_cache_lookup_seconds_count" in text
    assert "edgegw_cache_memory_bytes 3.0" in text
    assert repr(metrics).startswith("<CacheMetrics ")
    with pytest.raises(ValueError):
        CacheMetrics(registry=registry)  # the same registry twice is a caller bug
