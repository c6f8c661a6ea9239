"""Header forwarding like a transparent proxy: end-to-end headers reach the upstream; hop-by-
hop headers, the client's credentials and cookies and the gateway's own do not; the cache
key is not fooled by forwarded headers that change the answer."""

from __future__ import annotations

import httpx
import pytest

from gateway.admission.forwarding import HeaderPolicy
from tests.conftest import cluster

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def names(pairs) -> list[str]:
    return [n.decode() for n, _ in pairs]


def test_end_to_end_headers_pass_in_order_and_the_rest_never():
    headers = [
        (b"openai-organization", b"org-1"),
        (b"authorization", b"Bearer sk-secret"),
        (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        (b"cookie", b"session=1"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"host", b"gw"),
        (b"content-length", b"10"),
        (b"x-request-id", b"abc"),
        (b"x-latency-budget-ms", b"500"),
        (b"x-forwarded-for", b"1.2.3.4"),
        (b"accept-encoding", b"gzip"),
        (b"x-team", b"search"),
        (b"sec-websocket-key", b"k"),
    ]
    assert names(HeaderPolicy().forward(headers)) == ["openai-organization", "traceparent", "x-team"]


@pytest.mark.parametrize(
    "allow,deny,expected",
    [
        pytest.param(("OpenAI-Organization", "Authorization"), (), ["openai-organization"], id="allow-narrows-never-widens"),
        pytest.param((), ("X-Team",), ["openai-organization", "traceparent"], id="deny"),
    ],
)
def test_allow_and_deny_lists(allow, deny, expected):
    headers = [(b"openai-organization", b"o"), (b"traceparent", b"t"), (b"x-team", b"s"), (b"authorization", b"Bearer k")]
    assert names(HeaderPolicy(allow, deny).forward(headers)) == expected


def test_the_upstream_gets_what_a_transparent_proxy_forwards(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake, api_key="sk-upstream")]})
    headers = {
        "OpenAI-Organization": "org-9",
        "OpenAI-Project": "proj-2",
        "X-My-Header": "mine",
        "Authorization": "Bearer sk-client",
        "Cookie": "a=b",
        "Connection": "X-Secret-Hop",
        "X-Secret-Hop": "drop me",
    }
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    seen = fake.requests[-1].headers
    assert seen["openai-organization"] == "org-9" and seen["openai-project"] == "proj-2"
    assert seen["x-my-header"] == "mine"
    assert seen["authorization"] == "Bearer sk-upstream"  # the endpoint's own key, never the client's
    assert "cookie" not in seen and "x-secret-hop" not in seen
    assert seen["content-type"] == "application/json"


def test_forward_headers_config(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "forward_headers": {"deny": ["x-internal"]}})
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-internal": "1", "x-public": "2"})
    assert "x-internal" not in fake.requests[-1].headers and fake.requests[-1].headers["x-public"] == "2"


def test_headers_that_change_the_answer_are_part_of_the_cache_key(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "cache": {"backend": "memory", "vary_headers": ["OpenAI-Project"]}})
    body = {**CHAT, "temperature": 0}

    def ask(project: str) -> str:
        return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"openai-project": project}).headers["x-cache"]

    assert ask("a") == "MISS"
    assert ask("b") == "MISS"  # another project may get another answer upstream
    assert ask("a") == "HIT"
    assert len(fake.requests) == 2
