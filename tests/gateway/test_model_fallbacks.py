"""Fallbacks across models (``routing.fallbacks``, issue 22), end to end over real sockets:
a model whose targets fail before their first byte (an error status, a connection refused,
a timeout) or refuse the prompt as too long for their context (OpenAI's and vLLM's 400
``context_length_exceeded``) is answered by the next listed model, and ``x-edgegw-route``
says so. A client's own mistake (any other 400) is never retried elsewhere.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.conftest import cluster

CHAT = "/v1/chat/completions"
EDGE = {"enabled": True, "name": "tiny", "num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
# what vLLM (and OpenAI) answer to a prompt longer than the model's context
TOO_LONG = orjson.dumps({"error": {
    "message": "This model's maximum context length is 8192 tokens. However, you requested 9001 tokens.",
    "type": "BadRequestError", "param": None, "code": "context_length_exceeded",
}}).decode()
# llama.cpp's server says it in words only
TOO_LONG_WORDS = '{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}'


def ask(model: str = "big-model", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "temperature": 0, **fields}


@pytest.fixture
def two_models(upstreams, gateways):
    def start(big: dict, *, edge_model: str | None = None, endpoint: dict | None = None, **config):
        fake_big, fake_medium = upstreams(**big), upstreams()
        fallbacks = ["medium-model", *([edge_model] if edge_model else [])]
        gw = gateways({
            "clusters": [
                cluster(fake_big, name="big", models=("big-model",), **(endpoint or {})),
                cluster(fake_medium, name="medium", models=("medium-model",)),
            ],
            "routing": {"fallbacks": {"big-model": fallbacks}, "hedging": {"enabled": False}},
            **config,
        })
        return fake_big, fake_medium, gw

    return start


@pytest.mark.parametrize(
    "big, why",
    [
        pytest.param({"status": 400, "error_body": TOO_LONG}, "context_length_exceeded", id="context-length-code"),
        pytest.param({"status": 400, "error_body": TOO_LONG_WORDS}, "context_length_exceeded", id="context-length-words"),
        pytest.param({"status": 503}, "HTTP 503", id="server-error"),
        pytest.param({"status": 500}, "HTTP 500", id="internal-error"),
        pytest.param({"hang": True}, "upstream_timeout", id="timeout"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_next_model_answers_and_the_route_says_why(two_models, big, why, stream):
    endpoint = {"read_timeout_s": 0.5} if big.get("hang") else {}
    fake_big, fake_medium, gw = two_models(big, endpoint=endpoint)
    response = httpx.post(gw.url + CHAT, json=ask(stream=stream), timeout=30)
    assert response.status_code == 200, response.text
    route = response.headers["x-edgegw-route"]
    assert "model-fallbacks=medium-model@medium@" in route
    assert f"model-fallback=medium-model after big@{fake_big.url} ({why})" in route, route
    assert fake_big.requests and fake_big.requests[-1].body["model"] == "big-model"
    assert fake_medium.requests[-1].body["model"] == "medium-model"  # the fallback's own name goes upstream
    assert b'"model":"medium-model"' in response.content  # the answer says which model it is


def test_a_refused_connection_falls_back_too(two_models):
    fake_big, fake_medium, gw = two_models({})
    fake_big.stop()  # nothing listens there any more
    response = httpx.post(gw.url + CHAT, json=ask(), timeout=30)
    assert response.status_code == 200
    assert "model-fallback=medium-model after big@" in response.headers["x-edgegw-route"]


def test_another_client_error_is_answered_as_is(two_models):
    bad = '{"error":{"message":"temperature must be at most 2","type":"invalid_request_error","param":"temperature","code":null}}'
    fake_big, fake_medium, gw = two_models({"status": 400, "error_body": bad})
    response = httpx.post(gw.url + CHAT, json=ask(), timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "temperature must be at most 2"
    assert not fake_medium.requests


def test_a_fallback_answer_is_not_cached_as_the_asked_model(two_models):
    fake_big, fake_medium, gw = two_models({"status": 503}, cache={"backend": "memory"})
    assert httpx.post(gw.url + CHAT, json=ask(), timeout=30).headers["x-cache"] == "MISS"
    fake_big.defaults["status"] = 200  # big-model is back: it answers, not a stored fallback
    again = httpx.post(gw.url + CHAT, json=ask(), timeout=30)
    assert again.headers["x-cache"] == "MISS" and again.json()["model"] == "big-model"
    assert httpx.post(gw.url + CHAT, json=ask(), timeout=30).headers["x-cache"] == "HIT"


def test_the_edge_model_is_the_last_fallback(two_models, tiny_model):
    fake_big, fake_medium, gw = two_models({"status": 503}, edge_model="tiny", edge={**EDGE, "model": tiny_model})
    fake_medium.defaults["status"] = 502
    response = httpx.post(gw.url + CHAT, json=ask(max_tokens=2), timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny"
    route = response.headers["x-edgegw-route"]
    assert f"model-fallback=tiny after big@{fake_big.url} (HTTP 503), medium@{fake_medium.url} (HTTP 502)" in route, route
