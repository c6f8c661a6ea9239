"""The request flow through the pipeline: the confidence cascade from the edge engine (a
tiny random model) to a central cluster (a fake), on both completion APIs."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import cluster

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
