"""The request flow through the pipeline: the confidence cascade from the edge engine (a
tiny random model) to a central cluster (a fake), on both completion APIs."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from edge_engine import OpenAIServing
from gateway.admission import gate
from gateway.pipeline import dispatch
from gateway.pipeline.caching import CacheLayer
from tests.conftest import cluster
from tests.edge_engine.costs import freeze

EDGE = {"enabled": True, "name": "tiny", "num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
ASKS = [
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, id="chat"),
    pytest.param("/v1/completions", {"prompt": "hi"}, id="completions"),
]


def cascading(fake, tiny_model: str, threshold: float) -> dict:
    return {
        "edge": {**EDGE, "model": tiny_model},
        "clusters": [cluster(fake, models=("central-model",))],
        "routing": {"policy": {"cascade_min_logprob": threshold, "central_model": "central-model"}, "hedging": {"enabled": False}},
    }


@pytest.mark.parametrize("path,ask", ASKS)
def test_an_unsure_edge_answer_is_escalated(upstreams, gateways, tiny_model, path, ask):
    fake = upstreams()
    gw = gateways(cascading(fake, tiny_model, threshold=0.0))  # a random model is never that sure
    response = httpx.post(gw.url + path, json={"model": "auto", "max_tokens": 4, "temperature": 0, **ask}, timeout=30)
    assert response.status_code == 200, response.text
    route = response.headers["x-edgegw-route"]
    assert route.startswith("target=edge") and "cascaded=1" in route and "served-by=central@" in route
    assert fake.requests[-1].path == path and fake.requests[-1].body["model"] == "central-model"


@pytest.mark.parametrize("path,ask", ASKS)
def test_a_sure_enough_edge_answer_is_kept_without_the_logprobs_asked_on_its_behalf(upstreams, gateways, tiny_model, path, ask):
    fake = upstreams()
    gw = gateways(cascading(fake, tiny_model, threshold=-1000.0))
    response = httpx.post(gw.url + path, json={"model": "auto", "max_tokens": 4, "temperature": 0, **ask}, timeout=30)
    assert response.status_code == 200, response.text
    assert "cascade-kept" in response.headers["x-edgegw-route"]
    assert response.json()["model"] == "tiny"
    assert response.json()["choices"][0]["logprobs"] is None
    assert not fake.requests


def test_a_busy_central_target_degrades_an_auto_request_to_the_edge(upstreams, gateways, tiny_model):
    """The central endpoint's queue would outlast the request's budget: an `auto` request is
    admitted to the edge engine instead of waiting (routing allows degrading it there)."""
    fake = upstreams()
    config = {
        "edge": {**EDGE, "model": tiny_model},
        "clusters": [
            {"name": "central", "models": ["central-model"], "endpoints": [{"url": fake.url, "max_concurrency": 1, "warm_connections": 0}]}
        ],
        "routing": {"policy": {"edge_max_prompt_tokens": 1, "central_model": "central-model", "prior_ttft_ms": 100}, "hedging": {"enabled": False}},
    }
    gw = gateways(config)
    url = gw.url + "/v1/chat/completions"
    long_ask = {"model": "auto", "messages": [{"role": "user", "content": "a prompt longer than the edge takes"}], "max_tokens": 4}
    assert httpx.post(url, json={**long_ask, "fake": {"ttft": 0.5}}, timeout=30).status_code == 200  # measured: ~0.5 s a slot
    assert fake.requests[-1].body["model"] == "central-model"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json={**long_ask, "stream": True, "fake": {"ttft": 3.0}}):
        deadline = time.monotonic() + 3
        while len(fake.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        degraded = client.post(url, json=long_ask, headers={"x-latency-budget-ms": "450"})
        assert degraded.status_code == 200, degraded.text
        assert degraded.json()["model"] == "tiny"
        route = degraded.headers["x-edgegw-route"]
        assert "admitted-to=edge" in route and "served-by=edge" in route
    assert len(fake.requests) == 2


def test_an_auto_request_no_target_could_ever_serve_is_the_clients_error(gateways, tiny_model):
    gw = gateways({"edge": {**EDGE, "model": tiny_model}})  # the edge engine alone, like `make run`
    body = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1_000_000_000}
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text  # not a 503 to retry forever
    assert response.json()["error"]["param"] == "max_tokens" and "retry-after" not in response.headers


def test_a_huge_prompt_does_not_stall_the_event_loop(gateways, tiny_model, monkeypatch):
    """A prompt of several megabytes (under max_body_bytes) for the edge engine: parsing,
    hashing and tokenising never run on the event loop (each is seen running on a thread
    other than the gateway's), and what cannot fit is refused."""
    ran_on: dict[str, set[str]] = {}

    def on_a_thread(name: str, function):
        def wrapper(*args, **kwargs):
            ran_on.setdefault(name, set()).add(threading.current_thread().name)
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(gate, "parse_request", on_a_thread("parse", gate.parse_request))
    monkeypatch.setattr(dispatch, "request_from_openai", on_a_thread("route features", dispatch.request_from_openai))
    monkeypatch.setattr(CacheLayer, "plan", on_a_thread("cache key", CacheLayer.plan))
    monkeypatch.setattr(OpenAIServing, "prepare", on_a_thread("tokenise", OpenAIServing.prepare))
    gw = gateways({"edge": {**EDGE, "model": tiny_model}, "cache": {"backend": "memory"}})
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 780_000}], "temperature": 0}
    results = []

    def ask() -> None:
        results.append(httpx.post(gw.url + "/v1/chat/completions", json=huge, timeout=60))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [400, 400]
    assert results[0].json()["error"]["code"] == "context_length_exceeded"
    assert set(ran_on) == {"parse", "route features", "cache key", "tokenise"}, ran_on
    assert all(gw.thread.name not in threads_seen for threads_seen in ran_on.values()), ran_on


@pytest.mark.parametrize("central", [pytest.param(False, id="edge-alone"), pytest.param(True, id="with-central")])
def test_a_request_the_engine_cannot_start_in_its_budget_is_refused_at_once_or_escalated(upstreams, gateways, tiny_model, central):
    """The gateway lets requests into an engine that runs one at a time: behind a long
    stream, the engine predicts (from its measured steps) that a request with a short
    budget cannot start in time and refuses it at once, before it is queued: 503
    ``deadline_unattainable`` with Retry-After when the engine is the only target, or
    served by the central fallback; the stream is unharmed."""
    edge = {**EDGE, "model": tiny_model, "max_num_seqs": 1, "max_concurrency": 4, "dtype": "float32", "num_kv_blocks": 256}
    config = {"edge": edge}
    if central:
        fake = upstreams()
        config["clusters"] = [cluster(fake, models=("central-model",))]
        config["routing"] = {"policy": {"central_model": "central-model"}, "hedging": {"enabled": False}}
    gw = gateways(config)
    url = gw.url + "/v1/chat/completions"
    # 400 tokens to go (the tiny model's context is 512): its steps take more than 50 ms in all
    long = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=long, headers={"x-latency-budget-ms": "60000"}) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the engine is busy with it
        ask = {**long, "model": "auto" if central else "tiny", "stream": False, "max_tokens": 4}
        late = client.post(url, json=ask, headers={"x-latency-budget-ms": "50"})
        tail = [line for line in lines if line.startswith("data: ")][-2:]
    engine = gw.state.fleet.edge.engine
    if central:
        assert late.status_code == 200, late.text
        assert "served-by=central@" in late.headers["x-edgegw-route"] and fake.requests[-1].body["model"] == "central-model"
    else:
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "deadline_unattainable" and int(late.headers["retry-after"]) >= 1
    assert engine.stats().num_refused == 1 and engine.stats().num_deadline_drops == 0
    assert '"finish_reason":"length"' in tail[0] and tail[1] == "data: [DONE]"  # all 400 tokens, then [DONE]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_whose_budget_passes_in_the_engines_queue_is_dropped_there_unrun(gateways, tiny_model, stream):
    """Admitted by an engine that believes its steps are free (the node turned out slower
    than measured), a request waits inside the engine behind a long stream holding its only
    batch slot; the engine drops it when the budget it was handed passes: 504
    ``deadline_exceeded`` (a stream from the in-process engine has its head out already: the
    same error as its one event); the long stream is unharmed."""
    edge = {**EDGE, "model": tiny_model, "max_num_seqs": 1, "max_concurrency": 4, "dtype": "float32", "num_kv_blocks": 256}
    gw = gateways({"edge": edge})
    engine = gw.state.fleet.edge.engine
    freeze(engine)
    url = gw.url + "/v1/chat/completions"
    long = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json=long, headers={"x-latency-budget-ms": "60000"}) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the engine is busy with it
        late = client.post(url, json={**long, "stream": stream, "max_tokens": 4}, headers={"x-latency-budget-ms": "100"})
        tail = [line for line in lines if line.startswith("data: ")][-2:]
    if stream:
        assert late.status_code == 200 and '"code":"deadline_exceeded"' in late.text.replace(" ", ""), late.text
    else:
        assert late.status_code == 504, late.text
        assert late.json()["error"]["code"] == "deadline_exceeded"
    assert engine.stats().num_deadline_drops == 1
    assert '"finish_reason":"length"' in tail[0] and tail[1] == "data: [DONE]"
