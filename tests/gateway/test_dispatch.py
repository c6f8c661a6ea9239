"""Routing through the running gateway: two regions of fake upstreams on loopback.

Clients are placed with ``X-Forwarded-For`` from a trusted loopback proxy and a .mmdb
fixture (TEST-NET-1 in San Jose, TEST-NET-2 in Frankfurt); the regions are us-west and
eu-central. What is asserted is what a client or an upstream can see: which fake got
the request (and with which model), the ``x-edgegw-route`` header, disconnects, plus the
gateway's health state for ejection and readmission.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from routing import BreakerState
from tests.conftest import cluster
from tests.fakes import FakeUpstream, free_port

US_CLIENT = "192.0.2.10"
EU_CLIENT = "198.51.100.7"
MODEL = "fake-model"


def endpoints(*urls: str) -> list[dict]:
    return [{"url": u, "warm_connections": 0, "connect_timeout_s": 1.0} for u in urls]


def two_regions(geo_db: str, west: list[str], east: list[str], **routing) -> dict:
    """us-west (cluster `west`) and eu-central (cluster `east`), both serving MODEL."""
    base = {
        "geoip_db": geo_db,
        "trusted_proxies": ["127.0.0.0/8"],
        "default_region": "us-west",
        "local_region": "us-west",
        "regions": [
            {"name": "us-west", "lat": 37.77, "lon": -122.42, "clusters": ["west"]},
            {"name": "eu-central", "lat": 50.11, "lon": 8.68, "clusters": ["east"]},
        ],
        "aliases": {"auto": "auto", "smart": MODEL},
        "balancer": {"affinity": False},
        "hedging": {"enabled": False},
    }
    for key, value in routing.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return {
        "clusters": [
            {"name": "west", "models": [MODEL], "endpoints": endpoints(*west)},
            {"name": "east", "models": [MODEL], "endpoints": endpoints(*east)},
        ],
        "routing": base,
    }


def post(gw, client_ip: str, *, stream: bool = False, model: str = MODEL, headers: dict | None = None, **body) -> httpx.Response:
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json=payload,
        headers={**({"x-forwarded-for": client_ip} if client_ip else {}), **(headers or {})},
        timeout=15,
    )
    route = response.headers.get("x-edgegw-route")
    assert route is not None, "x-edgegw-route on every response"
    assert "\n" not in route and "\r" not in route
    assert route.startswith("target=") and "why=" in route
    return response


def wait_for(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_requests_go_to_the_clients_nearest_region(upstreams, gateways, geo_db):
    west, east = upstreams(), upstreams()
    config = two_regions(geo_db, [west.url], [east.url])
    # before anything is measured the client's distance decides (after, the gateway's own
    # TTFT measurements do: see the next test), so each client meets a fresh gateway
    eu = post(gateways(config), EU_CLIENT)
    assert eu.status_code == 200
    assert len(east.requests) == 1 and not west.requests
    route = eu.headers["x-edgegw-route"]
    assert f"target=endpoint; cluster=east; endpoint={east.url}" in route
    assert "target-region=eu-central; client-region=eu-central" in route
    assert f"fallbacks=west@{west.url}" in route
    assert "region eu-central (east) predicted" in route
    gw = gateways(config)
    us = post(gw, US_CLIENT, stream=True)
    assert us.status_code == 200 and "data: [DONE]" in us.text
    assert len(west.requests) == 1 and len(east.requests) == 1
    assert f"target=endpoint; cluster=west; endpoint={west.url}" in us.headers["x-edgegw-route"]
    assert "client-region=us-west" in us.headers["x-edgegw-route"]
    # no X-Forwarded-For: the peer 127.0.0.1 itself, in no database -> the default region
    local = post(gw, "")
    assert "client-region=us-west" in local.headers["x-edgegw-route"]
    assert "location unknown -> default region us-west" in local.headers["x-edgegw-route"]


def test_load_shifts_to_the_faster_endpoint_once_measured(upstreams, gateways, geo_db):
    a, b = upstreams(ttft=0.05), upstreams(ttft=0.05)
    # prior_ttft_ms 0: an unmeasured replica looks fast, so both get tried and measured
    config = two_regions(geo_db, [a.url, b.url], [], policy={"prior_ttft_ms": 0.0})
    config["clusters"] = config["clusters"][:1]
    config["routing"]["regions"] = config["routing"]["regions"][:1]
    gw = gateways(config)
    health = gw.state.fleet.health
    for _ in range(6):
        assert post(gw, US_CLIENT, stream=True).status_code == 200
    assert a.requests and b.requests, "both replicas measured"
    # slow down the replica routing prefers right now: the one measured faster (with two
    # replicas, power-of-two-choices compares both, and nothing is in flight)
    preferred_a = health.endpoint(a.url).ttft_s <= health.endpoint(b.url).ttft_s
    slow, fast = (a, b) if preferred_a else (b, a)
    slow.defaults["ttft"] = 1.0
    before = len(slow.requests)
    routes = [post(gw, US_CLIENT, stream=True).headers["x-edgegw-route"] for _ in range(8)]
    assert len(slow.requests) > before, "the slowed replica was measured slow..."
    assert all(f"endpoint={fast.url}" in r for r in routes[-4:]), "...and the load moved to the fast one"
    assert health.endpoint(slow.url).ttft_s > 0.2 > health.endpoint(fast.url).ttft_s
    assert health.endpoint(slow.url).inflight == 0 and health.endpoint(fast.url).inflight == 0


@pytest.mark.parametrize("failure", ["status-503", "closed-port"])
def test_a_failing_endpoint_is_failed_over_ejected_and_readmitted(upstreams, gateways, geo_db, failure):
    east = upstreams(ttft=0.1)  # measurably slower than west's prediction once west is back
    if failure == "status-503":
        broken = upstreams(status=503)
        broken_url = broken.url
    else:
        broken, broken_url = None, f"http://127.0.0.1:{free_port()}"
    health_cfg = {
        "failure_threshold": 2,
        "probe_path": "/health",  # active probes readmit it (passive health alone would too, on trial requests)
        "probe_interval_s": 0.1,
        "probe_timeout_s": 0.3,
        "open_duration_s": 0.5,
        "max_open_duration_s": 1.0,
        "half_open_probes": 1,
    }
    gw = gateways(two_regions(geo_db, [broken_url], [east.url], health=health_cfg, policy={"prior_ttft_ms": 10.0}))
    state = gw.state.fleet.health
    # a US client goes to west first; its failure is served by the east fallback
    r = post(gw, US_CLIENT)
    assert r.status_code == 200, r.text
    assert len(east.requests) == 1
    route = r.headers["x-edgegw-route"]
    if failure == "status-503" or "skipped west" not in route:  # a closed port may fail its probes first
        assert f"target=endpoint; cluster=west; endpoint={broken_url}" in route
        assert f"served-by=east@{east.url}" in route
    if broken is not None:
        broken.defaults["health_delay"] = 5.0  # its probes now time out as well

    def ejected() -> bool:
        if state.state(broken_url, time.monotonic()) is BreakerState.OPEN:
            return True
        assert post(gw, US_CLIENT).status_code == 200
        return False

    # failed requests and probes eject it: the circuit opens and routing avoids it
    wait_for(ejected, 5, "ejection")
    sent = len(broken.requests) if broken is not None else 0
    r = post(gw, US_CLIENT)
    assert r.status_code == 200
    route = r.headers["x-edgegw-route"]
    assert f"target=endpoint; cluster=east; endpoint={east.url}" in route
    assert "skipped west: all endpoints ejected" in route
    assert "served-by" not in route
    if broken is not None:
        assert len(broken.requests) == sent, "an ejected endpoint gets no requests"
    assert f'edgegw_endpoint_breaker_state{{endpoint="{broken_url}"}} 2.0' in httpx.get(gw.url + "/metrics").text
    # it recovers; the active probes readmit it (half-open, then closed) without a request
    if broken is not None:
        broken.defaults.update(status=200, health_delay=0.0)
    else:
        broken = FakeUpstream()
        broken.port, broken.url = int(broken_url.rsplit(":", 1)[1]), broken_url
        broken.start()
    try:
        wait_for(lambda: state.state(broken_url, time.monotonic()) is BreakerState.CLOSED, 8, "readmission")
        r = post(gw, US_CLIENT)
        assert r.status_code == 200
        assert f"target=endpoint; cluster=west; endpoint={broken_url}" in r.headers["x-edgegw-route"]
        assert "served-by" not in r.headers["x-edgegw-route"]
        assert broken.requests[-1].body["messages"][0]["content"] == "hi"
    finally:
        if failure == "closed-port":
            broken.stop()


def test_a_late_first_token_is_hedged_and_the_slow_primary_cancelled(upstreams, gateways, geo_db):
    slow, hedge = upstreams(ttft=60.0), upstreams()  # the primary's first token is a minute away: only the hedge can answer
    config = two_regions(geo_db, [slow.url], [hedge.url], hedging={"enabled": True, "budget_fraction": 0.5, "min_delay_ms": 0})
    gw = gateways(config)
    r = post(gw, US_CLIENT, stream=True, headers={"x-latency-budget-ms": "300"})
    assert r.status_code == 200 and "data: [DONE]" in r.text
    route = r.headers["x-edgegw-route"]
    assert f"target=endpoint; cluster=west; endpoint={slow.url}" in route
    assert "budget=300ms" in route and f"hedge=east@{hedge.url}@150ms" in route
    assert "edgegw_hedge_wins_total 1.0" in httpx.get(gw.url + "/metrics").text
    assert len(slow.requests) == 1 and len(hedge.requests) == 1
    assert slow.requests[0].disconnected.wait(3), "the slow primary's request was cancelled"
    assert not slow.requests[0].finished
    # and nothing is left counted in flight on either endpoint
    health = gw.state.fleet.health
    wait_for(lambda: health.endpoint(slow.url).inflight == 0, 3, "the loser's in-flight count released")
    assert health.endpoint(hedge.url).inflight == 0


def test_a_json_request_is_not_hedged(upstreams, gateways, geo_db):
    """A non-streaming answer arrives whole after the generation: its first byte says
    nothing about a late first token, so it is never hedged."""
    slow, other = upstreams(ttft=0.6), upstreams()
    config = two_regions(geo_db, [slow.url], [other.url], hedging={"enabled": True, "budget_fraction": 0.075, "min_delay_ms": 0})
    gw = gateways(config)
    r = post(gw, US_CLIENT, headers={"x-latency-budget-ms": "2000"})  # the whole answer fits in its budget
    assert r.status_code == 200
    assert f"hedge=east@{other.url}@150ms" in r.headers["x-edgegw-route"]  # the decision offers one
    assert "served-by" not in r.headers["x-edgegw-route"]
    assert len(slow.requests) == 1 and not other.requests
    assert "edgegw_hedges_total 0.0" in httpx.get(gw.url + "/metrics").text


def test_auto_without_an_edge_engine_goes_to_a_cluster_and_aliases_resolve(upstreams, gateways, geo_db):
    west, east = upstreams(), upstreams()
    gw = gateways(two_regions(geo_db, [west.url], [east.url]))
    r = post(gw, EU_CLIENT, model="auto")
    assert r.status_code == 200
    assert "target=endpoint; cluster=east" in r.headers["x-edgegw-route"]
    assert "no edge engine here" in r.headers["x-edgegw-route"]
    assert east.requests[-1].body["model"] == MODEL, "auto rewritten to the central model upstream"
    r = post(gw, EU_CLIENT, model="smart", stream=True)
    assert r.status_code == 200
    assert "target=endpoint; cluster=east; endpoint=" in r.headers["x-edgegw-route"]
    assert east.requests[-1].body["model"] == MODEL, "alias rewritten for the upstream"
    assert east.requests[-1].body["messages"] == [{"role": "user", "content": "hi"}]
    assert f'"model":"{MODEL}"' in r.text.replace(" ", "")
    unknown = httpx.post(gw.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, timeout=15)
    assert unknown.status_code == 404


def test_an_upstream_4xx_does_not_leave_the_endpoint_counted_in_flight(upstreams, gateways, geo_db):
    west, east = upstreams(status=400), upstreams()
    gw = gateways(two_regions(geo_db, [west.url], [east.url]))
    for _ in range(3):
        assert post(gw, US_CLIENT).status_code == 400
    health = gw.state.fleet.health
    wait_for(lambda: health.endpoint(west.url).inflight == 0, 3, "in-flight released after a 4xx")


# -- hedging: a hedged stream behaves like any other ----------------------------------------


def hedged(geo_db: str, primary, hedge, **limits) -> dict:
    config = two_regions(geo_db, [primary.url], [hedge.url], hedging={"enabled": True, "budget_fraction": 0.5, "min_delay_ms": 0})
    config["limits"] = limits
    return config


def test_a_client_gone_in_the_hedge_window_cancels_both_attempts(upstreams, gateways, geo_db):
    slow, hedge = upstreams(ttft=5.0), upstreams(ttft=5.0)
    gw = gateways(hedged(geo_db, slow, hedge))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"x-forwarded-for": US_CLIENT, "x-latency-budget-ms": "300"}
    with httpx.Client(timeout=10) as client, client.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        wait_for(lambda: len(hedge.requests) == 1, 3, "the hedge to start")
    # the client has gone: both upstream requests are cancelled at once, nothing stays in flight
    wait_for(lambda: slow.requests[0].disconnected.is_set() and hedge.requests[0].disconnected.is_set(), 2, "both cancelled")
    health = gw.state.fleet.health
    wait_for(lambda: health.endpoint(slow.url).inflight == 0 and health.endpoint(hedge.url).inflight == 0, 2, "in-flight zero")
    wait_for(lambda: gw.state.gate.in_flight == 0, 2, "the slot released")


def test_a_hedged_stream_sends_headers_at_once_and_pings_while_waiting(upstreams, gateways, geo_db):
    slow, hedge = upstreams(ttft=1.5), upstreams(ttft=1.5)
    gw = gateways(hedged(geo_db, slow, hedge, keepalive_interval_s=0.2))
    r = post(gw, US_CLIENT, stream=True, headers={"x-latency-budget-ms": "300"})
    assert r.status_code == 200
    lines = [line for line in r.text.split("\n") if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data >= 3 and all(line == ": ping" for line in lines[:first_data]), lines[:5]
    assert lines[-1] == "data: [DONE]"


def test_the_hedge_winners_ttft_is_measured_from_when_it_was_sent(upstreams, gateways, geo_db):
    slow, hedge = upstreams(ttft=60.0), upstreams(ttft=0.05)
    gw = gateways(hedged(geo_db, slow, hedge))
    r = post(gw, US_CLIENT, stream=True, headers={"x-latency-budget-ms": "3000"})  # hedge after 1.5 s
    assert r.status_code == 200 and len(hedge.requests) == 1
    health = gw.state.fleet.health
    # from the hedge's own send (~0.05 s, whatever the machine's load adds), not the 1.5 s and
    # more since the request arrived
    assert health.endpoint(hedge.url).ttft_s < 1.5
    # the beaten primary is recorded as slow (a lower bound of its TTFT), not left unmeasured
    assert health.endpoint(slow.url).ttft_s >= 1.5


def test_a_json_answer_is_not_fed_into_the_ttft_average(upstreams, gateways, geo_db):
    west, east = upstreams(ttft=0.3), upstreams()
    gw = gateways(two_regions(geo_db, [west.url], [east.url]))
    assert post(gw, US_CLIENT).status_code == 200
    endpoint = gw.state.fleet.health.endpoint(west.url)
    assert endpoint.ttft_s is None  # a JSON answer's first byte is its last: no TTFT sample
    assert endpoint.requests == 1 and endpoint.inflight == 0


# -- governance: queues, deadlines, shedding, budgets passed on --------------------------------


def one_slot(fake, **admission) -> dict:
    return {
        "clusters": [{"name": "c", "models": [MODEL], "endpoints": [{"url": fake.url, "max_concurrency": 1, "warm_connections": 0}]}],
        "routing": {"hedging": {"enabled": False}},
        "admission": admission,
    }


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_two_equal_tenants_flooding_one_target_get_equal_shares(upstreams, gateways):
    fake = upstreams(ttft=0.02, tokens=1)
    config = {
        "clusters": [{"name": "c", "models": [MODEL], "endpoints": [{"url": fake.url, "max_concurrency": 2}]}],
        "routing": {"hedging": {"enabled": False}},
        "auth": {"mode": "required"},
        "tenants": [{"name": "a", "keys": ["sk-a"]}, {"name": "b", "keys": ["sk-b"]}],
        "admission": {"predict": False},
    }
    gw = gateways(config)
    done = {"a": 0, "b": 0}
    until = time.monotonic() + 3.0

    def flood(name: str) -> None:
        with httpx.Client(timeout=10, headers={"authorization": f"Bearer sk-{name}"}) as client:
            while time.monotonic() < until:
                if client.post(gw.url + "/v1/chat/completions", json=chat_body()).status_code == 200:
                    done[name] += 1

    with concurrent.futures.ThreadPoolExecutor(18) as pool:
        # b sends twice as many requests at once: it still gets only its equal share (a keeps
        # six in flight for two slots, so that it stays backlogged even when its client
        # threads are slow to send the next one on a loaded machine)
        futures = [pool.submit(flood, "a") for _ in range(6)] + [pool.submit(flood, "b") for _ in range(12)]
        for f in futures:
            f.result()
    assert done["a"] > 20, done
    assert abs(done["a"] - done["b"]) <= 0.1 * max(done.values()), done


def test_a_queued_request_past_its_deadline_is_never_sent(upstreams, gateways):
    fake = upstreams()
    gw = gateways(one_slot(fake, predict=False))
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True, fake={"ttft": 2.0})
    ):
        wait_for(lambda: len(fake.requests) == 1, 3, "the first request to hold the slot")
        late = client.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-latency-budget-ms": "300"})
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        assert "retry-after" in late.headers
        assert len(fake.requests) == 1  # dropped in the queue, never sent
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'edgegw_shed_total{priority="standard",reason="deadline"} 1.0' in metrics


def test_a_request_no_target_can_start_in_time_is_answered_at_once(upstreams, gateways):
    fake = upstreams()
    gw = gateways(one_slot(fake))
    # measure the target: a slot is held about half a second
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(fake={"ttft": 0.5}), timeout=10).status_code == 200
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True, fake={"ttft": 3.0})
    ):
        wait_for(lambda: len(fake.requests) == 2, 3, "the slot to be taken")
        shed = client.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-latency-budget-ms": "200"})
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "capacity_exceeded"
        assert int(shed.headers["retry-after"]) >= 1
        # at once, by the prediction, not queued until its budget ran out (that is reason=deadline)
        metrics = httpx.get(gw.url + "/metrics").text
        assert 'edgegw_shed_total{priority="standard",reason="capacity"} 1.0' in metrics
        assert 'reason="deadline"' not in metrics
        assert httpx.get(gw.url + "/readyz").status_code == 503  # a load balancer should steer away
        # a request with a budget that allows the wait is queued and served
        patient = client.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-latency-budget-ms": "10000"})
        assert patient.status_code == 200
    assert len(fake.requests) == 3


def test_a_tenant_waiting_behind_its_own_backlog_gets_429(upstreams, gateways):
    fake = upstreams()
    config = one_slot(fake)
    config["tenants"] = [{"name": "t", "keys": ["sk-t"]}]
    gw = gateways(config)
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(fake={"ttft": 0.5}), timeout=10).status_code == 200
    headers = {"authorization": "Bearer sk-t"}
    url = gw.url + "/v1/chat/completions"
    patient = {**headers, "x-latency-budget-ms": "20000"}
    queued = threading.Thread(target=lambda: httpx.post(url, json=chat_body(), headers=patient, timeout=20))
    with httpx.Client(timeout=10, headers=headers) as client, client.stream("POST", url, json=chat_body(stream=True, fake={"ttft": 3.0})):
        queued.start()
        wait_for(lambda: gw.state.fleet.queues[fake.url].waiting == 1, 3, "one of its requests waiting")
        refused = httpx.post(url, json=chat_body(), headers={**headers, "x-latency-budget-ms": "300"})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_backlog"
    queued.join(20)


def test_the_remaining_budget_is_passed_on_and_shrinks_at_every_hop(upstreams, gateways):
    fake = upstreams()
    central = gateways({"clusters": [cluster(fake)]})  # an edgegw in front of the inference server
    edge = gateways({"clusters": [{"name": "central", "models": ["fake-model"], "endpoints": [{"url": central.url + "/v1"}]}]})
    r = httpx.post(edge.url + "/v1/chat/completions", json=chat_body(stream=True), headers={"x-latency-budget-ms": "5000"}, timeout=10)
    assert r.status_code == 200
    budget = int(fake.requests[-1].headers["x-latency-budget-ms"])
    assert budget <= 4998  # two hops, each passing on strictly less than it got
    assert budget > 4000
    assert "budget=5000ms" in r.headers["x-edgegw-route"]  # the edge's own route; the central one's is not relayed
