"""The relay end to end: real fake upstreams (HTTP/1.1 and HTTP/2), a real gateway, real sockets."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import httpx
import openai
import orjson
import pytest

from gateway.core.errors import UpstreamProtocolError, UpstreamReadTimeout
from gateway.core.sse import DONE, EventReader, sse_event, sse_events, sse_payloads
from gateway.relay import Meter, Splice
from gateway.upstream.body import Body
from tests.conftest import cluster
from tests.waiting import wait_until

PROTOCOLS = [pytest.param("http1", id="http1"), pytest.param("http2", id="http2")]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
COMPLETION = {"model": "fake-model", "prompt": "hello"}


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(params=PROTOCOLS)
def setup(request, upstreams, gateways):
    fake = upstreams(request.param)
    gw = gateways({"clusters": [cluster(fake)]})
    return fake, gw


@pytest.mark.parametrize(
    "path,body",
    [
        pytest.param("/v1/chat/completions", CHAT, id="chat"),
        pytest.param("/v1/completions", COMPLETION, id="completion"),
    ],
)
@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="sse")])
def test_relay_is_byte_faithful(setup, path, body, stream):
    fake, gw = setup
    body = {**body, "stream": stream, "stream_options": {"include_usage": True}} if stream else body
    direct = httpx.post(fake.url + path, json=body)
    relayed = httpx.post(gw.url + path, json=body)
    assert relayed.status_code == 200
    assert relayed.content == direct.content
    if stream:
        assert relayed.content.endswith(b"data: [DONE]\n\n")
        assert b'"usage"' in relayed.content
        assert relayed.headers["content-type"].startswith("text/event-stream")
    # the upstream got the client's bytes unchanged
    assert fake.requests[-1].body == body


def test_request_id_and_server_timing(setup):
    fake, gw = setup
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    # the endpoint gets a UUID of its own (llama.cpp's server refuses any other form)
    sent = fake.requests[-1].headers["x-request-id"]
    assert str(uuid.UUID(sent)) == sent
    stages = dict(part.split(";", 1)[0:2] for part in response.headers["server-timing"].split(", "))
    assert {"admit", "pool", "upstream", "total"} <= set(stages)
    generated = httpx.post(gw.url + "/v1/chat/completions", json=CHAT).headers["x-request-id"]
    assert len(generated) == 32 and generated != "abc-123"


def test_openai_client(setup):
    fake, gw = setup
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "".join(f"tok{i} " for i in range(8))
    assert answer.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f"tok{i} " for i in range(8))
    assert chunks[-1].usage.total_tokens == 13
    models = client.models.list()
    assert [m.id for m in models.data] == ["auto", "fake-model"]


def test_error_event_after_first_byte(setup):
    fake, gw = setup
    body = {**CHAT, "stream": True, "fake": {"tokens": 10, "fail_after": 3}}
    response = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = [e for e in response.content.split(b"\n\n") if e]
    payloads = [orjson.loads(e[6:]) for e in events[:-1]]
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == ["tok0 ", "tok1 ", "tok2 "]
    assert payloads[3]["error"]["type"] == "upstream_error"
    assert set(payloads[3]["error"]) == {"message", "type", "param", "code"}
    assert events[-1] == b"data: [DONE]"
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="fake-model", messages=CHAT["messages"], stream=True, extra_body={"fake": {"fail_after": 2}}))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_failover_before_first_byte(upstreams, gateways, protocol):
    # the broken endpoint answers its health probe faster, so the balancer tries it first
    broken = upstreams(protocol, status=503)  # it says it cannot serve (a 500 is its verdict on one request)
    healthy = upstreams(protocol, health_delay=0.2)
    gw = gateways({"clusters": [cluster(broken, healthy)], "routing": {"balancer": {"affinity": False}, "health": {"probe_path": "/health"}}})
    health = gw.state.fleet.health
    wait_until(lambda: all(health.endpoint(f.url).rtt_s is not None for f in (broken, healthy)), what="both probes answered")
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200
    assert response.content.endswith(b"data: [DONE]\n\n")
    assert len(broken.requests) == 1 and len(healthy.requests) == 1
    route = response.headers["x-edgegw-route"]
    assert f"endpoint={broken.url}" in route and f"served-by=central@{healthy.url}" in route
    for _ in range(3):  # passive ejection: the failed endpoint is avoided from now on
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert len(broken.requests) == 1 and len(healthy.requests) == 4


def test_failover_on_connect_error(upstreams, gateways):
    healthy = upstreams()
    config = cluster(healthy)
    config["endpoints"].insert(0, {"url": closed_port_url(), "warm_connections": 0})
    gw = gateways({"clusters": [config]})
    for _ in range(3):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert len(healthy.requests) == 3


def test_no_healthy_endpoint_is_503_with_retry_after(gateways):
    config = {"name": "dead", "models": ["fake-model"], "endpoints": [{"url": closed_port_url(), "warm_connections": 0}]}
    gw = gateways({"clusters": [config]})
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_healthy_upstream"


def test_upstream_4xx_is_passed_through(setup):
    fake, gw = setup
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "fake": {"status": 422}})
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "scripted 422"
    assert len(fake.requests) == 1  # a 4xx is the client's problem: no failover


def test_last_5xx_is_passed_through(setup):
    fake, gw = setup
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "fake": {"status": 503}})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "scripted 503"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_read_timeout_is_504(upstreams, gateways, protocol):
    fake = upstreams(protocol, hang=True)
    gw = gateways({"clusters": [cluster(fake, read_timeout_s=0.3)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"


def test_keepalive_comments_on_slow_first_token(upstreams, gateways):
    fake = upstreams(ttft=0.6, tokens=2)
    gw = gateways({"clusters": [cluster(fake)], "limits": {"keepalive_interval_s": 0.1}})
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    first_data = response.content.index(b"data:")
    pings = response.content[:first_data].count(b": ping\n\n")
    assert pings >= 3
    assert response.content[:first_data] == b": ping\n\n" * pings
    # the comments do not disturb an SSE client
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="fake-model", messages=CHAT["messages"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "tok0 tok1 "


def test_metrics_record_ttft_per_model_and_upstream(setup):
    fake, gw = setup
    httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    text = httpx.get(gw.url + "/metrics").text
    labels = f'model="fake-model",target="{fake.url}"'
    assert f"edgegw_ttft_seconds_count{{{labels}}} 1.0" in text
    assert f"edgegw_inter_token_seconds_count{{{labels}}}" in text
    assert f"edgegw_e2e_seconds_count{{{labels}}} 1.0" in text
    # live gauges, read from the routing state at scrape time
    assert f'edgegw_endpoint_breaker_state{{endpoint="{fake.url}"}} 0.0' in text
    assert f'edgegw_endpoint_in_flight{{endpoint="{fake.url}"}} 0.0' in text
    assert f'edgegw_endpoint_ttft_ewma_seconds{{endpoint="{fake.url}"}}' in text


def test_warm_connections_are_open_before_the_first_request(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake, warm_connections=3)]})
    pool = gw.state.fleet.clusters[0].upstreams[0].pool
    assert pool.num_connections == 3
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert pool.num_connections == 3  # the first request took a warm connection: no handshake


def test_models_discovered_when_not_configured(upstreams, gateways):
    fake = upstreams()
    fake.app.models[:] = ["alpha", "beta"]
    gw = gateways({"clusters": [{"name": "found", "endpoints": [{"url": fake.url}]}]})
    assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == ["auto", "alpha", "beta"]
    assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "beta"}).status_code == 200


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_tls_upstream_with_alpn(upstreams, gateways, certificate, protocol):
    fake = upstreams(protocol, tls=certificate)
    assert fake.url.startswith("https://")
    gw = gateways({"clusters": [cluster(fake, verify_tls=False)]})
    body = {**CHAT, "stream": True}
    response = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.content == httpx.post(fake.url + "/v1/chat/completions", json=body, verify=False).content
    pool = gw.state.fleet.upstreams[fake.url].pool
    assert pool.protocol == protocol and pool.num_connections >= 1


def test_tls_upstream_certificate_is_verified_by_default(upstreams, gateways, certificate):
    fake = upstreams("http1", tls=certificate)
    gw = gateways({"clusters": [cluster(fake, warm_connections=0, connect_timeout_s=30)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 503  # the self-signed certificate is refused: no endpoint reachable
    assert "certificate" in response.json()["error"]["message"].lower()


def test_http2_goaway_is_survived(upstreams, gateways):
    """The server sends GOAWAY after every 5 requests on a connection (hypercorn's request
    limit; servers do the same when they restart): a stream it did not answer is sent again
    on a new connection and the client never sees the difference. (Hypercorn also drops the
    streams still running when it sends GOAWAY, so the requests here are sequential; those
    would end in an error event, as any stream broken mid-way.)"""
    fake = upstreams("http2", max_requests=5, tokens=4)
    gw = gateways({"clusters": [cluster(fake)]})
    for i in range(16):
        response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": bool(i % 2)})
        assert response.status_code == 200, response.text
        assert b"error" not in response.content
    # hypercorn hands the stream that crossed its limit to the app, then closes without an
    # answer: the gateway saw no response headers and sent it again
    assert len(fake.requests) >= 16
    assert gw.state.fleet.upstreams[fake.url].pool.num_connections >= 1


# -- EventReader: an upstream's bytes cut at event boundaries --------------------------------


def reader_over(high_water: int = 1 << 20, ping: float = 0.05, timeout: float = 0.2, max_event: int = 1 << 20):
    body = Body(asyncio.get_running_loop(), high_water, None, lambda n: None)
    return body, EventReader(body, ping, timeout, max_event)


async def test_event_reader_hands_back_whole_events_as_received():
    body, reader = reader_over()
    body.feed(b"data: one\n\ndata: tw")
    assert await reader.next() == b"data: one\n\n"
    assert reader.in_event
    body.feed(b"o\n\ndata: three\r\n\r\n")
    assert await reader.next() == b"data: two\n\ndata: three\r\n\r\n"
    assert not reader.in_event
    body.feed(b"data: unterminated")
    body.feed_eof()
    assert await reader.next() == b"data: unterminated"  # the last event as it came
    assert await reader.next() == b""


async def test_event_reader_cuts_at_the_last_event_end_for_every_split_of_a_stream():
    """Every way of splitting one stream (LF and CRLF events, a run that ends in a whole event
    and one that does not) in two reads: each run handed back ends where an event ends, at
    the last such place received so far, and the runs add up to the stream."""
    stream = b"data: a\n\ndata: b\r\n\r\n: ping\n\ndata: c\n\n"
    ends = [i + 2 for i in range(len(stream)) if stream[i : i + 2] == b"\n\n"]
    ends += [i + 4 for i in range(len(stream)) if stream[i : i + 4] == b"\r\n\r\n"]
    for split in range(1, len(stream)):
        body, reader = reader_over()
        runs, received = [], 0
        for part in (stream[:split], stream[split:]):
            body.feed(part)
            received += len(part)
            last = max((e for e in ends if e <= received), default=0)
            if last > sum(map(len, runs)):
                runs.append(await reader.next())
                assert sum(map(len, runs)) == last, (split, runs)
        assert b"".join(runs) == stream and not reader.in_event, split


async def test_event_reader_reports_quiet_spells_then_times_out():
    body, reader = reader_over(ping=0.05, timeout=0.15)
    assert await reader.next() is None
    assert await reader.next() is None
    with pytest.raises(UpstreamReadTimeout):
        for _ in range(3):
            assert await reader.next() is None


async def test_event_reader_refuses_an_endless_event():
    body, reader = reader_over(max_event=64)
    body.feed(b"data: " + b"x" * 100)
    with pytest.raises(UpstreamProtocolError, match="exceeds 64 bytes"):
        await reader.next()


class _Writer:
    """A client socket for ``Splice``: takes what is written; ``room`` writes before full."""

    def __init__(self, room: int = 1000) -> None:
        self.written: list[bytes] = []
        self.room = room

    @property
    def writable(self) -> bool:
        return self.room > 0

    def write(self, data: bytes) -> bool:
        self.written.append(data)
        self.room -= 1
        return self.room > 0


class _Reply:
    def __init__(self, reader: EventReader) -> None:
        self.reader = reader
        self.first = None

    def hand_over(self, on_events) -> bool:
        return self.reader.hand_over(on_events)

    def first_token(self, now: float) -> None:
        self.first = now


class _Series:
    class _H:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, value: float) -> None:
            self.values.append(value)

    def __init__(self) -> None:
        self.ttft, self.gap = self._H(), self._H()


def spliced(writer: _Writer, **reader):
    from gateway.core.context import RequestContext
    from gateway.replies import Answer

    body, events = reader_over(**reader)
    ctx = RequestContext({"headers": [], "client": None}, b"rid", "chat")
    answer = Answer()
    answer.reply = _Reply(events)
    series = _Series()
    meter = Meter(ctx, answer, series)
    return body, events, Splice(answer.reply, meter, writer), meter, series


async def test_a_splice_writes_whole_events_as_they_arrive_and_notes_each():
    writer = _Writer()
    body, reader, splice, meter, series = spliced(writer)
    splice.start()
    assert splice.on
    body.feed(b"data: one\n\ndata: tw")  # no read: the producer's own call hands it over
    await asyncio.sleep(0)  # written at the end of the loop turn
    assert writer.written == [b"data: one\n\n"]
    assert reader.in_event  # the half event is kept: no comment may go in now
    body.feed(b"o\n\n")
    body.feed(b"data: three\n\n")  # two chunks of one read: one write
    await asyncio.sleep(0)
    assert writer.written == [b"data: one\n\n", b"data: two\n\ndata: three\n\n"]
    assert body.buffered == 0 and meter.chunks == 3
    assert len(series.ttft.values) == 1 and len(series.gap.values) == 2
    big = b"data: " + b"x" * (64 * 1024) + b"\n\n"
    body.feed(big)  # past 64 KiB: written at once, memory stays bounded within a turn
    assert writer.written[-1] == big
    body.feed_eof()
    assert await reader.next() == b""  # the task wakes only for the end


async def test_a_splice_gives_the_stream_back_when_the_client_is_behind():
    writer = _Writer(room=2)
    body, reader, splice, meter, _ = spliced(writer)
    splice.start()
    body.feed(b"data: 1\n\n")
    await asyncio.sleep(0)
    body.feed(b"data: 2\n\n")
    await asyncio.sleep(0)  # the client's socket is full now
    assert not splice.on
    body.feed(b"data: 3\n\n")  # kept in the bounded body, for the task to relay
    assert writer.written == [b"data: 1\n\n", b"data: 2\n\n"]
    assert body.buffered == len(b"data: 3\n\n")
    writer.room = 10  # the client read: the splice may not start while something is kept
    splice.start()
    assert not splice.on
    assert await reader.next() == b"data: 3\n\n"
    splice.start()
    assert splice.on
    body.feed(b"data: 4\n\n")
    splice.stop()  # what it holds is written before the task writes anything
    assert writer.written[-1] == b"data: 4\n\n" and body.buffered == 0


async def test_a_splice_refuses_an_endless_event_through_the_task():
    writer = _Writer()
    body, reader, splice, _, _ = spliced(writer, max_event=64)
    splice.start()
    body.feed(b"data: " + b"x" * 100)
    assert writer.written == []
    with pytest.raises(UpstreamProtocolError, match="exceeds 64 bytes"):
        await reader.next()


async def test_a_token_and_a_gap_are_counted_for_runs_that_carry_a_token():
    """However the upstream's writes split or merge its events, ``[DONE]``, a usage chunk
    and a finish-only chunk are no tokens, so TPOT and the gaps do not depend on them."""
    _, _, _, meter, series = spliced(_Writer())
    content = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
    spaced = b'data: {"choices": [{"index": 0, "text": "b", "finish_reason": null}]}\n\n'
    finish = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"total_tokens":3}}\n\n'
    last_with_finish = b'data: {"choices":[{"index":0,"delta":{"content":"c"},"finish_reason":"length"}]}\n\n'
    for run in [content, spaced, finish, usage, DONE, finish + usage + DONE, last_with_finish + DONE]:
        meter.passing(run)
    assert meter.chunks == 3  # the first (TTFT), the spaced one, and the last content run
    assert len(series.ttft.values) == 1 and len(series.gap.values) == 2


def test_sse_events_are_spliced_on_the_http1_listener(setup, monkeypatch):
    """Through a real gateway and listener: events go from the upstream's callback to the
    client's socket (``Splice``), byte for byte as the upstream sent them, each measured."""
    written = []
    events = Splice._events
    monkeypatch.setattr(Splice, "_events", lambda self, data: (written.append(data), events(self, data))[1])
    fake, gw = setup
    # the client asks for the usage chunk itself: otherwise the gateway asks for it (the
    # tenant's usage) and takes it out, and the client gets one event fewer than was spliced
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "fake": {"tokens": 12, "delay": 0.01}}
    direct = httpx.post(fake.url + "/v1/chat/completions", json=body)
    relayed = httpx.post(gw.url + "/v1/chat/completions", json=body)
    assert relayed.content == direct.content
    assert len(written) >= 10  # paced events: nearly every one went straight through
    assert b"".join(written) in relayed.content
    text = httpx.get(gw.url + "/metrics").text
    assert f'edgegw_inter_token_seconds_count{{model="fake-model",target="{fake.url}"}}' in text
    gaps = next(line for line in text.splitlines() if line.startswith("edgegw_inter_token_seconds_count"))
    assert float(gaps.rsplit(" ", 1)[1]) >= 10


def test_sse_framing_round_trips():
    events = sse_events([b'{"a":1}', b'{"b":2}']) + b": ping\n\n" + DONE
    assert sse_payloads(events) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]
    assert sse_payloads(b"data:x\r\ndata: y\r\n\r\n") == [b"x\ny"]
    assert sse_event(b"[DONE]") == DONE


@pytest.mark.parametrize(
    "policy, expect",
    [
        pytest.param("passthrough", "abc-123", id="passthrough"),
        pytest.param("off", None, id="off"),
    ],
)
def test_the_request_id_an_endpoint_gets_is_its_own_setting(upstreams, gateways, policy, expect):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake, request_id=policy)]})
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc-123"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-123"
    assert fake.requests[-1].headers.get("x-request-id") == expect
