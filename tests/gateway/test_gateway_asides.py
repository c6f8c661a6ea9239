"""The gateway's own requests to an endpoint (health probes, model discovery) never overlap a
client's request there, and what issue 21 found small: the budget a stream gets, the
handshake's request id, quiet logs.

llama.cpp's server ends its running generation for any new request, a ``GET`` included, so
a probe sent while a stream runs cuts the stream; a probe already out when a request comes
must be let finish first (it takes a millisecond on a LAN; the fake's ``health_delay`` makes
it long enough to see). The fake counts the GETs it is answering when each request arrives
(``Seen.gets_open``).
"""

from __future__ import annotations

import time
import uuid

import httpx
import orjson
from websockets.sync.client import connect as ws_connect

from tests.conftest import cluster, ws_answer
from tests.gateway.test_dispatch import US_CLIENT, post, two_regions

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.01)


def probing(fake, **health) -> dict:
    return {"clusters": [cluster(fake)], "routing": {"health": {"probe_path": "/health", "probe_interval_s": 0.1, **health}}}


def test_a_request_waits_for_a_probe_that_is_out(upstreams, gateways):
    fake = upstreams(health_delay=1.0)
    gw = gateways(probing(fake, probe_timeout_s=5))
    wait_for(lambda: fake.app.gets_open == 1, 10, "a probe to be out")
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
    assert response.status_code == 200
    assert fake.requests[-1].gets_open == 0  # the probe was answered before the request went


def test_no_probe_goes_out_while_a_stream_runs(upstreams, gateways):
    fake = upstreams(tokens=20, delay=0.05)
    gw = gateways(probing(fake))
    wait_for(lambda: len(fake.gets) >= 2, 10, "probes to start")
    during = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                during.append(len(fake.gets))
    assert len(during) == 21 and during[0] == during[-1], during
    assert fake.requests[-1].gets_open == 0
    wait_for(lambda: len(fake.gets) > during[-1], 10, "probes to go on after the stream")


def test_a_budget_is_a_deadline_for_a_stream_as_for_a_request(upstreams, gateways):
    """5 ms to an upstream that holds its headers for a second: 504 ``deadline_exceeded``
    whether the request streams or not (a stream once ignored it)."""
    fake = upstreams(headers_first=False, ttft=1.0)
    gw = gateways({"clusters": [cluster(fake)]})
    for stream in (False, True):
        response = httpx.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers={"x-latency-budget-ms": "5"}, timeout=10
        )
        assert response.status_code == 504, (stream, response.text)
        assert response.json()["error"]["code"] == "deadline_exceeded"


def test_without_a_budget_a_slow_answer_is_waited_for(upstreams, gateways):
    """No budget sent: ``default_budget_ms`` (2 s) guides routing but cancels nothing; an
    upstream that takes 2.5 s to answer is waited for, streaming or not."""
    fake = upstreams(headers_first=False, ttft=2.5, tokens=2)
    gw = gateways({"clusters": [cluster(fake)]})
    for stream in (False, True):
        response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
        assert response.status_code == 200, (stream, response.text)
        assert b"deadline_exceeded" not in response.content and b"tok1" in response.content


def test_the_websocket_handshake_carries_the_request_id(upstreams, gateways):
    fake = upstreams(tokens=2)
    gw = gateways({"clusters": [cluster(fake)]})
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers={"x-request-id": "my-socket-1"}) as ws:
        assert ws.response.headers["x-request-id"] == "my-socket-1"
        ws.send(orjson.dumps(CHAT).decode())
        assert ws_answer(ws)[-1]["type"] == "done"
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws") as ws:
        assert len(ws.response.headers["x-request-id"]) == 32  # one of its own


def test_probes_and_discovery_stay_out_of_the_log_and_each_request_names_both_ids(upstreams, gateway_processes):
    """``edgegw serve`` at its default log level: probes and discovery every 0.1 s leave no
    line; the access log names each WebSocket request by the socket's id and its number,
    beside the UUID its endpoint was sent."""
    fake = upstreams(tokens=2)
    gw = gateway_processes({
        "listen": {"access_log": True},
        "clusters": [{"name": "c", "discovery_interval_s": 0.1, "endpoints": [{"url": fake.url}]}],
        "routing": {"health": {"probe_path": "/health", "probe_interval_s": 0.1}},
    })  # fmt: skip
    wait_for(lambda: fake.gets.count("/health") >= 5 and fake.gets.count("/v1/models") >= 5, 20, "probes and discovery")
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers={"x-request-id": "sock-9"}) as ws:
        for _ in range(2):
            ws.send(orjson.dumps(CHAT).decode())
            assert ws_answer(ws)[-1]["type"] == "done"
    sent = [r.headers["x-request-id"] for r in fake.requests]
    assert [str(uuid.UUID(s)) for s in sent] == sent and len(set(sent)) == 2
    wait_for(lambda: sum("upstream_id=" in line for line in gw.log.read_text().splitlines()) >= 2, 10, "the access log")
    log = gw.log.read_text()
    assert "GET /health" not in log and "/v1/models" not in log and "HTTP Request" not in log, log
    lines = [line for line in log.splitlines() if "upstream_id=" in line]
    assert any(f"sock-9 ws 200" in line and f"upstream_id={sent[0]}" in line for line in lines), lines
    assert any(f"sock-9.2 ws 200" in line and f"upstream_id={sent[1]}" in line for line in lines), lines



def test_fast_failures_do_not_make_an_endpoint_look_fast(upstreams, gateways):
    """Twenty 500s answered at once (llama.cpp's server's answer to a malformed request)
    beside three good answers that take 0.3 s to their first byte: the latency view's TTFT is
    the good answers' alone, and the endpoint is not called network-bound."""
    fake = upstreams(ttft=0.3, tokens=2)
    gw = gateways({"clusters": [cluster(fake)]})
    for _ in range(20):
        bad = {**CHAT, "fake": {"status": 500, "ttft": 0.0, "error_body": "Traceback (most recent call last): ..."}}
        assert httpx.post(gw.url + "/v1/chat/completions", json=bad).status_code == 500
    for _ in range(3):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    view = next(t for t in httpx.get(gw.url + "/debug/latency").json()["targets"] if t["name"] == fake.url)
    assert view["requests"] == 23
    assert view["ttft_ms"]["p50"] >= 300, view["ttft_ms"]
    assert view["diagnosis"]["verdict"] != "network_bound", view["diagnosis"]


def test_a_hedge_starts_on_time_while_the_primary_holds_its_headers(upstreams, gateways, geo_db):
    """The primary holds its response headers until its first token (5 s; servers that
    queue do): the hedge still goes at its time (half the 300 ms budget) and wins; the
    primary's request is cancelled."""
    slow, hedge = upstreams(ttft=5.0, headers_first=False), upstreams()
    config = two_regions(geo_db, [slow.url], [hedge.url], hedging={"enabled": True, "budget_fraction": 0.5, "min_delay_ms": 0})
    gw = gateways(config)
    r = post(gw, US_CLIENT, stream=True, headers={"x-latency-budget-ms": "300"})
    assert r.status_code == 200 and "data: [DONE]" in r.text and '"error"' not in r.text
    assert "edgegw_hedge_wins_total 1.0" in httpx.get(gw.url + "/metrics").text
    assert len(hedge.requests) == 1 and hedge.requests[0].finished
    assert slow.requests[0].disconnected.wait(10), "the slow primary's request was cancelled"
    assert not slow.requests[0].finished


def test_probes_leave_nothing_to_the_garbage_collector(upstreams, gateways):
    """httpx binds each response to its stream (a reference cycle) and the probe's pooled
    response hangs under it: every probe and discovery left its objects to the collector
    (seen by the HTTP/1.1 listener's no-cycle test on a busy machine, where probes fell into
    its window). The gateway lets go of the stream once the body is read."""
    import gc

    fake = upstreams()
    gateways(probing(fake))
    wait_for(lambda: len(fake.gets) >= 2, 10, "probes to start")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        seen = len(fake.gets)
        wait_for(lambda: len(fake.gets) >= seen + 5, 10, "five more probes")
        time.sleep(0.05)  # the last one's answer read
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("gateway.")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours, ours
