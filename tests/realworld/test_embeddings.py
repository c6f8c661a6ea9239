"""``/v1/embeddings`` through edgegw in front of llama.cpp's server started with embeddings
enabled: the pass-through path against a real server (tests/gateway/test_passthrough.py
covers the other APIs against a scripted one, since nothing here serves them).

llama.cpp's server answers with one vector per token of each input (SmolLM2's GGUF names no
pooling), ``usage`` with prompt and total tokens, and its own error for a bad input; the
gateway forwards by model, caches the deterministic answer, counts the tokens and wraps the
errors OpenAI-shaped.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.core.settings import Settings
from tests.conftest import GatewayThread
from tests.realworld.servers import MODEL, LlamaServer

WORDS = ["the quick brown fox", "jumps over the lazy dog"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    server = LlamaServer(tmp_path_factory.mktemp("llama-embed"), embedding=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(embedder):
    config = {
        "cache": {"backend": "memory"},
        "usage": {"enabled": True},
        "clusters": [{"name": "embed", "models": [MODEL], "endpoints": [{"url": embedder.base, "max_concurrency": 1}]}],
    }
    gw = GatewayThread(Settings.model_validate(config)).start()
    yield gw
    gw.stop()


def test_embeddings_through_the_gateway_equal_the_servers_own_and_a_repeat_is_a_cache_hit(embedder, front):
    body = {"model": MODEL, "input": WORDS}
    direct = httpx.post(embedder.base + "/embeddings", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    through = httpx.post(front.url + "/v1/embeddings", json=body, timeout=120)
    assert through.status_code == 200, through.text
    assert through.headers["x-cache"] == "MISS" and "cluster=embed" in through.headers["x-edgegw-route"]
    got, want = through.json(), direct.json()
    assert [d["index"] for d in got["data"]] == [0, 1]
    assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens"] > 0
    # the same vectors (the server computes them the same way each time; floats as it wrote them)
    assert [d["embedding"] for d in got["data"]] == [d["embedding"] for d in want["data"]]
    again = httpx.post(front.url + "/v1/embeddings", json=body, timeout=120)
    assert again.status_code == 200 and again.headers["x-cache"] == "HIT"
    assert again.json()["data"] == got["data"]


def test_the_servers_refusal_of_a_bad_input_reaches_the_client_openai_shaped_and_ejects_nothing(front):
    # llama.cpp's server answers a malformed input with 500 and its validation errors
    for _ in range(12):  # as many as once opened the breaker for every tenant
        bad = httpx.post(front.url + "/v1/embeddings", json={"model": MODEL, "input": {"not": "text"}}, timeout=120)
        assert bad.status_code == 500, bad.text
        error = bad.json()["error"]
        assert "valid string" in error["message"] and error["type"]
    fine = httpx.post(front.url + "/v1/embeddings", json={"model": MODEL, "input": "still served"}, timeout=120)
    assert fine.status_code == 200, fine.text
    unknown = httpx.post(front.url + "/v1/embeddings", json={"model": "no-such-model", "input": "x"}, timeout=120)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_embedding_tokens_are_counted_for_the_tenant(front):
    before = httpx.get(front.url + "/metrics", timeout=10).text
    answer = httpx.post(front.url + "/v1/embeddings", json={"model": MODEL, "input": "count these tokens please"}, timeout=120)
    assert answer.status_code == 200, answer.text
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    after = httpx.get(front.url + "/metrics", timeout=10).text
    assert _usage_tokens(after) - _usage_tokens(before) >= prompt_tokens


def _usage_tokens(metrics: str) -> float:
    """Prompt tokens counted per tenant and model, summed over the exposition."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("edgegw_usage_tokens_total{") and 'type="prompt"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
