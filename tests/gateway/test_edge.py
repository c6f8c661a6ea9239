"""The real SmolLM2 served in-process through the gateway: the same streaming,
cancellation, errors and Server-Timing as a remote upstream. Loads the model once."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import orjson
import pytest

from gateway.core.settings import Settings
from tests.conftest import GatewayThread
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def edge_gateway():
    settings = Settings.model_validate(
        {
            "edge": {"enabled": True, "max_model_len": 2048, "max_num_seqs": 4},
            "cache": {"backend": "memory"},
            "tenants": [
                # its streams wait in the gateway's queue, however slow a busy machine made the
                # engine (the policy's default budget would turn the last ones away: 503)
                {"name": "bulk", "keys": ["sk-bulk"], "priority": "batch", "budget_ms": 600000},
                # a budget a busy machine still meets: the test checks that no batch stream ended
                # before the interactive request's first token, not how soon it came
                {"name": "app", "keys": ["sk-app"], "priority": "interactive", "budget_ms": 60000},
            ],
        }
    )
    gw = GatewayThread(settings).start(timeout=180)  # loading the model on a busy 2-core box
    yield gw
    gw.stop()


def test_capital_of_france_is_paris(edge_gateway):
    client = openai.OpenAI(base_url=edge_gateway.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["auto", "smollm2-135m-instruct"]
    first = client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION, temperature=0, max_tokens=30)
    answer = first.parse()
    assert "Paris" in answer.choices[0].message.content
    assert answer.model == "smollm2-135m-instruct"
    assert first.headers["x-edgegw-route"].startswith("target=edge")
    assert first.headers["x-cache"] == "MISS"
    again = client.chat.completions.with_raw_response.create(model="auto", messages=QUESTION, temperature=0, max_tokens=30)
    assert again.headers["x-cache"] == "HIT"  # greedy: the first answer was stored
    assert again.headers["x-edgegw-route"].startswith("target=cache")
    assert again.parse().choices[0].message.content == answer.choices[0].message.content
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=30, stream=True, seed=7
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text


def test_edge_stream_has_server_timing_and_ends_with_done(edge_gateway):
    body = {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 8, "stream": True, "temperature": 0.7}
    response = httpx.post(edge_gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["x-cache"] == "BYPASS"
    assert "admit;dur=" in response.headers["server-timing"]
    assert response.content.endswith(b"data: [DONE]\n\n")


def test_edge_errors_name_the_parameter(edge_gateway):
    body = {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 100_000}
    response = httpx.post(edge_gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_client_disconnect_frees_the_engine_sequence(edge_gateway):
    engine = edge_gateway.state.fleet.edge.engine
    host, port = edge_gateway.url.removeprefix("http://").split(":")
    body = orjson.dumps(
        {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 1000, "stream": True,
         "temperature": 1.0, "ignore_eos": True}
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(65536)
        assert engine.stats().num_running == 1
    deadline = time.monotonic() + 5
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_kv_blocks_used == 0
    metrics = httpx.get(edge_gateway.url + "/metrics").text
    assert "edgegw_edge_running 0.0" in metrics
    assert f"edgegw_edge_kv_blocks_total {float(stats.num_kv_blocks_total)}" in metrics


def test_an_interactive_request_does_not_wait_behind_another_tenants_streams(edge_gateway):
    """Another tenant keeps six long streams on an engine that runs four sequences at once:
    an interactive request gets its first token while every one of them still runs (the
    engine preempts a batch sequence for it), not after a batch stream ends."""
    engine = edge_gateway.state.fleet.edge.engine
    host, port = edge_gateway.url.removeprefix("http://").split(":")
    long = orjson.dumps(
        {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 600, "stream": True, "ignore_eos": True}
    )
    bulk = []
    try:
        for _ in range(6):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"authorization: Bearer sk-bulk\r\ncontent-length: " + str(len(long)).encode() + b"\r\n\r\n" + long
            )
            bulk.append(sock)
        queue = edge_gateway.state.fleet.queues["edge"]
        # four run in the engine, the rest wait in the gateway (each once its request is read)
        try:
            wait_until(lambda: engine.stats().num_running == 4 and queue.waiting == 2, 60, "four running, two waiting")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {engine.stats()} {queue!r}") from None
        finished = engine.stats().num_requests_finished
        # long enough not to be finished itself when its first token is read; closed then
        body = {"model": "smollm2-135m-instruct", "messages": QUESTION, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", edge_gateway.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-app"}, timeout=60) as r:
            assert r.status_code == 200, (r.read(), r.headers.get("x-edgegw-route"))
            first = next(line for line in r.iter_lines() if line.startswith("data:"))
            # its first token came while every batch stream was still going: it waited for none
            assert engine.stats().num_requests_finished == finished
        assert '"role":"assistant"' in first.replace(" ", "")
        assert engine.stats().num_preemptions >= 1
    finally:
        for sock in bulk:
            sock.close()
    deadline = time.monotonic() + 10
    while (engine.stats().num_running or engine.stats().num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().num_running == 0
