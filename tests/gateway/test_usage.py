"""Usage per tenant (issue 23): Prometheus counters, the access log, ``GET /admin/usage`` from
memory or Redis (replicas add up), monthly token quotas; real sockets on 127.0.0.1, the real
Redis, worker processes for the node's sums."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.settings import UsageSettings
from gateway.observe.usage import Usage

from tests.conftest import cluster
from tests.gateway.live import FileGateway, wait_for
from tests.gateway.test_workers import worker_pids

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ACME = {"authorization": "Bearer k-acme"}
ADMIN = {"authorization": "Bearer adm"}
REDIS_URL = "redis://127.0.0.1:6379/0"


def config(fake, **extra) -> dict:
    return {
        "reload": {"watch": False},
        "admin": {"keys": ["adm"]},
        "auth": {"mode": "required"},
        "tenants": [{"name": "acme", "keys": ["k-acme"]}, {"name": "globex", "keys": ["k-globex"]}],
        "clusters": [cluster(fake)],
        **extra,
    }


@pytest.fixture
def file_gateways(tmp_path):
    started = []

    def start(config: dict, **kwargs) -> FileGateway:
        folder = tmp_path / f"gw{len(started)}"
        folder.mkdir()
        gw = FileGateway(config, folder, **kwargs).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture
def namespace():
    """A Redis key prefix of the test's own, deleted afterwards."""
    name = f"edgegw-test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def counters(url: str, name: str, headers=ADMIN) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def tokens(url: str, tenant: str, kind: str) -> float:
    return sum(v for labels, v in counters(url, "edgegw_usage_tokens_total").items() if ("tenant", tenant) in labels and ("type", kind) in labels)


def post(gw, body, headers=ACME) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def test_tokens_and_requests_are_counted_per_tenant_model_and_target(upstreams, file_gateways, caplog):
    fake = upstreams()
    gw = file_gateways(config(fake, cache={"backend": "memory"}, listen={"access_log": True}))
    with caplog.at_level(logging.INFO, logger="edgegw.access"):
        assert post(gw, {**CHAT, "fake": {"tokens": 8}}).status_code == 200
        stream = post(gw, {**CHAT, "stream": True, "fake": {"tokens": 6}})
        assert stream.status_code == 200 and '"usage"' not in stream.text  # asked for on the tenant's behalf, not shown
        assert fake.requests[-1].body["stream_options"] == {"include_usage": True}
        assert post(gw, {**CHAT, "temperature": 0}).headers["x-cache"] == "MISS"
        assert post(gw, {**CHAT, "temperature": 0}).headers["x-cache"] == "HIT"  # the fake's 5 + 8, saved
        assert post(gw, CHAT, {"authorization": "Bearer k-globex"}).status_code == 200
        wait_for(lambda: len([r for r in caplog.records if r.name == "edgegw.access"]) == 5, 5, "the access log")
    requests = counters(gw.url, "edgegw_usage_requests_total")
    assert requests[(("model", "fake-model"), ("target", fake.url), ("tenant", "acme"))] == 3
    assert requests[(("model", "fake-model"), ("target", "cache"), ("tenant", "acme"))] == 1
    assert tokens(gw.url, "acme", "prompt") == 15 and tokens(gw.url, "acme", "completion") == 22
    assert tokens(gw.url, "acme", "cached") == 13  # counted as cached, not as prompt or completion
    assert tokens(gw.url, "globex", "prompt") == 5 and tokens(gw.url, "globex", "completion") == 8
    lines = [r.getMessage() for r in caplog.records if r.name == "edgegw.access"]
    assert "tokens=prompt:5,completion:8" in lines[0] and "tokens=prompt:5,completion:6" in lines[1]
    assert "tokens=cached:13" in lines[3]


def test_admin_usage_answers_per_tenant_and_model_for_a_time_range(upstreams, file_gateways):
    fake = upstreams()
    gw = file_gateways(config(fake))
    for _ in range(3):
        assert post(gw, CHAT).status_code == 200
    assert post(gw, CHAT, {"authorization": "Bearer k-globex"}).status_code == 200
    answer = httpx.get(gw.url + "/admin/usage", headers=ADMIN, timeout=5).json()
    assert answer["source"] == "memory" and answer["bucket"] == "1h"
    rows = {(r["tenant"], r["model"]): r for r in answer["data"]}
    assert rows[("acme", "fake-model")] == {
        "tenant": "acme", "model": "fake-model", "requests": 3, "prompt_tokens": 15, "completion_tokens": 24,
        "cached_tokens": 0, "total_tokens": 39,
    }
    assert rows[("globex", "fake-model")]["requests"] == 1
    only = httpx.get(gw.url + "/admin/usage", params={"tenant": "globex"}, headers=ADMIN, timeout=5).json()["data"]
    assert [r["tenant"] for r in only] == ["globex"]
    later = httpx.get(gw.url + "/admin/usage", params={"from": "2999-01-01T00:00:00Z"}, headers=ADMIN, timeout=5)
    assert later.status_code == 400 and later.json()["error"]["param"] == "to"  # to (now) is before from
    past = httpx.get(gw.url + "/admin/usage", params={"from": "2020-01-01", "to": "2020-01-02"}, headers=ADMIN, timeout=5).json()
    assert past["data"] == [] and past["from"] == "2020-01-01T00:00:00Z"
    bad = httpx.get(gw.url + "/admin/usage", params={"from": "yesterday"}, headers=ADMIN, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "from"


def test_replicas_add_up_in_redis(upstreams, file_gateways, namespace):
    fake = upstreams()
    usage = {"redis_url": REDIS_URL, "namespace": namespace, "flush_interval_s": 0.1}
    one = file_gateways(config(fake, usage=usage))
    two = file_gateways(config(fake, usage=usage))
    for gw, count in ((one, 2), (two, 3)):
        for _ in range(count):
            assert post(gw, CHAT).status_code == 200

    def fleet_requests() -> int:
        data = httpx.get(one.url + "/admin/usage", headers=ADMIN, timeout=5).json()["data"]
        return sum(r["requests"] for r in data if r["tenant"] == "acme")

    wait_for(lambda: fleet_requests() == 5, 10, "both replicas' counts in Redis")
    answer = httpx.get(two.url + "/admin/usage", headers=ADMIN, timeout=5).json()
    assert answer["source"] == "redis" and answer["data"][0]["prompt_tokens"] == 25


def test_a_monthly_quota_refuses_with_insufficient_quota_shared_across_replicas(upstreams, file_gateways, namespace):
    fake = upstreams()
    usage = {"redis_url": REDIS_URL, "namespace": namespace, "flush_interval_s": 0.1}
    quota = {"name": "acme", "keys": ["k-acme"], "quota": {"monthly_tokens": 20}}
    one = file_gateways(config(fake, usage=usage, tenants=[quota]))
    two = file_gateways(config(fake, usage=usage, tenants=[quota]))
    assert post(one, CHAT).status_code == 200  # 13 tokens of 20
    assert post(one, CHAT).status_code == 200  # 26: this one crossed the line, and was answered
    refused = post(one, CHAT)
    assert refused.status_code == 429 and refused.headers["x-should-retry"] == "false"
    error = refused.json()["error"]
    assert error["type"] == "insufficient_quota" and error["code"] == "insufficient_quota" and "26 of 20" in error["message"]
    wait_for(lambda: post(two, CHAT).status_code == 429, 10, "the other replica to see the month's tokens")
    assert len(fake.requests) <= 4  # the other replica, before it read the total, counts its own: two more at most


def test_a_memory_quota_and_its_reload(upstreams, file_gateways):
    fake = upstreams()
    quota = {"name": "acme", "keys": ["k-acme"], "quota": {"monthly_tokens": 10}}
    gw = file_gateways(config(fake, tenants=[quota]))
    assert post(gw, CHAT).status_code == 200
    assert post(gw, CHAT).status_code == 429
    gw.write(config(fake, tenants=[{**quota, "quota": {"monthly_tokens": 1000}}]))
    assert httpx.post(gw.url + "/admin/reload", headers=ADMIN, timeout=30).status_code == 200
    assert post(gw, CHAT).status_code == 200  # the month's count stays; the new quota applies


def test_a_node_of_workers_sums_its_usage(upstreams, gateway_processes):
    fake = upstreams()
    gw = gateway_processes({**config(fake), "listen": {"workers": 2}})
    worker_pids(gw, 2)
    for _ in range(8):
        with httpx.Client(timeout=10) as client:  # new connections: both workers
            assert client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=ACME).status_code == 200
    requests = counters(gw.url, "edgegw_usage_requests_total")
    assert sum(requests.values()) == 8
    rows = httpx.get(gw.url + "/admin/usage", headers=ADMIN, timeout=10).json()["data"]
    assert [(r["tenant"], r["requests"], r["prompt_tokens"]) for r in rows] == [("acme", 8, 40)]


async def test_counts_wait_for_redis_and_are_not_lost(namespace):
    """Redis unreachable: the counts stay for the next flush (here, once a reachable Redis is
    configured, as a reload would); nothing is counted twice."""
    down = UsageSettings(redis_url="redis://127.0.0.1:1/0", namespace=namespace, timeout_s=0.2)
    usage = Usage(down, CollectorRegistry())
    usage.record("acme", "m", "http://e/v1", 5, 7)
    usage.record("acme", "m", "cache", 5, 7)
    assert await usage.flush() is False  # refused connection: kept
    usage.configure(UsageSettings(redis_url=REDIS_URL, namespace=namespace))
    assert await usage.flush() is True
    now = time.time()
    rows = await usage.query(now - 3600, now, "acme")
    assert rows == [{"tenant": "acme", "model": "m", "requests": 2, "prompt_tokens": 5, "completion_tokens": 7, "cached_tokens": 12, "total_tokens": 12}]
    assert await usage.month_tokens("acme") == 12  # cache hits are free
    await usage.aclose()


class _HeldPipeline:
    """The real Redis pipeline of a flush, held after its increments have landed in Redis
    and before the flush learns so: the window in which a month read used to miss the
    flushed tokens (the pending counts already taken) or count them twice (read from Redis,
    then added again by the finishing flush)."""

    def __init__(self, pipeline, landed, release) -> None:
        self._pipeline, self._landed, self._release = pipeline, landed, release

    async def __aenter__(self):
        await self._pipeline.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._pipeline.__aexit__(*exc)

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    async def execute(self):
        result = await self._pipeline.execute()
        self._landed.set()
        await self._release.wait()
        return result


def _hold_flushes(usage: Usage) -> tuple:
    landed, release = asyncio.Event(), asyncio.Event()
    real = usage._redis.pipeline
    usage._redis.pipeline = lambda **kw: _HeldPipeline(real(**kw), landed, release)
    return landed, release


@pytest.mark.parametrize("read_first", [pytest.param(True, id="a-fresh-read"), pytest.param(False, id="no-read-yet")])
async def test_a_month_read_during_a_flush_counts_the_flushed_tokens_once(namespace, read_first):
    usage = Usage(UsageSettings(redis_url=REDIS_URL, namespace=namespace, flush_interval_s=60), CollectorRegistry())
    if read_first:
        assert await usage.month_tokens("acme") == 0
    usage.record("acme", "m", "http://e/v1", 5, 8)
    landed, release = _hold_flushes(usage)
    flushing = asyncio.create_task(usage.flush())
    await landed.wait()  # in Redis, not yet confirmed to the flush
    reading = asyncio.create_task(usage.month_tokens("acme"))
    # a read of Redis now would see the landed increments: it waits for the flush instead
    # (the bound gives the read, before the fix, time to finish first and show the double count)
    await asyncio.wait({reading}, timeout=0.5)
    if reading.done():  # answered from the last read, with the tokens in flight
        assert reading.result() == 13
    release.set()
    assert await flushing is True
    assert await reading == 13
    assert await usage.month_tokens("acme") == 13  # and not twice once the flush is done
    await usage.aclose()
