"""Where every millisecond went: one stage model for Server-Timing, the access log and the
stage histogram; SLO burn rates; the live diagnosis, each verdict produced by a fake driven
into that state."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import httpx
import pytest

from tests.conftest import cluster
from tests.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def stages_of(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(", "):
        name = part.split(";")[0]
        out[name] = float(part.split("dur=")[1].split(";")[0])
    return out


def test_the_stages_of_a_request_sum_to_its_total_and_to_the_clients_clock(upstreams, gateways):
    fake = upstreams(ttft=1.0, tokens=4, delay=0.02)
    gw = gateways({"clusters": [cluster(fake)]})
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT)  # warm
    with httpx.Client() as client:
        started = time.perf_counter()
        response = client.post(gw.url + "/v1/chat/completions", json=CHAT)
        client_ms = (time.perf_counter() - started) * 1000
    stages = stages_of(response.headers["server-timing"])
    total = stages.pop("total")
    assert {"admit", "route", "queue", "pool", "upstream", "decode"} <= set(stages)
    assert abs(sum(stages.values()) - total) <= 0.05 * total, (stages, total)
    # the gateway's clock runs inside the client's: what it misses is the wire and the client's
    # own work (a share the machine's load can grow: the bound is generous)
    assert total <= client_ms and client_ms - total <= 0.25 * client_ms, (total, client_ms)
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'edgegw_stage_seconds_count{stage="upstream",target_kind="endpoint"} 2.0' in metrics
    assert 'edgegw_stage_seconds_count{stage="total",target_kind="endpoint"} 2.0' in metrics


def test_a_streams_stages_are_logged_with_first_token_and_decode(upstreams, gateways, caplog):
    fake = upstreams(ttft=0.1, tokens=5, delay=0.02)
    gw = gateways({"clusters": [cluster(fake)], "listen": {"access_log": True}})
    with caplog.at_level(logging.INFO, logger="edgegw.access"):
        httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True, "fake": {"ttft": 0.1}})
        deadline = time.monotonic() + 3
        while not [r for r in caplog.records if r.name == "edgegw.access"] and time.monotonic() < deadline:
            time.sleep(0.02)
    line = next(r.getMessage() for r in caplog.records if r.name == "edgegw.access")
    stages = dict(part.split(":") for part in line.split("stages=")[1].split(","))
    assert {"first_token", "decode"} <= set(stages)
    total = float(line.split("total=")[1].split("ms")[0])
    assert abs(sum(float(v) for v in stages.values()) - total) <= 0.05 * total, line
    assert float(stages["first_token"]) + float(stages["upstream"]) >= 90  # the fake's 0.1 s to its first token


def test_burn_rates_and_alerts_of_an_objective(upstreams, gateways):
    fake = upstreams()
    config = {
        "clusters": [cluster(fake)],
        "slo": {
            "objectives": [
                {"name": "fast", "metric": "ttft", "threshold_ms": 150, "target": 0.9},
                {"name": "up", "metric": "availability", "target": 0.99},
            ],
            "windows": [{"long": "1h", "short": "5m", "burn": 4}],
        },
    }
    gw = gateways(config)
    url = gw.url + "/v1/chat/completions"
    for ttft in (0.0, 0.0, 0.3, 0.3, 0.0, 0.3, 0.3, 0.0, 0.3, 0.0):
        httpx.post(url, json={**CHAT, "stream": True, "fake": {"ttft": ttft}}, timeout=10)
    metrics = httpx.get(gw.url + "/metrics").text
    # half of the answers were slow: a bad share of 0.5 against a budget of 0.1 burns at 5
    assert 'edgegw_slo_burn_rate{objective="fast",window="1h"} 5.0' in metrics
    assert 'edgegw_slo_burn_rate{objective="fast",window="5m"} 5.0' in metrics
    assert 'edgegw_slo_alert{objective="fast"} 1.0' in metrics
    assert 'edgegw_slo_error_budget_remaining{objective="fast"} 0.0' in metrics
    assert 'edgegw_slo_burn_rate{objective="up",window="1h"} 0.0' in metrics
    assert 'edgegw_slo_alert{objective="up"} 0.0' in metrics
    slo = httpx.get(gw.url + "/debug/latency").json()["slo"]
    assert [o["name"] for o in slo] == ["fast", "up"] and slo[0]["alert"] is True


def test_burn_rates_are_shared_by_replicas_through_redis(upstreams, gateways):
    fake = upstreams()
    namespace = f"slo-test-{time.monotonic_ns()}"
    slo = {
        "objectives": [{"name": "fast", "metric": "ttft", "threshold_ms": 150, "target": 0.9}],
        "redis_url": "redis://127.0.0.1:6379/15",
        "namespace": namespace,
    }
    one, two = gateways({"clusters": [cluster(fake)], "slo": slo}), gateways({"clusters": [cluster(fake)], "slo": slo})
    for ttft in (0.3, 0.3):
        httpx.post(one.url + "/v1/chat/completions", json={**CHAT, "stream": True, "fake": {"ttft": ttft}}, timeout=10)
    for _ in range(2):
        httpx.post(two.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        views = [httpx.get(gw.url + "/debug/latency").json()["slo"][0] for gw in (one, two)]
        if all(v["shared"] and v["burn"]["1h"] == 5.0 for v in views):
            break
        time.sleep(0.5)
    assert all(v["shared"] and v["burn"]["1h"] == 5.0 for v in views), views  # 2 bad of 4, fleet-wide


# -- the diagnosis, one fake per verdict ---------------------------------------------------


def diagnosis_of(gw, target: str) -> dict:
    view = next(t for t in httpx.get(gw.url + "/debug/latency").json()["targets"] if t["name"] == target)
    return view


def send(gw, count: int, concurrency: int = 1, **body) -> None:
    def one(i: int) -> None:
        payload = {**CHAT, **{k: (v(i) if callable(v) else v) for k, v in body.items()}}
        httpx.post(gw.url + "/v1/chat/completions", json=payload, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))


def test_a_healthy_target(upstreams, gateways):
    fake = upstreams(ttft=0.05, tokens=4, delay=0.01)
    gw = gateways({"clusters": [cluster(fake)]})
    assert diagnosis_of(gw, fake.url)["diagnosis"]["verdict"] == "unknown"
    send(gw, 10, stream=True)
    view = diagnosis_of(gw, fake.url)
    assert view["diagnosis"]["verdict"] == "healthy", view["diagnosis"]
    assert view["requests"] == 10 and view["ttft_ms"]["p50"] >= 45
    assert {"queue", "pool", "upstream", "first_token", "decode"} <= set(view["stages_ms"])
    assert 'edgegw_diagnosis{target="' + fake.url + '",verdict="healthy"} 1.0' in httpx.get(gw.url + "/metrics").text


def test_a_saturated_queue(upstreams, gateways):
    fake = upstreams(ttft=0.2, tokens=2)
    config = {
        "clusters": [{"name": "c", "models": ["fake-model"], "endpoints": [{"url": fake.url, "max_concurrency": 1}]}],
        "admission": {"predict": False},
    }
    gw = gateways(config)
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=send(gw, 16, concurrency=8, stream=True)))
    thread.start()
    deadline = time.monotonic() + 10
    view = None
    while time.monotonic() < deadline:
        view = diagnosis_of(gw, fake.url)
        if view["diagnosis"]["verdict"] == "queue_saturated":
            break
        time.sleep(0.2)
    thread.join(30)
    assert view["diagnosis"]["verdict"] == "queue_saturated", view
    assert "waiting" in view["diagnosis"]["evidence"]


def test_a_prefill_bound_target(upstreams, gateways):
    fake = upstreams(tokens=2)
    gw = gateways({"clusters": [cluster(fake)]})
    # the fake's TTFT grows with the prompt, as a model's prefill does
    sizes = [200, 2000, 400, 3000, 800, 1200, 2500, 100, 1600, 600]
    for size in sizes:
        body = {**CHAT, "messages": [{"role": "user", "content": "x" * size * 4}], "stream": True, "fake": {"ttft": size / 10_000}}
        httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    view = diagnosis_of(gw, fake.url)
    assert view["diagnosis"]["verdict"] == "prefill_bound", view["diagnosis"]


def test_a_decode_bound_target(upstreams, gateways):
    fake = upstreams(ttft=0.02, tokens=4, delay=0.15)  # under 10 tokens/s
    gw = gateways({"clusters": [cluster(fake)]})
    send(gw, 8, concurrency=4, stream=True)
    view = diagnosis_of(gw, fake.url)
    assert view["diagnosis"]["verdict"] == "decode_bound", view["diagnosis"]
    assert view["tpot_ms"]["p50"] >= 140


async def _delaying_proxy(target_port: int, delay: float, ready: asyncio.Future, stop: asyncio.Event) -> None:
    """A TCP proxy that holds every chunk for ``delay`` seconds each way: a long wire."""
    handlers: set[asyncio.Task] = set()

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer):
        handlers.add(asyncio.current_task())
        try:
            await asyncio.sleep(delay)  # the handshake's round trip
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target_port)
            await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))
        finally:
            client_writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    ready.set_result(server.sockets[0].getsockname()[1])
    async with server:
        await stop.wait()
    for task in handlers:
        task.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)
    await asyncio.sleep(0.05)  # the transports report themselves closed


def test_a_network_bound_target(upstreams, gateways):
    fake = upstreams(ttft=0.0, tokens=2)
    loop = asyncio.new_event_loop()
    ready, stop = loop.create_future(), asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(_delaying_proxy(fake.port, 0.05, ready, stop),), daemon=True)
    thread.start()
    while not ready.done():
        time.sleep(0.01)
    port = ready.result()
    url = f"http://127.0.0.1:{port}"
    try:
        config = {
            "clusters": [{"name": "far", "models": ["fake-model"], "endpoints": [{"url": url, "warm_connections": 0, "pool_size": 64}]}],
            "routing": {"health": {"probe_path": "/health", "probe_interval_s": 0.2}},
        }
        gw = gateways(config)
        health = gw.state.fleet.health
        wait_until(lambda: health.endpoint(url).rtt_s is not None, what="a probe's round trip measured")
        send(gw, 10, concurrency=10, stream=True)  # new connections: each pays the wire
        view = diagnosis_of(gw, url)
        assert view["diagnosis"]["verdict"] == "network_bound", view["diagnosis"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()


def test_the_hot_path_histogram_exposes_what_prometheus_clients_own_would():
    """``gateway.observe.Histogram`` (no locks, per-bucket counts summed at scrape
    time) against ``prometheus_client.Histogram`` fed the same values: the same text."""
    import random

    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.observe.metrics import _LATENCY_BUCKETS, LoopHistogram as Histogram

    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    lean = Histogram("x_seconds", "x", ["stage"], buckets=_LATENCY_BUCKETS, registry=ours)
    reference = prometheus_client.Histogram("x_seconds", "x", ["stage"], buckets=_LATENCY_BUCKETS, registry=theirs)
    rng = random.Random(7)
    values = [rng.lognormvariate(-4, 2) for _ in range(2000)] + list(_LATENCY_BUCKETS) + [500.0]  # bounds are inclusive
    for i, value in enumerate(values):
        stage = ("queue", "upstream")[i % 2]
        lean.labels(stage).observe(value)
        reference.labels(stage).observe(value)

    def samples(registry) -> dict:
        text = prometheus_client.generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        }

    got, want = samples(ours), samples(theirs)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key
    assert got[("x_seconds_count", (("stage", "queue"),))] == 1009
