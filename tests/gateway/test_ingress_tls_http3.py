"""The gateway's HTTPS (HTTP/1.1 + HTTP/2) and HTTP/3 listeners: relays, Alt-Svc, and the
slow-client and disconnect properties of test_cancellation.py, over HTTP/2 and HTTP/3;
then two gateways talking HTTP/3 to each other."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
import time

import httpx
import orjson
import psutil
import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import cluster
from tests.fakes import free_port
from tests.fakes_h3 import client_pool, fetch, free_udp_port, ingress_gateways  # noqa: F401 (fixtures)
from tests.gateway.test_cancellation import raw_request, wait_for
from tests.waiting import wait_until

INGRESS = [pytest.param("h2", id="http2"), pytest.param("h3", id="http3")]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "fake-model", "prompt": "hello"}


def listener_port(gw, kind: str) -> int:
    return gw.tls_port if kind == "h2" else gw.h3_port


async def async_wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def read_events(response, count: int) -> bytes:
    data = b""
    while data.count(b"data:") < count:
        chunk = await response.body.read(10)
        assert chunk, "the stream ended early"
        data += chunk
    return data


@pytest.mark.parametrize("kind", INGRESS)
@pytest.mark.parametrize(
    "path,body",
    [
        pytest.param("/v1/chat/completions", CHAT, id="chat"),
        pytest.param("/v1/completions", COMPLETION, id="completion"),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="sse")])
async def test_relay_over_ingress_is_byte_faithful(upstreams, ingress_gateways, certificate, kind, path, body, stream):
    fake = upstreams()
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    body = {**body, "stream": stream, "stream_options": {"include_usage": True}} if stream else body
    async with httpx.AsyncClient() as client:
        direct = (await client.post(fake.url + path, json=body)).content
    pool = client_pool(kind, listener_port(gw, kind), certificate[0])
    try:
        status, headers, relayed = await fetch(pool, path, orjson.dumps(body), [(b"x-request-id", b"req-42")])
    finally:
        await pool.aclose()
    assert status == 200
    assert relayed == direct
    fields = dict(headers)
    assert fields[b"x-request-id"] == b"req-42"
    assert (b"alt-svc" in fields) == (kind == "h2")  # advertised on HTTPS, not over HTTP/3 itself
    assert fake.requests[-1].body == body
    assert fake.requests[-1].headers["x-request-id"] != "req-42"  # the endpoint gets a UUID of its own


def test_https_listener_speaks_http1_and_http2_and_advertises_http3(upstreams, ingress_gateways, certificate):
    fake = upstreams()
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    alt_svc = f'h3=":{gw.h3_port}"; ma=86400'
    for http2 in (False, True):
        with httpx.Client(http2=http2, verify=certificate[0]) as client:
            response = client.post(gw.https_url + "/v1/chat/completions", json={**CHAT, "stream": True})
            assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")
            assert response.headers["alt-svc"] == alt_svc
            assert client.get(gw.https_url + "/healthz").headers["alt-svc"] == alt_svc
    plain = httpx.get(gw.url + "/healthz")  # the plain listener is unchanged, no Alt-Svc for http://
    assert plain.status_code == 200 and "alt-svc" not in plain.headers


def test_websocket_over_the_https_listener(upstreams, ingress_gateways, certificate):
    """A client without ALPN (this WebSocket client offers none) gets HTTP/1.1, upgrades included."""
    fake = upstreams(tokens=3)
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    context = ssl.create_default_context(cafile=certificate[0])
    with ws_connect(gw.https_url.replace("https", "wss") + "/v1/ws", ssl=context) as ws:
        ws.send(orjson.dumps(CHAT).decode())
        messages = []
        while (message := orjson.loads(ws.recv(timeout=5))).get("type") != "done":
            messages.append(message)
    assert "".join(m["choices"][0]["delta"].get("content", "") for m in messages if m["choices"]) == "tok0 tok1 tok2 "


@pytest.mark.parametrize("kind", INGRESS)
async def test_errors_and_small_endpoints_over_ingress(upstreams, ingress_gateways, certificate, kind):
    fake = upstreams()
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    pool = client_pool(kind, listener_port(gw, kind), certificate[0])
    try:
        status, _, body = await fetch(pool, "/v1/models", b"")
        assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == ["auto", "fake-model"]
        status, _, body = await fetch(pool, "/v1/chat/completions", orjson.dumps({**CHAT, "model": "nope"}))
        assert status == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"
        status, _, body = await fetch(pool, "/v1/chat/completions", b"{broken")
        assert status == 400
        status, _, _ = await fetch(pool, "/nowhere", b"")
        assert status == 404
    finally:
        await pool.aclose()


@pytest.mark.parametrize("kind", INGRESS)
async def test_client_reset_mid_stream_closes_the_upstream_request(upstreams, ingress_gateways, certificate, kind):
    fake = upstreams(tokens=200, delay=0.02)
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    pool = client_pool(kind, listener_port(gw, kind), certificate[0])
    try:
        response = await pool.request(b"POST", b"/v1/chat/completions", [], orjson.dumps({**CHAT, "stream": True}))
        await read_events(response, 3)
        response.close()  # RST_STREAM(CANCEL) / RESET_STREAM + STOP_SENDING
        seen = fake.requests[-1]
        assert await async_wait_for(seen.disconnected.is_set, 3), "the upstream never saw the request closed"
        await asyncio.sleep(0.1)
        sent = seen.chunks_sent
        await asyncio.sleep(0.3)
        assert seen.chunks_sent == sent < 200
        assert not seen.finished
        assert await async_wait_for(lambda: gw.state.gate.in_flight == 0)
        # the connection itself carries on
        status, _, _ = await fetch(pool, "/v1/chat/completions", orjson.dumps({**CHAT, "fake": {"delay": 0}}))
        assert status == 200 and pool.num_connections == 1
    finally:
        await pool.aclose()


@pytest.mark.parametrize("kind", INGRESS)
async def test_client_gone_before_first_byte_cancels_the_upstream(upstreams, ingress_gateways, certificate, kind):
    fake = upstreams(ttft=30, headers_first=False)
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    pool = client_pool(kind, listener_port(gw, kind), certificate[0])
    task = asyncio.create_task(
        pool.request(b"POST", b"/v1/chat/completions", [], orjson.dumps({**CHAT, "stream": True}))
    )
    try:
        assert await async_wait_for(lambda: len(fake.requests) == 1)
        task.cancel()  # the pool resets the stream
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await async_wait_for(fake.requests[0].disconnected.is_set, 3)
        assert await async_wait_for(lambda: gw.state.gate.in_flight == 0)
    finally:
        await pool.aclose()


@pytest.mark.parametrize("kind", INGRESS)
async def test_connection_lost_cancels_every_stream(upstreams, ingress_gateways, certificate, kind):
    fake = upstreams(tokens=300, delay=0.02)
    gw = ingress_gateways({"clusters": [cluster(fake)]})
    pool = client_pool(kind, listener_port(gw, kind), certificate[0])
    body = orjson.dumps({**CHAT, "stream": True})
    responses = await asyncio.gather(*[pool.request(b"POST", b"/v1/chat/completions", [], body) for _ in range(4)])
    for response in responses:
        await read_events(response, 2)
    await pool.aclose()  # the whole connection goes (h2: GOAWAY + FIN; h3: CONNECTION_CLOSE)
    assert await async_wait_for(lambda: all(r.disconnected.is_set() for r in fake.requests), 3)
    assert all(not r.finished for r in fake.requests)
    assert await async_wait_for(lambda: gw.state.gate.in_flight == 0)


@pytest.mark.parametrize("kind", INGRESS)
async def test_slow_client_stalls_the_upstream_and_bounds_gateway_memory(
    upstreams, gateway_processes, certificate, kind
):
    """The upstream offers 320 MB as fast as it can; the client (a pool that is never read,
    so it gives back no flow-control credit) reads nothing. The gateway's writes must block,
    the upstream must stall, and the gateway process must not grow."""
    fake = upstreams(tokens=20_000, pad=16 * 1024)
    certfile = certificate[0]
    gw, tls_port, h3_port = start_with_listeners(gateway_processes, {"clusters": [cluster(fake)]}, certificate)
    process = psutil.Process(gw.proc.pid)
    pool = client_pool(kind, tls_port if kind == "h2" else h3_port, certfile, high_water=64 * 1024)
    try:
        status, _, _ = await fetch(pool, "/v1/chat/completions", orjson.dumps({**CHAT, "fake": {"tokens": 1}}))
        assert status == 200
        rss_before = process.memory_info().rss
        response = await pool.request(b"POST", b"/v1/chat/completions", [], orjson.dumps({**CHAT, "stream": True}))
        assert await async_wait_for(lambda: fake.requests[-1].bytes_sent > 0)
        seen = fake.requests[-1]
        previous = -1
        deadline = time.monotonic() + 30
        while seen.bytes_sent != previous and time.monotonic() < deadline:
            previous = seen.bytes_sent
            await asyncio.sleep(1.0)
        total = 20_000 * (16 * 1024 + 100)
        assert seen.bytes_sent == previous, "the upstream writer never stalled"
        assert seen.bytes_sent < total / 3
        growth = process.memory_info().rss - rss_before
        assert growth < 48 * 1024 * 1024, f"gateway grew by {growth / 1e6:.1f} MB"
        got = 0
        while got < 4 * 1024 * 1024:  # reading again resumes the stream
            chunk = await response.body.read(10)
            assert chunk
            got += len(chunk)
        assert await async_wait_for(lambda: seen.bytes_sent > previous)
        response.close()
        assert await async_wait_for(seen.disconnected.is_set, 5)
    finally:
        await pool.aclose()


@pytest.mark.parametrize("kind", INGRESS)
async def test_sigterm_drains_a_live_stream_over_ingress(upstreams, gateway_processes, certificate, kind):
    fake = upstreams(tokens=40, delay=0.05)
    certfile = certificate[0]
    config = {"clusters": [cluster(fake)], "limits": {"drain_timeout_s": 20}}
    gw, tls_port, h3_port = start_with_listeners(gateway_processes, config, certificate)
    pool = client_pool(kind, tls_port if kind == "h2" else h3_port, certfile)
    try:
        response = await pool.request(b"POST", b"/v1/chat/completions", [], orjson.dumps({**CHAT, "stream": True}))
        data = await read_events(response, 2)
        gw.proc.send_signal(signal.SIGTERM)
        data += await response.body.read_all(30, 1 << 24)
        assert data.endswith(b"data: [DONE]\n\n")
        assert data.count(b'"content":"tok') == 40
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0
    finally:
        await pool.aclose()


def test_gateway_to_gateway_over_http3(upstreams, gateways, ingress_gateways, certificate):
    """edge edgegw --HTTP/3--> central edgegw (listen.http3) --HTTP/1.1--> inference server;
    a client that leaves the edge cancels the request at the inference server."""
    fake = upstreams(tokens=200, delay=0.02)
    central = ingress_gateways({"clusters": [cluster(fake)]})
    central_endpoint = {"url": central.h3_url, "protocol": "http3", "ca_file": certificate[0]}
    edge = gateways({"clusters": [{"name": "central", "models": ["fake-model"], "endpoints": [central_endpoint]}]})
    for stream in (False, True):
        body = {**CHAT, "stream": stream, "fake": {"tokens": 8, "delay": 0}}
        through_both = httpx.post(edge.url + "/v1/chat/completions", json=body)
        assert through_both.status_code == 200
        assert through_both.content == httpx.post(fake.url + "/v1/chat/completions", json=body).content
        assert 'desc="http3"' in through_both.headers["server-timing"]
    pool = edge.state.fleet.upstreams[central.h3_url].pool
    assert pool.protocol == "http3" and pool.num_connections == 1
    sock = raw_request(edge.url, {**CHAT, "stream": True})
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(65536)
    sock.close()
    seen = fake.requests[-1]
    assert wait_for(seen.disconnected.is_set, 3), "the inference server never saw the request cancelled"
    time.sleep(0.1)
    sent = seen.chunks_sent
    time.sleep(0.3)
    assert seen.chunks_sent == sent < 200
    assert wait_for(lambda: edge.state.gate.in_flight == 0 and central.state.gate.in_flight == 0)


def start_with_listeners(gateway_processes, config: dict, certificate: tuple[str, str]):
    """A gateway process with ``listen.tls`` and ``listen.http3`` on free ports: (gateway,
    tls port, http3 port). A port found free can be taken before the gateway binds it (the
    machine is shared): then the gateway exits at start-up, and it is tried on others.

    The process answers ``/healthz`` on its plain port before it has bound these two (they
    are opened after uvicorn's own start-up): it is handed back once its log says that the
    HTTP/3 listener, the last one opened, is up."""
    certfile, keyfile = certificate
    for attempt in range(3):
        tls_port, h3_port = free_port(), free_udp_port()
        listen = {
            "tls": {"port": tls_port, "certfile": certfile, "keyfile": keyfile},
            "http3": {"port": h3_port, "certfile": certfile, "keyfile": keyfile},
        }
        try:
            gw = gateway_processes({**config, "listen": listen})
            wait_until(lambda: _listeners_opened(gw, h3_port), 30, "the gateway's HTTPS and HTTP/3 listeners")
            return gw, tls_port, h3_port
        except RuntimeError as exc:
            if "address already in use" not in str(exc).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _listeners_opened(gw, h3_port: int) -> bool:
    """Its log says the HTTP/3 listener is up; ``RuntimeError`` with the log if it exited
    (a port taken before it bound it: ``address already in use``)."""
    log = gw.log.read_text(errors="replace")
    if f"HTTP/3 on udp://127.0.0.1:{h3_port}" in log:
        return True
    if gw.proc.poll() is not None:
        raise RuntimeError(f"gateway exited: {log}")
    return False


def test_readyz_says_ready_only_once_the_https_and_http3_listeners_are_open(upstreams, gateway_processes, certificate):
    """The plain port answers before the TLS and HTTP/3 ports are opened (after uvicorn's
    own start-up): ``/readyz`` says 503 until they are, so that a load balancer (or a test)
    that waits for it finds every listener open."""
    fake = upstreams()
    certfile, keyfile = certificate
    tls_port, h3_port = free_port(), free_udp_port()
    listen = {
        "tls": {"port": tls_port, "certfile": certfile, "keyfile": keyfile},
        "http3": {"port": h3_port, "certfile": certfile, "keyfile": keyfile},
    }
    gw = gateway_processes({"clusters": [cluster(fake)], "listen": listen})
    with httpx.Client(timeout=2) as client:
        wait_until(lambda: client.get(gw.url + "/readyz").status_code == 200, 30, "/readyz to say ready")
    with socket.create_connection(("127.0.0.1", tls_port), timeout=2):
        pass  # the HTTPS port accepts
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(OSError):  # the HTTP/3 port is bound (by the gateway, not reusable by others)
            probe.bind(("127.0.0.1", h3_port))
    finally:
        probe.close()
    assert f"HTTP/3 on udp://127.0.0.1:{h3_port}" in gw.log.read_text(errors="replace")
