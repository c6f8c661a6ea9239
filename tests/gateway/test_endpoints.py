"""The OpenAI surface's own behaviour: the WebSocket endpoint is admitted, counted and
forwarded like HTTP requests, and never drops a message."""

from __future__ import annotations

import time

import httpx
import orjson
from websockets.sync.client import connect as ws_connect

from tests.conftest import cluster, ws_answer

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def metric(gw, name: str) -> str:
    return "\n".join(line for line in httpx.get(gw.url + "/metrics").text.splitlines() if line.startswith(name))


def test_websocket_requests_are_counted_in_flight_and_keep_the_clients_ids(upstreams, gateways):
    fake = upstreams(tokens=20, delay=0.05)
    gw = gateways({"clusters": [cluster(fake)]})
    headers = {"x-request-id": "client-id-7", "traceparent": TRACEPARENT, "openai-project": "p1"}
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers=headers) as ws:
        ws.send(orjson.dumps(CHAT).decode())
        orjson.loads(ws.recv(timeout=10))  # the first chunk: the request is in flight now
        assert "edgegw_in_flight_requests 1.0" in metric(gw, "edgegw_in_flight_requests")
        assert ws_answer(ws)[-1]["type"] == "done"
        ws.send(orjson.dumps(CHAT).decode())
        assert ws_answer(ws)[-1]["type"] == "done"
    first, second = fake.requests
    # one id per request on the socket, each the endpoint's own UUID (the client's are logged beside)
    assert len({first.headers["x-request-id"], second.headers["x-request-id"], "client-id-7"}) == 3
    assert first.headers["traceparent"] == TRACEPARENT and first.headers["openai-project"] == "p1"
    assert "sec-websocket-key" not in first.headers and "upgrade" not in first.headers
    assert 'edgegw_requests_total{api="ws",status="200",tenant="anonymous"} 2.0' in metric(gw, "edgegw_requests_total")
    assert "edgegw_in_flight_requests 0.0" in metric(gw, "edgegw_in_flight_requests")


def test_websocket_messages_sent_ahead_are_all_answered(upstreams, gateways):
    fake = upstreams(tokens=2)
    gw = gateways({"clusters": [cluster(fake)]})
    count = 60  # more than the read-ahead queue: the rest wait in the socket (backpressure)
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws") as ws:
        for i in range(count):
            ws.send(orjson.dumps({**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}).decode())
        ends = [ws_answer(ws)[-1]["type"] for _ in range(count)]
    assert ends == ["done"] * count
    assert [r.body["messages"][0]["content"] for r in fake.requests] == [f"q{i}" for i in range(count)]


def test_websocket_over_the_in_flight_limit_gets_an_error_message(upstreams, gateways):
    fake = upstreams(tokens=50, delay=0.05)
    gw = gateways({"clusters": [cluster(fake)], "limits": {"max_in_flight": 1}})
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws") as ws:
        ws.send(orjson.dumps({**CHAT, "stream": True}).decode())
        ws.recv(timeout=10)
        busy = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    deadline = time.monotonic() + 5
    while gw.state.gate.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.state.gate.in_flight == 0
