"""What real inference servers do that the relay must survive, scripted on the fake upstream
(each script names the server behaviour it copies; tests/realworld/ runs the real servers):

- llama.cpp's server ends a generation another request interrupts with ``[DONE]`` and no
  ``finish_reason``, and answers a streamed prompt over its context with 200 and no event;
- it answers some requests with an empty body (a non-UUID ``x-request-id``: 400) or a
  traceback (a malformed ``logit_bias``: 500);
- it interrupts its running generation for any new request, discovery and probes included;
- servers that queue hold a stream's response headers until its first token.
"""

from __future__ import annotations

import socket

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from gateway.core.errors import RateLimited
from gateway.core.settings import quickstart_settings
from tests.conftest import cluster, ws_answer
from tests.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def sse(response: httpx.Response) -> list[bytes]:
    """The ``data`` payloads and comments of an SSE body, in order."""
    out = []
    for block in response.content.split(b"\n\n"):
        if block.startswith(b"data: "):
            out.append(block[6:])
        elif block.startswith(b":"):
            out.append(block)
    return out


def gauge(gw, name: str) -> float | None:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize(
    "done_after, code",
    [
        pytest.param(3, "upstream_stream_cut", id="cut-after-three-events"),
        pytest.param(0, "upstream_empty_stream", id="no-event-at-all"),
    ],
)
def test_a_stream_that_ends_before_it_finished_ends_with_an_error_event(upstreams, gateways, done_after, code):
    fake = upstreams(done_after=done_after)
    gw = gateways({"clusters": [cluster(fake)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    payloads = sse(response)
    assert payloads[-1] == b"[DONE]"
    error = orjson.loads(payloads[-2])["error"]
    assert error["code"] == code and error["message"]
    assert len(payloads) == done_after + 2  # the events that came, the error, [DONE]
    # the SDK raises instead of returning a truncated answer as if whole
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(**CHAT, stream=True):
            pass
    assert gauge(gw, "edgegw_upstream_errors_total") >= 1  # counted as broken


def test_a_whole_stream_is_relayed_as_it_came(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        body = response.read()
        assert response.headers.get_list("x-accel-buffering") == ["no"]  # the upstream's, once
    assert b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    "status, body, expect",
    [
        pytest.param(400, "", "the upstream answered 400 with no body", id="empty-400"),
        pytest.param(500, "Traceback (most recent call last):\n  KeyError: 'hello'", "the upstream answered 500: Traceback", id="traceback-500"),
        pytest.param(422, '{"detail": "bad"}', 'the upstream answered 422: {"detail": "bad"}', id="not-openai-json"),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="stream")])
def test_upstream_errors_of_any_shape_reach_the_client_openai_shaped(upstreams, gateways, status, body, expect, stream):
    fake = upstreams(status=status, error_body=body)
    gw = gateways({"clusters": [cluster(fake)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream})
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"].startswith(expect) and error["code"] == f"upstream_http_{status}"


def test_an_upstream_error_over_a_websocket_is_an_openai_error(upstreams, gateways):
    fake = upstreams(status=400, error_body="")
    gw = gateways({"clusters": [cluster(fake)]})
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws") as ws:
        ws.send(orjson.dumps(CHAT).decode())
        (message,) = ws_answer(ws)
    assert message["type"] == "error" and message["status"] == 400
    assert message["error"]["message"] == "the upstream answered 400 with no body"


def test_a_burst_of_500s_to_one_clients_mistakes_does_not_eject_the_endpoint(upstreams, gateways):
    """Twelve requests llama.cpp's server refuses with 500 (its answer to a malformed
    logit_bias), through an endpoint taking one request at a time: the breaker stays closed,
    no TTFT is measured from them, and the next good request is served (every slot came back)."""
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake, max_concurrency=1)], "routing": {"health": {"failure_threshold": 3}}})
    bad = {**CHAT, "fake": {"status": 500, "error_body": "Traceback (most recent call last): ..."}}
    for _ in range(12):
        assert httpx.post(gw.url + "/v1/chat/completions", json=bad).status_code == 500
    assert gauge(gw, "edgegw_endpoint_breaker_state") == 0
    assert gauge(gw, "edgegw_endpoint_ttft_ewma_seconds") is None
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_503s_and_broken_connections_still_eject_the_endpoint(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "routing": {"health": {"failure_threshold": 3}}})
    for _ in range(3):
        assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "fake": {"status": 503}}).status_code == 503
    assert gauge(gw, "edgegw_endpoint_breaker_state") == 2  # open


def test_pool_timeouts_are_this_sides_and_say_so(upstreams, gateways):
    """One connection, held by a request that never ends: the others get 503
    ``upstream_pool_timeout`` and the endpoint, which did nothing wrong, is not ejected."""
    fake = upstreams()
    gw = gateways({
        "clusters": [cluster(fake, pool_size=1, warm_connections=1, pool_timeout_s=0.2)],
        "routing": {"health": {"failure_threshold": 2}, "hedging": {"enabled": False}},
    })  # fmt: skip
    # held on a socket of the test's own, closed at the end (the request is cancelled with it,
    # so the gateway stops at once instead of draining it)
    body = orjson.dumps({**CHAT, "fake": {"hang": True}})
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as held:
        held.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(lambda: fake.requests, what="the held request to reach the upstream")
        for _ in range(4):
            response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_pool_timeout"
        assert gauge(gw, "edgegw_endpoint_breaker_state") == 0


def test_keepalives_start_before_the_upstream_sends_its_headers(upstreams, gateways):
    """A server that holds a stream's headers until its first token (3 s here) behind a
    client whose keep-alive interval is 0.2 s: the client gets 200 and ``: ping`` comments
    meanwhile, then the whole answer."""
    fake = upstreams(headers_first=False, ttft=3.0)
    gw = gateways({"clusters": [cluster(fake)], "limits": {"keepalive_interval_s": 0.2}})
    lines = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                lines.append(line)
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert first_data > 0 and all(line == ": ping" for line in lines[:first_data]), lines[:first_data + 1]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"stop"' in "".join(lines)


def test_an_error_after_the_head_went_out_is_an_error_event(upstreams, gateways):
    fake = upstreams(ttft=3.0, status=503)
    gw = gateways({"clusters": [cluster(fake)], "limits": {"keepalive_interval_s": 0.2}})
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
    assert response.status_code == 200  # the head went out before the upstream answered
    payloads = sse(response)
    assert payloads[0] == b": ping" and payloads[-1] == b"[DONE]"
    assert orjson.loads(payloads[-2])["error"]["message"] == "scripted 503"


def test_discovery_never_asks_an_endpoint_with_a_request_in_flight(upstreams, gateways):
    """llama.cpp's server cuts its running generation for any new request: while a stream is
    in flight, the gateway's discovery (every 0.1 s here) leaves that endpoint alone."""
    fake = upstreams(tokens=30, delay=0.05)
    gw = gateways({"clusters": [{"name": "c", "discovery_interval_s": 0.1, "endpoints": [{"url": fake.url}]}]})
    wait_until(lambda: "fake-model" in {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}, what="discovery")
    seen = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen.append(len(fake.gets))
    assert len(seen) == 31 and seen[0] == seen[-1], seen  # no GET /v1/models while it streamed
    # and discovery goes on once it ended (its next turn is at most interval + 1 s away)
    wait_until(lambda: len(fake.gets) > seen[-1], what="discovery's next turn")


def test_retry_after_is_rounded_up():
    """A client that waits the Retry-After it was told is not refused again (the openai SDK
    honours it): 2.3 s says 3."""
    assert RateLimited("x", retry_after=2.3).headers() == [(b"retry-after", b"3")]
    assert RateLimited("x", retry_after=2.0).headers() == [(b"retry-after", b"2")]
    assert RateLimited("x", retry_after=0.2).headers() == [(b"retry-after", b"1")]


def test_the_quick_start_caches():
    assert quickstart_settings(["http://127.0.0.1:9/v1"]).cache.backend == "memory"
    assert quickstart_settings(["http://127.0.0.1:9/v1"], cache="off").cache.backend == "off"
