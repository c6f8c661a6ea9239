"""The HTTP/3 upstream pool over real UDP sockets on 127.0.0.1: relays, multiplexing,
cancellation, backpressure, restarts, resumption and 0-RTT, the HTTP/2 fallback."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
import pytest

from gateway.core.settings import EndpointSettings
from gateway.upstream import FallbackPool, H3Pool, Origin, Timeouts
from tests.conftest import cluster
from tests.fakes_h3 import FakeH3Upstream, client_pool, fetch, h3_upstreams  # noqa: F401 (fixtures)
from tests.gateway.test_cancellation import (
    assert_a_disconnect_before_the_first_byte_cancels_the_upstream,
    assert_a_disconnect_mid_stream_stops_the_upstream,
    assert_a_slow_client_stalls_the_upstream,
)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "fake-model", "prompt": "hello"}


def h3_cluster(fake: FakeH3Upstream, **endpoint) -> dict:
    return cluster(fake, ca_file=fake.tls[0], **endpoint)


def direct(fake: FakeH3Upstream, path: str, body: dict) -> bytes:
    """The fake's own answer, fetched over HTTP/3 without the gateway."""

    async def get() -> bytes:
        pool = client_pool("h3", fake.port, fake.tls[0])
        try:
            status, _, data = await fetch(pool, path, orjson.dumps(body))
        finally:
            await pool.aclose()
        assert status == 200
        return data

    return asyncio.run(get())


def server_timing(response: httpx.Response) -> dict[str, str]:
    return {part.split(";")[0]: part for part in response.headers["server-timing"].split(", ")}


@pytest.mark.parametrize(
    "path,body",
    [
        pytest.param("/v1/chat/completions", CHAT, id="chat"),
        pytest.param("/v1/completions", COMPLETION, id="completion"),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="sse")])
def test_relay_over_http3_is_byte_faithful(h3_upstreams, gateways, path, body, stream):
    fake = h3_upstreams()
    gw = gateways({"clusters": [h3_cluster(fake)]})
    body = {**body, "stream": stream, "stream_options": {"include_usage": True}} if stream else body
    relayed = httpx.post(gw.url + path, json=body)
    assert relayed.status_code == 200
    assert relayed.content == direct(fake, path, body)
    if stream:
        assert relayed.content.endswith(b"data: [DONE]\n\n")
        assert relayed.headers["content-type"].startswith("text/event-stream")
    assert fake.requests[-1].body == body
    pool = gw.state.fleet.upstreams[fake.url].pool
    assert pool.protocol == "http3" and pool.num_connections == 1


def test_server_timing_and_metrics_name_http3(h3_upstreams, gateways):
    fake = h3_upstreams()
    gw = gateways({"clusters": [h3_cluster(fake)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    assert 'desc="http3"' in server_timing(response)["pool"]
    metrics = httpx.get(gw.url + "/metrics").text
    assert f'edgegw_upstream_requests_total{{protocol="http3",upstream="{fake.url}"}} 1.0' in metrics


async def test_32_concurrent_streams_share_one_quic_connection(h3_upstreams, gateways):
    fake = h3_upstreams(tokens=10, delay=0.1)
    gw = gateways({"clusters": [h3_cluster(fake)]})
    pool = gw.state.fleet.upstreams[fake.url].pool
    assert pool.num_connections == 1  # warmed at start-up
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, pool.num_streams)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        responses = await asyncio.gather(
            *[client.post("/v1/chat/completions", json={**CHAT, "stream": True}) for _ in range(32)]
        )
    watcher.cancel()
    expected = "".join(f"tok{i} " for i in range(10))
    for response in responses:
        assert response.status_code == 200
        text = "".join(
            (orjson.loads(e[6:])["choices"][0]["delta"].get("content") or "")
            for e in response.content.split(b"\n\n")
            if e.startswith(b"data: {")
        )
        assert text == expected
    assert most >= 32, f"at most {most} streams were open at once"  # (+1 when a health probe overlaps)
    assert pool.num_connections == 1 and pool.handshakes == 1
    assert len(fake.requests) == 32


def test_certificate_is_verified_by_default(h3_upstreams, gateways):
    fake = h3_upstreams()
    gw = gateways({"clusters": [cluster(fake, warm_connections=0)]})  # no ca_file: certifi's roots
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 503
    assert "certificate" in response.json()["error"]["message"].lower()
    assert not fake.requests


def test_verify_false_accepts_the_certificate(h3_upstreams, gateways):
    fake = h3_upstreams()
    gw = gateways({"clusters": [cluster(fake, verify=False)]})
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("early_data", [pytest.param(False, id="1rtt"), pytest.param(True, id="0rtt")])
async def test_a_new_connection_resumes_and_sends_early_data_only_when_asked(h3_upstreams, early_data):
    fake = h3_upstreams()
    pool = client_pool("h3", fake.port, fake.tls[0], early_data=early_data)
    body = orjson.dumps({**CHAT, "stream": True})
    try:
        first = await fetch(pool, "/v1/chat/completions", body)
        assert pool.handshakes == 1 and pool.resumed == 0
        for conn in list(pool._conns):  # as an idle timeout would
            conn.close()
        await asyncio.sleep(0.05)
        assert pool.num_connections == 0
        second = await fetch(pool, "/v1/chat/completions", body)
        assert second == first
        assert pool.handshakes == 2 and pool.resumed == 1
        (conn,) = pool._conns
        # aioquic offers 0-RTT on every resumption; what matters is whether the request used it
        assert conn.sent_early == (1 if early_data else 0)
        assert conn.early_data_accepted
        assert [r.body for r in fake.requests] == [{**CHAT, "stream": True}] * 2
    finally:
        await pool.aclose()


def test_client_disconnect_mid_stream_resets_the_upstream_stream(h3_upstreams, gateways):
    fake = h3_upstreams(tokens=200, delay=0.02)
    gw = gateways({"clusters": [h3_cluster(fake)]})
    assert_a_disconnect_mid_stream_stops_the_upstream(gw, fake)
    pool = gw.state.fleet.upstreams[fake.url].pool
    assert pool.num_streams == 0 and pool.num_connections == 1  # the connection stays
    assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "fake": {"delay": 0}}).status_code == 200


def test_client_disconnect_before_first_byte_resets_the_upstream_stream(h3_upstreams, gateways):
    fake = h3_upstreams(ttft=30, headers_first=False)
    assert_a_disconnect_before_the_first_byte_cancels_the_upstream(gateways({"clusters": [h3_cluster(fake)]}), fake)


def test_slow_client_stalls_the_http3_upstream_and_bounds_gateway_memory(h3_upstreams, gateway_processes):
    """The upstream offers 320 MB over QUIC as fast as it can; the client reads nothing. The
    gateway's pool must stop extending stream credit, so the upstream stalls, and the gateway
    process must not grow."""
    fake = h3_upstreams(tokens=20_000, pad=16 * 1024)
    assert_a_slow_client_stalls_the_upstream(gateway_processes({"clusters": [h3_cluster(fake)]}), fake)


@pytest.mark.parametrize(
    "graceful",
    [
        pytest.param(True, id="restart"),  # the server says CONNECTION_CLOSE
        pytest.param(False, id="crash"),  # silence: the pool finds the connection dead
    ],
)
def test_pool_survives_a_server_restart(h3_upstreams, gateways, graceful):
    fake = h3_upstreams()
    gw = gateways({"clusters": [h3_cluster(fake, connect_timeout_s=0.5)]})
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    port = fake.port
    fake.stop(graceful=graceful)
    again = h3_upstreams(port=port)
    started = time.monotonic()
    for stream in (False, True, False):
        response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
        assert response.status_code == 200, response.text
        assert b"error" not in response.content
    assert time.monotonic() - started < 10
    assert len(again.requests) == 3
    pool = gw.state.fleet.upstreams[fake.url].pool
    assert pool.num_connections == 1 and pool.handshakes >= 2


@pytest.mark.parametrize(
    "udp",
    [
        pytest.param("blackhole", id="udp-dropped"),  # a firewall: nothing ever comes back
        pytest.param("closed", id="udp-refused"),  # nothing listens: ICMP port unreachable
    ],
)
def test_fallback_to_http2_when_quic_cannot_be_established(upstreams, gateways, certificate, udp):
    fake = upstreams("http2", tls=certificate)  # HTTP/2 over TLS on the TCP port only
    hole = None
    if udp == "blackhole":
        hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        hole.bind(("127.0.0.1", fake.port))
    try:
        endpoint = {"protocol": "http3", "fallback": "http2", "fallback_after_s": 0.3, "ca_file": certificate[0]}
        started = time.monotonic()
        gw = gateways({"clusters": [cluster(fake, **endpoint)]})
        assert time.monotonic() - started < 10
        pool = gw.state.fleet.upstreams[fake.url].pool
        assert isinstance(pool, FallbackPool) and pool.using_fallback
        for stream in (False, True):
            body = {**CHAT, "stream": stream}
            response = httpx.post(gw.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert response.content == httpx.post(fake.url + "/v1/chat/completions", json=body, verify=certificate[0]).content
            assert 'desc="http2"' in server_timing(response)["pool"]
        metrics = httpx.get(gw.url + "/metrics").text
        assert f'edgegw_upstream_requests_total{{protocol="http2",upstream="{fake.url}"}} 2.0' in metrics
        assert 'protocol="http3"' not in metrics
    finally:
        if hole is not None:
            hole.close()


async def test_fallback_goes_back_to_quic_once_it_answers(upstreams, h3_upstreams, certificate):
    fake = upstreams("http2", tls=certificate)
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hole.bind(("127.0.0.1", fake.port))
    quic = client_pool("h3", fake.port, certificate[0], connect=0.3)
    pool = FallbackPool(quic, client_pool("h2", fake.port, certificate[0]), retry_s=0.2)
    body = orjson.dumps(CHAT)
    try:
        assert (await pool.request(b"POST", b"/v1/chat/completions", [], body)).protocol == "http2"
        assert pool.using_fallback
        hole.close()
        h3_upstreams(port=fake.port)  # QUIC answers on the same port now
        for _ in range(50):
            if not pool.using_fallback:
                break
            await asyncio.sleep(0.1)
        response = await pool.request(b"POST", b"/v1/chat/completions", [], body)
        assert response.protocol == "http3"
        assert orjson.loads(await response.body.read_all(5, 1 << 20))["choices"][0]["message"]["content"]
    finally:
        hole.close()
        await pool.aclose()


def test_endpoint_settings_for_http3():
    with pytest.raises(ValueError, match="https"):
        EndpointSettings(url="http://127.0.0.1:1", protocol="http3")
    with pytest.raises(ValueError, match="fallback"):
        EndpointSettings(url="https://127.0.0.1:1", protocol="http2", fallback="http2")
    with pytest.raises(ValueError, match="early_data"):
        EndpointSettings(url="https://127.0.0.1:1", protocol="http1", early_data=True)
    endpoint = EndpointSettings.model_validate({"url": "https://127.0.0.1:1", "protocol": "http3", "verify": False})
    assert endpoint.verify_tls is False and endpoint.early_data is False and endpoint.fallback is None


async def test_http3_needs_an_https_origin():
    with pytest.raises(ValueError, match="https"):
        H3Pool(
            Origin("127.0.0.1", 1, None, b"127.0.0.1:1", b"http"),
            max_connections=1,
            warm_connections=0,
            timeouts=Timeouts(1, 1, 1, 1),
            high_water=4096,
        )
