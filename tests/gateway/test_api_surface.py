"""The API surface real clients expect (issue 22): the model list and ``GET /v1/models/{id}``
behind the keys, OpenAI-style ids on edge answers, no silent downgrade of tools and JSON
(the edge engine here has no constrained decoding), ``max_completion_tokens`` honoured by
the engine and mapped for servers that read only ``max_tokens``, and request validation.

Over real sockets: the gateway under uvicorn, fake upstreams (tests/fakes.py) and the
engine with a tiny random Llama.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import cluster

EDGE = {"enabled": True, "name": "tiny", "num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
STRUCTURED = [
    pytest.param({"tools": TOOLS}, "tools", id="tools"),
    pytest.param({"tool_choice": "required", "tools": TOOLS}, "tools", id="tool-choice-required"),
    pytest.param({"response_format": {"type": "json_object"}}, "response_format", id="json-object"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}}, "response_format", id="json-schema"),
]


def ask(content: str = "hi", **fields) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], **fields}


# -- the model list ----------------------------------------------------------------------


def test_models_lists_aliases_and_only_what_the_key_may_use_and_retrieves_one(upstreams, gateways):
    fake = upstreams(models=["fake-model", "secret-model"])
    gw = gateways({
        "clusters": [cluster(fake, models=("fake-model", "secret-model", "org/model-v1"))],
        "routing": {"aliases": {"auto": "auto", "smart": "secret-model"}},
        "auth": {"mode": "required"},
        "tenants": [
            {"name": "all", "keys": ["sk-all"]},
            {"name": "some", "keys": ["sk-some"], "models": ["auto", "fake-model"]},
        ],
    })
    assert httpx.get(gw.url + "/v1/models").status_code == 401  # behind the same keys as the completions
    assert httpx.get(gw.url + "/v1/models/fake-model").status_code == 401
    everything = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer sk-all"}).json()
    ids = [m["id"] for m in everything["data"]]
    assert ids[:2] == ["auto", "smart"] and {"fake-model", "secret-model", "org/model-v1"} <= set(ids)
    assert {m["object"] for m in everything["data"]} == {"model"}
    some = httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer sk-some"}).json()
    assert [m["id"] for m in some["data"]] == ["auto", "fake-model"]

    one = httpx.get(gw.url + "/v1/models/org/model-v1", headers={"authorization": "Bearer sk-all"})
    assert one.status_code == 200 and one.json() == {"id": "org/model-v1", "object": "model", "created": 0, "owned_by": "central"}
    assert httpx.get(gw.url + "/v1/models/auto", headers={"authorization": "Bearer sk-all"}).json()["owned_by"] == "edgegw"
    for model, key in (("nope", "sk-all"), ("secret-model", "sk-some")):  # unknown, or not this key's
        missing = httpx.get(gw.url + f"/v1/models/{model}", headers={"authorization": f"Bearer {key}"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found" and missing.json()["error"]["param"] == "model"


# -- the edge engine: ids, no silent downgrade, max_completion_tokens ----------------------


@pytest.fixture
def edge_gw(gateways, tiny_model):
    def start(**config):
        return gateways({"edge": {**EDGE, "model": tiny_model}, "routing": {"hedging": {"enabled": False}}, **config})

    return start


def test_edge_answers_have_openai_ids(edge_gw):
    gw = edge_gw()
    chat = httpx.post(gw.url + CHAT, json=ask(max_tokens=2, temperature=0), timeout=30)
    assert chat.status_code == 200, chat.text
    assert chat.json()["id"] == "chatcmpl-" + chat.headers["x-request-id"]
    completion = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert completion.json()["id"] == "cmpl-" + completion.headers["x-request-id"]
    with httpx.stream("POST", gw.url + CHAT, json=ask(max_tokens=2, stream=True), timeout=30) as stream:
        ids = set(re.findall(r'"id":"([^"]+)"', stream.read().decode()))
    assert ids == {"chatcmpl-" + stream.headers["x-request-id"]}


@pytest.mark.parametrize("fields, param", STRUCTURED)
def test_the_edge_model_named_with_structure_it_cannot_honour_is_a_400(edge_gw, tiny_model, fields, param):
    gw = edge_gw(edge={**EDGE, "model": tiny_model, "structured_output": False})  # an engine that cannot
    response = httpx.post(gw.url + CHAT, json={**ask(**fields), "model": "tiny"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "structured output" in error["message"]


@pytest.mark.parametrize("fields, param", STRUCTURED)
def test_auto_with_structure_and_nothing_that_honours_it_is_a_503_saying_why(edge_gw, tiny_model, fields, param):
    gw = edge_gw(edge={**EDGE, "model": tiny_model, "structured_output": False}, routing={"policy": {"edge_handles_tools": True}})
    response = httpx.post(gw.url + CHAT, json=ask(**fields), timeout=30)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_capable_target"
    assert "structured output" in response.json()["error"]["message"]
    # the same request without the structure is answered by the edge
    assert httpx.post(gw.url + CHAT, json=ask(max_tokens=2), timeout=30).status_code == 200


@pytest.mark.parametrize("fields, param", STRUCTURED)
def test_auto_with_structure_escalates_and_never_falls_back_to_the_edge(upstreams, edge_gw, fields, param):
    fake = upstreams(status=503)  # the central cluster fails: the edge is no fallback for this
    gw = edge_gw(clusters=[cluster(fake, models=("central-model",))], routing={"policy": {"edge_handles_tools": True}, "hedging": {"enabled": False}})
    response = httpx.post(gw.url + CHAT, json=ask(**fields), timeout=30)
    assert response.status_code == 503
    assert fake.requests and fake.requests[-1].body.get(param) is not None
    assert "target=endpoint" in response.headers["x-edgegw-route"] and "fallbacks=edge" not in response.headers["x-edgegw-route"]
    fake.defaults["status"] = 200
    served = httpx.post(gw.url + CHAT, json=ask(**fields), timeout=30)
    assert served.status_code == 200 and served.json()["model"] == "central-model"


def test_max_completion_tokens_is_the_engines_cap(edge_gw):
    gw = edge_gw()
    body = ask(max_completion_tokens=3, temperature=0, ignore_eos=True)
    response = httpx.post(gw.url + CHAT, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "compat, sent, expected",
    [
        pytest.param({}, {"max_completion_tokens": 5}, {"max_tokens": 5, "max_completion_tokens": 5}, id="default-both"),
        pytest.param({}, {"max_tokens": 7}, {"max_tokens": 7}, id="default-max-tokens-alone-as-sent"),
        pytest.param({"max_tokens_field": "max_tokens"}, {"max_completion_tokens": 5}, {"max_tokens": 5}, id="max-tokens-only"),
        pytest.param({"max_tokens_field": "max_completion_tokens"}, {"max_tokens": 7}, {"max_completion_tokens": 7}, id="reasoning-models"),
        pytest.param({"max_tokens_field": "as_sent"}, {"max_completion_tokens": 5}, {"max_completion_tokens": 5}, id="as-sent"),
        pytest.param({}, {}, {}, id="no-cap"),
    ],
)
def test_the_output_cap_reaches_an_endpoint_under_the_name_it_reads(upstreams, gateways, compat, sent, expected):
    fake = upstreams()
    endpoint = {"compat": compat} if compat else {}
    gw = gateways({"clusters": [cluster(fake, **endpoint)]})
    response = httpx.post(gw.url + CHAT, json={**ask(), "model": "fake-model", **sent}, timeout=10)
    assert response.status_code == 200
    seen = fake.requests[-1].body
    assert {k: seen[k] for k in ("max_tokens", "max_completion_tokens") if k in seen} == expected


# -- request validation (issue 20) --------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        pytest.param({"messages": [{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]}, "messages.[0].tool_calls", id="tool-calls-not-a-list"),
        pytest.param({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.[0].tool_calls.[0].id", id="tool-call-without-id"),
        pytest.param({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}, "messages.[0].tool_calls.[0].function.arguments", id="arguments-not-a-string"),
        pytest.param({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}]}, "messages.[0].tool_calls.[0].function", id="tool-call-without-function"),
        pytest.param({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.[0].tool_calls", id="tool-calls-on-a-user-message"),
        pytest.param({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.[0].tool_call_id", id="tool-without-call-id"),
        pytest.param({"prompt": [[-1]]}, "prompt.[0]", id="negative-token-id"),
        pytest.param({"prompt": [3, -7]}, "prompt", id="negative-token-id-flat"),
    ],
)
def test_malformed_tool_messages_and_token_ids_are_400_naming_the_field(upstreams, gateways, body, param):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    path = "/v1/completions" if "prompt" in body else CHAT
    response = httpx.post(gw.url + path, json={"model": "fake-model", **body}, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not fake.requests  # never sent upstream


def test_well_formed_tool_turns_pass(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = httpx.post(gw.url + CHAT, json={"model": "fake-model", "messages": messages, "tools": TOOLS}, timeout=10)
    assert response.status_code == 200, response.text
    assert fake.requests[-1].body["messages"] == messages
