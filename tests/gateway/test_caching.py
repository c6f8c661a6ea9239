"""The exact-response cache end to end: a real gateway, a scripted fake upstream, real
sockets, the real Redis (DB 15, a namespace per test) and a private redis-server that a
test kills.

Every test counts what the upstream saw (``fake.requests``), so a hit that secretly went
upstream, or a miss that was answered from the cache, fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import types
import uuid

import httpx
import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry
from websockets.sync.client import connect as ws_connect

from cache import CacheConfig
from gateway.pipeline.caching import CacheLayer, Recorder
from gateway.core.openai import parse_request
from gateway.core.context import Charge
from gateway.node.cli import main as edgegw_main
from gateway.relay.meter import _take_usage
from tests.conftest import GatewayProcess, cluster, ws_answer


CHAT_PATH = "/v1/chat/completions"
REDIS_URL = "redis://127.0.0.1:6379/15"


def chat(content: str = "hello", **fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


def unique() -> str:
    return uuid.uuid4().hex[:12]


def post(gw, body: dict, headers: dict | None = None, timeout: float = 10) -> httpx.Response:
    return httpx.post(gw.url + CHAT_PATH, json=body, headers=headers or {}, timeout=timeout)


def completions(fake) -> int:
    return sum(1 for r in fake.requests if r.path.endswith("/completions"))


def sse_payloads(content: bytes) -> list[bytes]:
    return [line[6:] for line in content.split(b"\n\n") if line.startswith(b"data: ")]


def same_answer(hit: httpx.Response, original: bytes) -> bool:
    """A hit carries the stored answer with an id and created of its own (the stored id in
    ``x-edgegw-cache-original-id``): equal but for those."""

    def strip(content: bytes) -> list:
        payloads = sse_payloads(content) if content.startswith(b"data:") else [content]
        docs = []
        for payload in payloads:
            doc = payload if payload == b"[DONE]" else orjson.loads(payload)
            if isinstance(doc, dict):
                doc.pop("id", None), doc.pop("created", None)
            docs.append(doc)
        return docs

    ids = re.findall(rb'"id":"([^"]*)"', hit.content)
    stored = re.findall(rb'"id":"([^"]*)"', original)
    if stored:
        assert hit.headers["x-edgegw-cache-original-id"].encode() == stored[0]
        assert ids and all(i == ids[0] != stored[0] for i in ids), (ids, stored)
        assert ids[0].endswith(hit.headers["x-request-id"].encode())
    return strip(hit.content) == strip(original)


def text_of(response: httpx.Response) -> str:
    """The answer's text, from a JSON body or an SSE stream."""
    if response.headers["content-type"].startswith("application/json"):
        return response.json()["choices"][0]["message"]["content"]
    parts = []
    for payload in sse_payloads(response.content):
        if payload != b"[DONE]":
            for choice in orjson.loads(payload)["choices"]:
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


def metric(gw, name: str) -> float:
    """The sum of a Prometheus series family over all its labels."""
    text = httpx.get(gw.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def memory_gw(upstreams, gateways):
    def start(**cache):
        fake = upstreams()
        gw = gateways({"clusters": [cluster(fake)], "cache": {"backend": "memory", **cache}})
        return fake, gw

    return start


@pytest.fixture
def namespace():
    ns = "test-" + unique()
    yield ns
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=ns + ":*"))
    if keys:
        client.delete(*keys)
    client.close()


# -- keys --------------------------------------------------------------------------------


def test_tenants_never_share_an_entry_and_keys_of_one_tenant_do(upstreams, gateways):
    fake = upstreams()
    tenants = [{"name": "alice", "keys": ["sk-alice", "sk-alice-2"]}, {"name": "bob", "keys": ["sk-bob"]}]
    gw = gateways({"clusters": [cluster(fake)], "cache": {"backend": "memory"}, "auth": {"mode": "optional"}, "tenants": tenants})
    body = chat(unique())
    alice, alice2, bob = ({"authorization": f"Bearer {k}"} for k in ("sk-alice", "sk-alice-2", "sk-bob"))
    assert post(gw, body, alice).headers["x-cache"] == "MISS"
    assert post(gw, body, alice2).headers["x-cache"] == "HIT"  # another key of the same tenant
    assert post(gw, body, bob).headers["x-cache"] == "MISS"
    assert post(gw, body, bob).headers["x-cache"] == "HIT"
    assert post(gw, body).headers["x-cache"] == "MISS"  # anonymous is a tenant of its own
    assert completions(fake) == 3


def test_field_order_and_irrelevant_fields_do_not_split_entries(memory_gw):
    fake, gw = memory_gw()
    content = unique()
    first = post(gw, chat(content, max_tokens=50))
    assert first.headers["x-cache"] == "MISS"
    reordered = {"max_tokens": 50, "temperature": 0.0, "messages": [{"content": content, "role": "user"}], "model": "fake-model"}
    for body in (reordered, {**reordered, "user": "someone"}, {**reordered, "stream": False}):
        response = post(gw, body)
        assert response.headers["x-cache"] == "HIT", body
        assert same_answer(response, first.content)
    # a field that changes the answer does split
    assert post(gw, chat(content, max_tokens=51)).headers["x-cache"] == "MISS"
    assert completions(fake) == 2


@pytest.mark.parametrize("first_stream", [pytest.param(False, id="json-then-sse"), pytest.param(True, id="sse-then-json")])
def test_streamed_and_json_asks_share_one_entry(memory_gw, first_stream):
    fake, gw = memory_gw()
    body = chat(unique())
    first = post(gw, {**body, "stream": first_stream})
    second = post(gw, {**body, "stream": not first_stream})
    assert first.headers["x-cache"] == "MISS"
    assert second.headers["x-cache"] == "HIT"
    assert completions(fake) == 1
    assert text_of(first) == text_of(second) == "".join(f"tok{i} " for i in range(8))
    streamed = second if not first_stream else first
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.content.endswith(b"data: [DONE]\n\n")
    as_json = first if not first_stream else second
    assert as_json.json()["choices"][0]["finish_reason"] == "stop"


# -- policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"n": 2}, id="n2"),
        pytest.param({"temperature": 0.7}, id="sampling-without-seed"),
        pytest.param({"temperature": 1, "top_p": 0.9}, id="top-p-without-seed"),
    ],
)
def test_nondeterministic_requests_bypass(memory_gw, fields):
    fake, gw = memory_gw()
    body = chat(unique(), **fields)
    for _ in range(2):
        response = post(gw, body)
        assert response.status_code == 200
        assert response.headers["x-cache"] == "BYPASS"
        assert "age" not in response.headers
    assert completions(fake) == 2


def test_sampling_with_a_seed_is_cached(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), temperature=0.9, seed=42)
    assert post(gw, body).headers["x-cache"] == "MISS"
    assert post(gw, body).headers["x-cache"] == "HIT"
    assert post(gw, {**body, "seed": 43}).headers["x-cache"] == "MISS"
    body = chat(unique())
    del body["temperature"]  # absent: temperature 1 on OpenAI, so not deterministic by default
    assert post(gw, body).headers["x-cache"] == "BYPASS"
    assert completions(fake) == 3


def test_absent_temperature_is_cached_where_the_models_are_greedy(memory_gw):
    fake, gw = memory_gw(default_greedy=True)
    body = chat(unique())
    del body["temperature"]
    assert post(gw, body).headers["x-cache"] == "MISS"
    assert post(gw, body).headers["x-cache"] == "HIT"
    assert post(gw, {**body, "temperature": 0.5}).headers["x-cache"] == "BYPASS"
    assert completions(fake) == 2


@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="sse")])
@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_errors_are_never_stored(memory_gw, stream, status):
    fake, gw = memory_gw()
    body = chat(unique(), stream=stream, fake={"status": status})
    for _ in range(2):
        response = post(gw, body)
        assert response.status_code == status
        assert response.headers.get("x-cache") != "HIT"
    assert completions(fake) == 2


def test_broken_streams_are_never_stored(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), stream=True, fake={"fail_after": 3})
    for _ in range(2):
        response = post(gw, body)
        assert response.headers["x-cache"] == "MISS"
        assert b'"error"' in response.content  # the break is reported in the stream
    assert completions(fake) == 2
    # the same question answered in full is then stored (the key ignores nothing else)
    good = chat(unique(), stream=True)
    post(gw, good)
    assert post(gw, good).headers["x-cache"] == "HIT"


# -- Cache-Control, headers --------------------------------------------------------------


def test_hit_headers_age_and_server_timing(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    miss = post(gw, body)
    assert miss.headers["x-cache"] == "MISS" and "age" not in miss.headers
    assert 'cache;desc="hit"' not in miss.headers["server-timing"]
    time.sleep(1.1)
    hit = post(gw, body)
    assert hit.headers["x-cache"] == "HIT"
    assert int(hit.headers["age"]) >= 1
    assert re.search(r'(^|, )cache;dur=[0-9.]+;desc="hit"', hit.headers["server-timing"]), hit.headers["server-timing"]
    assert same_answer(hit, miss.content)
    assert completions(fake) == 1


def test_cache_control_no_cache_refreshes(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    post(gw, body)
    time.sleep(2.1)
    refreshed = post(gw, body, {"cache-control": "no-cache"})
    assert refreshed.headers["x-cache"] == "MISS"  # looked nothing up, went upstream
    assert completions(fake) == 2
    hit = post(gw, body)
    assert hit.headers["x-cache"] == "HIT"
    assert int(hit.headers["age"]) <= 1  # the refreshed entry, not the older one (2 s and more)
    assert completions(fake) == 2


def test_cache_control_no_store_neither_reads_nor_writes(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    assert post(gw, body, {"cache-control": "no-store"}).headers["x-cache"] == "BYPASS"
    assert post(gw, body).headers["x-cache"] == "MISS"  # nothing was written
    assert post(gw, body, {"cache-control": "no-store"}).headers["x-cache"] == "BYPASS"  # nor read
    assert completions(fake) == 3


def test_cache_control_max_age(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    post(gw, body)
    assert post(gw, body, {"cache-control": "max-age=60"}).headers["x-cache"] == "HIT"
    time.sleep(1.1)
    assert post(gw, body, {"cache-control": "max-age=0"}).headers["x-cache"] == "MISS"
    assert completions(fake) == 2
    time.sleep(1.1)
    assert post(gw, body, {"cache-control": "max-age=1"}).headers["x-cache"] == "MISS"
    assert completions(fake) == 3


def test_cache_control_only_if_cached(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    response = post(gw, body, {"cache-control": "only-if-cached"})
    assert response.status_code == 504
    assert completions(fake) == 0
    post(gw, body)
    assert post(gw, body, {"cache-control": "only-if-cached"}).headers["x-cache"] == "HIT"
    assert completions(fake) == 1


# -- replay shapes -----------------------------------------------------------------------


def test_stream_replay_is_the_stored_answer_with_its_own_id_and_usage_comes_when_asked(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), stream=True)
    direct = httpx.post(fake.url + CHAT_PATH, json=body)
    direct_usage = httpx.post(fake.url + CHAT_PATH, json={**body, "stream_options": {"include_usage": True}})
    upstream_before = completions(fake)

    leader = post(gw, body)
    assert leader.headers["x-cache"] == "MISS"
    assert leader.content == direct.content  # the usage asked for on the leader's behalf is hidden
    assert b'"usage"' not in leader.content
    assert fake.requests[-1].body["stream_options"] == {"include_usage": True}

    hit = post(gw, body)
    assert hit.headers["x-cache"] == "HIT"
    assert same_answer(hit, direct.content)

    with_usage = post(gw, {**body, "stream_options": {"include_usage": True}})
    assert with_usage.headers["x-cache"] == "HIT"
    assert same_answer(with_usage, direct_usage.content)
    usage = orjson.loads(sse_payloads(with_usage.content)[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8

    as_json = post(gw, {**body, "stream": False})
    assert as_json.headers["x-cache"] == "HIT"
    assert as_json.json()["usage"]["completion_tokens"] == 8
    assert completions(fake) == upstream_before + 1


def test_websocket_hit_and_miss(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique())
    ws_url = gw.url.replace("http", "ws") + "/v1/ws"

    def ask(ws) -> list[dict]:
        ws.send(orjson.dumps(body).decode())
        return ws_answer(ws)

    with ws_connect(ws_url) as ws:
        first = ask(ws)
        second = ask(ws)
    assert first[-1] == second[-1] == {"type": "done"}
    ids = {m.pop("id", None) for m in second[:-1]}
    assert len(ids) == 1 and ids != {first[0]["id"]}  # the hit's own id
    for m in (*first[:-1], *second[:-1]):
        m.pop("id", None), m.pop("created", None)
    assert first == second
    assert len(first) == 10  # 8 tokens, finish chunk, done (no usage: not asked)
    assert completions(fake) == 1
    # the entry the WebSocket stored answers HTTP as well, and vice versa
    assert post(gw, {**body, "stream": True}).headers["x-cache"] == "HIT"
    http_first = chat(unique())
    post(gw, http_first)
    body = http_first
    with ws_connect(ws_url) as ws:
        replayed = ask(ws)
    assert replayed[-1] == {"type": "done"}
    assert "".join(m["choices"][0]["delta"].get("content") or "" for m in replayed[:-1]) == "".join(
        f"tok{i} " for i in range(8)
    )
    assert completions(fake) == 2


# -- memory tier bounds ------------------------------------------------------------------


def test_memory_tier_is_byte_bounded(memory_gw):
    # each answer is ~8 x 200 bytes of content; the tier holds about three
    _, gw = memory_gw(memory_max_bytes=6000, max_entry_bytes=3000)
    bodies = [chat(unique(), fake={"pad": 190}) for _ in range(6)]
    for body in bodies:
        assert post(gw, body).headers["x-cache"] == "MISS"
    assert metric(gw, "edgegw_cache_evictions_total") >= 2
    assert post(gw, bodies[-1]).headers["x-cache"] == "HIT"  # the newest survived
    assert post(gw, bodies[0]).headers["x-cache"] == "MISS"  # the oldest was evicted
    held = metric(gw, "edgegw_cache_memory_bytes")
    assert 0 < held <= 6000


def test_entries_over_max_entry_bytes_are_not_stored(memory_gw):
    fake, gw = memory_gw(memory_max_bytes=100_000, max_entry_bytes=2000)
    big = chat(unique(), fake={"pad": 500})
    small = chat(unique())
    for body in (big, big, small, small):
        post(gw, body)
    assert completions(fake) == 3  # the big one twice, the small one once
    assert metric(gw, "edgegw_cache_rejected_total") >= 2


# -- Redis and tiered ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis", "tiered"])
def test_redis_tiers_share_entries_between_gateways(upstreams, gateways, namespace, backend):
    fake = upstreams()
    config = {"clusters": [cluster(fake)], "cache": {"backend": backend, "redis_url": REDIS_URL, "namespace": namespace}}
    one, two = gateways(config), gateways(config)
    body = chat(unique())
    stream = {**body, "stream": True}
    first = post(one, stream)
    assert first.headers["x-cache"] == "MISS"
    assert post(one, stream).headers["x-cache"] == "HIT"
    other = post(two, stream)  # the other gateway finds it in Redis
    assert other.headers["x-cache"] == "HIT"
    assert same_answer(other, first.content)
    assert post(two, body).headers["x-cache"] == "HIT"
    assert completions(fake) == 1
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert any(k.startswith(f"{namespace}:c:".encode()) for k in client.scan_iter(match=namespace + ":*"))
    finally:
        client.close()


# -- single-flight -----------------------------------------------------------------------


async def _burst(urls: list[str], body: dict, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=n)) as client:
        tasks = [
            client.post(urls[i % len(urls)] + CHAT_PATH, json={**body, "stream": i % 2 == 1})
            for i in range(n)
        ]
        return await asyncio.gather(*tasks)


def _check_burst(responses: list[httpx.Response], tokens: int) -> None:
    expected = "".join(f"tok{i} " for i in range(tokens))
    assert all(r.status_code == 200 for r in responses)
    assert all(text_of(r) == expected for r in responses)
    streams = [r.content for r in responses if r.headers["content-type"].startswith("text/event-stream")]
    bodies = [r.content for r in responses if not r.headers["content-type"].startswith("text/event-stream")]
    assert streams and bodies
    assert len(set(streams)) == 1 and len(set(bodies)) == 1  # all of a shape byte-identical


async def test_singleflight_burst_goes_upstream_once(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), fake={"ttft": 0.5, "delay": 0.01, "tokens": 20})
    responses = await _burst([gw.url], body, 20)
    assert completions(fake) == 1
    _check_burst(responses, 20)
    assert sum(r.headers["x-cache"] == "MISS" for r in responses) == 20  # none was in the cache yet
    assert metric(gw, "edgegw_cache_coalesced_followers_total") == 19
    assert post(gw, body).headers["x-cache"] == "HIT"


async def test_singleflight_across_gateway_processes(upstreams, gateway_processes, namespace):
    fake = upstreams()
    config = {
        "clusters": [cluster(fake)],
        "cache": {"backend": "redis", "redis_url": REDIS_URL, "namespace": namespace},
    }
    one, two = gateway_processes(config), gateway_processes(config)
    body = chat(unique(), fake={"ttft": 0.8, "delay": 0.01, "tokens": 20})
    responses = await _burst([one.url, two.url], body, 20)
    assert completions(fake) == 1
    _check_burst(responses, 20)
    assert post(two, body).headers["x-cache"] == "HIT"
    assert post(one, body).headers["x-cache"] == "HIT"

    # a leader broken mid-stream: the other process's followers end too, nothing stored
    broken = chat(unique(), stream=True, fake={"ttft": 0.5, "delay": 0.05, "fail_after": 3})
    before = completions(fake)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=15) as client:
        urls = [one.url, two.url] * 5
        responses = await asyncio.wait_for(asyncio.gather(*[client.post(u + CHAT_PATH, json=broken) for u in urls]), 12)
    assert time.monotonic() - started < 10
    assert all(r.status_code >= 400 or b'"error"' in r.content for r in responses)
    assert completions(fake) - before >= 1
    for gw in (one, two):
        calls = completions(fake)
        assert post(gw, broken).headers["x-cache"] == "MISS"
        assert completions(fake) == calls + 1


async def test_broken_leader_does_not_strand_followers(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), stream=True, fake={"ttft": 0.3, "delay": 0.05, "fail_after": 3})
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=15) as client:
        responses = await asyncio.wait_for(
            asyncio.gather(*[client.post(gw.url + CHAT_PATH, json=body) for _ in range(10)]), 12
        )
    assert time.monotonic() - started < 10
    for response in responses:
        # each one ends: an error event in the stream (or an error status), never a hang
        assert response.status_code >= 400 or b'"error"' in response.content
    assert 1 <= completions(fake) <= 10
    # nothing was stored: the next ask goes upstream again
    before = completions(fake)
    assert post(gw, body).headers["x-cache"] == "MISS"
    assert completions(fake) == before + 1


async def test_followers_of_a_failed_json_leader_retry_upstream(memory_gw):
    fake, gw = memory_gw()
    body = chat(unique(), fake={"ttft": 0.3, "status": 500})
    async with httpx.AsyncClient(timeout=15) as client:
        responses = await asyncio.wait_for(
            asyncio.gather(*[client.post(gw.url + CHAT_PATH, json=body) for _ in range(6)]), 12
        )
    assert all(r.status_code == 500 for r in responses)
    assert completions(fake) >= 2  # the followers went upstream themselves after the leader failed
    for response in responses:
        assert response.headers.get("x-cache") != "HIT"
    again = post(gw, body)  # nothing stored (the upstream may be ejected by now: 503)
    assert again.status_code >= 500 and again.headers.get("x-cache") != "HIT"


# -- Redis outage ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["redis", "tiered"])
def test_redis_outage_degrades_to_misses(upstreams, gateways, private_redis, backend):
    port, proc = private_redis
    fake = upstreams()
    gw = gateways(
        {
            "clusters": [cluster(fake)],
            "cache": {"backend": backend, "redis_url": f"redis://127.0.0.1:{port}/0", "namespace": "outage"},
        }
    )
    warm = chat(unique())
    assert post(gw, warm).headers["x-cache"] == "MISS"
    assert post(gw, warm).headers["x-cache"] == "HIT"
    assert metric(gw, "edgegw_cache_errors_total") == 0

    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    calls = completions(fake)
    slowest = 0.0
    for i in range(12):
        body = chat(unique(), stream=i % 2 == 1)
        started = time.monotonic()
        response = post(gw, body, timeout=5)
        slowest = max(slowest, time.monotonic() - started)
        assert response.status_code == 200
        assert response.headers["x-cache"] in ("MISS", "BYPASS")
        assert text_of(response) == "".join(f"tok{i} " for i in range(8))
    assert slowest < 3.0, slowest  # short timeouts and an open circuit: no multi-second stalls (a generous bound)
    assert completions(fake) == calls + 12
    assert metric(gw, "edgegw_cache_errors_total") >= 1
    # a burst while Redis is down still answers everyone
    if backend == "tiered":
        assert post(gw, warm).headers["x-cache"] == "HIT"  # the memory tier still has it


# -- command line ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [pytest.param("memory", id="memory"), pytest.param(REDIS_URL, id="redis")])
def test_cli_quick_start_cache_flag(upstreams, tmp_path, value):
    fake = upstreams()
    gw = GatewayProcess(None, tmp_path, ["--upstream", fake.url, "--cache", value])
    try:
        gw.start()
        body = chat(unique())
        assert post(gw, body).headers["x-cache"] == "MISS"
        assert post(gw, body).headers["x-cache"] == "HIT"
        assert completions(fake) == 1
    finally:
        gw.stop()
    if value.startswith("redis"):
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match="edgegw:c:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_cli_rejects_a_bad_cache_value(capsys):
    # `edgegw serve` as the command line runs it, in this process: it refuses before serving
    assert edgegw_main(["serve", "--upstream", "http://127.0.0.1:9", "--cache", "memcached://x"]) == 2
    assert "--cache" in capsys.readouterr().err


# -- Recorder: the leader's answer recorded, hidden usage, stored only when complete ----------


def recorder_for(body: dict, cache_control: str | None = None):
    layer = CacheLayer(CacheConfig(backend="memory"), CollectorRegistry())
    parsed = parse_request("chat", orjson.dumps(body))
    lookup = layer.plan(parsed, "tenant", {"cache-control": cache_control} if cache_control else {})
    return layer, lookup, Recorder(layer, lookup, None, "chat")


def event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


CHUNK = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
LAST = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {**CHUNK, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


async def test_recorder_stores_a_complete_stream_with_the_usage_it_asked_for():
    layer, lookup, recorder = recorder_for(chat(stream=True))
    assert lookup.fields == {"stream_options": {"include_usage": True}}
    await recorder.feed(event(CHUNK) + event(LAST))
    await recorder.feed(event(USAGE) + b"data: [DONE]\n\n")
    assert await recorder.finish(True)
    entry = await layer.get(lookup)
    assert entry is not None and len(entry.chunks) == 3  # the usage chunk is kept for clients who want it


def test_the_relay_hides_the_usage_chunk_asked_for_on_the_clients_behalf():
    ctx = types.SimpleNamespace(charge=Charge())
    events = event(LAST) + event(USAGE) + b"data: [DONE]\n\n"
    assert _take_usage(ctx, events, hide=True) == event(LAST) + b"data: [DONE]\n\n"
    assert ctx.charge.usage == 2
    assert _take_usage(ctx, events, hide=False) == events  # the client asked: passed on as received


async def test_recorder_stores_nothing_from_a_broken_or_incomplete_answer():
    layer, lookup, recorder = recorder_for(chat(stream=True, stream_options={"include_usage": True}))
    assert lookup.fields is None
    await recorder.feed(event(CHUNK))  # no finish_reason, no [DONE]
    assert not await recorder.finish(True)
    assert await layer.get(lookup) is None
    layer, lookup, broken = recorder_for(chat(stream=True))
    await broken.feed(event(CHUNK) + event(LAST) + b"data: [DONE]\n\n")
    assert not await broken.finish(False)  # the relay broke off: not stored, whatever was seen
    assert await layer.get(lookup) is None
