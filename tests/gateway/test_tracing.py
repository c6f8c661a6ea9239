"""OpenTelemetry: spans exported over OTLP/HTTP to a local receiver that decodes the
protobuf, the W3C trace context continued upstream with the gateway's own span as parent,
and the trace id in the access log."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time

import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from websockets.sync.client import connect as ws_connect

from gateway.core.settings import TracingSettings
from gateway.observe.tracing import Tracing
from tests.conftest import cluster, ws_answer
from tests.fakes import free_port
from tests.waiting import wait_until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it is sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        spans = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    service = {a.key: a.value.string_value for a in resource.resource.attributes}.get("service.name")
                    for scope in resource.scope_spans:
                        spans.extend((service, span) for span in scope.spans)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, predicate, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.spans):
                return self.spans
            time.sleep(0.05)
        raise AssertionError(f"the receiver got {[s.name for _, s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export every 50 ms, not every 5 s
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-gw-under-test")
    r = Receiver()
    yield r
    r.close()


def access_lines(caplog, count: int) -> list[str]:
    """The access log's lines once ``count`` have been logged (the gateway logs a request when
    it has ended, which may be after its client has the whole answer), within a bound."""
    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "edgegw.access"]

    wait_until(lambda: len(lines()) >= count, 10, f"{count} access log line(s)")
    return lines()


def spans_of(spans, trace_id: str) -> dict:
    return {span.name: span for _, span in spans if span.trace_id.hex() == trace_id}


def test_a_request_is_one_trace_with_the_upstream_as_its_child(upstreams, gateways, receiver, caplog):
    fake = upstreams(tokens=3)
    gw = gateways({"clusters": [cluster(fake)], "tracing": {"otlp_url": receiver.url}, "listen": {"access_log": True}})
    caplog.set_level(logging.INFO, logger="edgegw.access")  # for the whole test: the line is logged after the answer
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    spans = receiver.wait_for(lambda s: "chat request" in spans_of(s, TRACE_ID))
    by_name = spans_of(spans, TRACE_ID)
    server, client = by_name["chat request"], by_name["send to endpoint"]
    assert server.parent_span_id.hex() == CLIENT_SPAN  # continues the client's trace
    assert client.parent_span_id == server.span_id
    for stage in ("edgegw.admit", "edgegw.route", "edgegw.queue", "edgegw.pool", "edgegw.upstream", "edgegw.first_token", "edgegw.decode"):
        assert by_name[stage].parent_span_id == server.span_id, stage
        assert server.start_time_unix_nano <= by_name[stage].start_time_unix_nano <= by_name[stage].end_time_unix_nano <= server.end_time_unix_nano
    assert all(service == "edge-gw-under-test" for service, _ in spans)
    # the upstream got the client's trace id with the gateway's client span as its parent
    seen = fake.requests[-1].headers["traceparent"]
    assert seen.split("-")[1] == TRACE_ID and seen.split("-")[2] == client.span_id.hex() != CLIENT_SPAN
    assert any(f"trace={TRACE_ID}" in line for line in access_lines(caplog, 1))


def test_a_trace_is_started_when_the_client_sends_none_and_continued_over_websocket(upstreams, gateways, receiver):
    fake = upstreams(tokens=2)
    gw = gateways({"clusters": [cluster(fake)], "tracing": {"otlp_url": receiver.url}})
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    started = fake.requests[-1].headers["traceparent"].split("-")[1]
    receiver.wait_for(lambda s: "chat request" in spans_of(s, started))
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers={"traceparent": TRACEPARENT}) as ws:
        ws.send(orjson.dumps(CHAT).decode())
        assert ws_answer(ws)[-1]["type"] == "done"
    seen = fake.requests[-1].headers["traceparent"]
    assert seen.split("-")[1] == TRACE_ID and seen.split("-")[2] != CLIENT_SPAN
    spans = receiver.wait_for(lambda s: "ws request" in spans_of(s, TRACE_ID))
    assert spans_of(spans, TRACE_ID)["send to endpoint"].span_id.hex() == seen.split("-")[2]


def test_without_an_exporter_the_clients_trace_context_passes_unchanged(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    assert gw.state.tracing is None
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    assert fake.requests[-1].headers["traceparent"] == TRACEPARENT
    assert fake.requests[-1].headers["tracestate"] == "vendor=1"


def test_an_edge_answer_shows_the_engines_own_stages_in_its_trace_metrics_and_log(gateways, tiny_model, receiver, caplog):
    edge = {"enabled": True, "model": tiny_model, "name": "tiny", "dtype": "float32", "num_kv_blocks": 64, "block_size": 4}
    gw = gateways({"edge": edge, "tracing": {"otlp_url": receiver.url}, "listen": {"access_log": True}})
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
    caplog.set_level(logging.INFO, logger="edgegw.access")  # for the whole test: a line is logged after its answer
    for stream in (True, False):
        response = httpx.post(gw.url + "/v1/chat/completions", json={**ask, "stream": stream}, headers={"traceparent": TRACEPARENT}, timeout=60)
        assert response.status_code == 200, response.text
    spans = receiver.wait_for(lambda s: sum(span.name == "edgegw.engine_decode" for _, span in s) == 2)
    for request in [span for _, span in spans if span.name == "chat request"]:
        mine = {span.name: span for _, span in spans if span.trace_id == request.trace_id and span.end_time_unix_nano <= request.end_time_unix_nano}
        inside = [span for _, span in spans if span.name == "edgegw.inside_target" and span.parent_span_id == request.span_id]
        assert len(inside) == 1
        engine = [span for _, span in spans if span.parent_span_id == inside[0].span_id]
        assert [span.name for span in engine] == ["edgegw.engine_queue", "edgegw.engine_prefill", "edgegw.engine_decode"]
        # back to back, inside the request, starting once the prompt was ready
        assert engine[0].start_time_unix_nano >= mine["edgegw.engine"].end_time_unix_nano
        assert engine[0].end_time_unix_nano == engine[1].start_time_unix_nano and engine[1].end_time_unix_nano == engine[2].start_time_unix_nano
        assert engine[2].end_time_unix_nano <= request.end_time_unix_nano
        assert engine[2].end_time_unix_nano > engine[2].start_time_unix_nano  # five tokens after the first take time
    metrics = httpx.get(gw.url + "/metrics").text
    for stage in ("engine_queue", "engine_prefill", "engine_decode"):
        assert f'edgegw_stage_seconds_count{{stage="{stage}",target_kind="edge"}} 2.0' in metrics
    logged = access_lines(caplog, 2)
    assert len(logged) == 2 and all("engine_prefill:" in line and "engine_decode:" in line for line in logged)


def test_a_silent_collector_does_not_hold_the_gateways_exit(caplog):
    """A collector that accepts connections and never answers: the last spans are given up
    after two seconds (with a warning), not after the exporter's retries (30 s and more)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepted by the kernel, never read or answered
    try:
        tracing = Tracing(TracingSettings(otlp_url=f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces"))
        with tracing.tracer.start_as_current_span("request"):
            pass
        stopping = threading.Thread(target=tracing.shutdown)
        with caplog.at_level(logging.WARNING, logger="edgegw.tracing"):
            stopping.start()
            stopping.join(20)  # a bound for a hung test, not a speed assertion: it returns after ~2 s
            assert not stopping.is_alive()
        assert "the last spans are dropped" in caplog.text
    finally:
        silent.close()


def test_a_collector_that_refuses_the_last_spans_is_warned_of(caplog):
    """The exporter fails before the shutdown's wait runs out (here: nothing listens, the
    connection is refused): the last spans are dropped, and the log says so as it does for a
    silent collector (the exporter's own time-out and the wait used to race for the warning)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    tracing = Tracing(TracingSettings(otlp_url=f"http://127.0.0.1:{port}/v1/traces"))
    with tracing.tracer.start_as_current_span("request"):
        pass
    with caplog.at_level(logging.WARNING, logger="edgegw.tracing"):
        tracing.shutdown()
    assert "the last spans are dropped" in caplog.text
