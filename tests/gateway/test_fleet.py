"""The fleet: endpoints' base URLs, model discovery, warm-up, start-up that never waits on
a dead upstream."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest

from tests.conftest import GatewayProcess

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("suffix", [pytest.param("", id="bare-origin"), pytest.param("/v1", id="v1"), pytest.param("/v1/", id="v1-slash")])
def test_an_endpoint_url_is_a_base_url_like_openai_clients_take(upstreams, gateways, suffix):
    fake = upstreams()
    gw = gateways({"clusters": [{"name": "c", "endpoints": [{"url": fake.url + suffix}]}]})
    assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == ["auto", "fake-model"]  # the alias, then the served models
    assert httpx.post(gw.url + "/v1/completions", json={"model": "fake-model", "prompt": "hi"}).status_code == 200
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert [r.path for r in fake.requests] == ["/v1/completions", "/v1/chat/completions"]
    assert "/v1/models" in fake.gets


def test_a_longer_base_path_is_kept(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [{"name": "c", "endpoints": [{"url": fake.url + "/openai/v1"}]}]})
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert fake.requests[-1].path == "/openai/v1/chat/completions"
    assert "/openai/v1/models" in fake.gets


def test_the_quick_start_takes_a_v1_base_url(upstreams, tmp_path):
    fake = upstreams()
    gw = GatewayProcess(None, tmp_path, ["--upstream", fake.url + "/v1"]).start()
    try:
        assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == ["auto", "fake-model"]  # the alias, then the served models
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert fake.requests[-1].path == "/v1/chat/completions"
    finally:
        gw.stop()


def test_a_discovery_failure_is_a_warning_naming_the_url_and_status(upstreams, gateways, caplog):
    fake = upstreams()
    with caplog.at_level(logging.WARNING, logger="edgegw.fleet"):
        gw = gateways({"clusters": [{"name": "c", "endpoints": [{"url": fake.url + "/wrong"}]}]})
    warnings = [r.getMessage() for r in caplog.records if r.name == "edgegw.fleet"]
    assert any("GET /wrong/models answered 404" in w for w in warnings), warnings
    # a model nobody has listed yet: 503 with Retry-After, not 404 (the client should retry)
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "models_not_discovered"


@pytest.mark.parametrize("kind", ["closed-port", "silent"])
def test_start_up_does_not_wait_on_a_dead_or_silent_upstream(tmp_path, kind):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if kind == "silent":
        listener.listen(16)  # accepts connections, never answers
    else:
        listener.close()
    started = time.monotonic()
    gw = GatewayProcess(None, tmp_path, ["--upstream", f"http://127.0.0.1:{port}/v1"]).start(timeout=30)
    try:
        took = time.monotonic() - started
        assert took < 10, f"start-up took {took:.1f} s"  # not the 120 s read timeout
        response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "models_not_discovered"
        assert httpx.get(gw.url + "/readyz").status_code == 503
    finally:
        gw.stop()
        listener.close()
