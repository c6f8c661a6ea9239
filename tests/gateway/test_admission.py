"""Admission as a client meets it: keys and tenants (401, 403), tenant concurrency and rate
limits (429 with Retry-After and the OpenAI headers), and no key in any log line."""

from __future__ import annotations

import hashlib

import httpx
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from gateway.core.settings import AuthSettings, TenantSettings
from gateway.admission.tenants import Tenants
from tests.conftest import cluster

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
SECRET = "sk-acme-very-secret-1"


def tenants(**acme) -> list[dict]:
    return [
        {"name": "acme", "keys": [SECRET, "sha256:" + hashlib.sha256(b"sk-acme-2").hexdigest()], **acme},
        {"name": "other", "keys": ["sk-other"]},
    ]


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == type_
    if code is not None:
        assert error["code"] == code
    return error


def test_keys_plain_hashed_and_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACME_KEYS", "sk-env-1, sk-env-2")
    registry = Tenants(AuthSettings(mode="required"), (TenantSettings(name="acme", keys=["sk-a", "sha256:" + hashlib.sha256(b"sk-b").hexdigest()], keys_env="ACME_KEYS"),))
    for key in (b"sk-a", b"sk-b", b"sk-env-2"):
        assert registry.identify([(b"authorization", b"Bearer " + key)]).name == "acme"
    assert registry.identify([(b"x-api-key", b"sk-env-1")]).name == "acme"
    with pytest.raises(Exception) as caught:
        registry.identify([(b"authorization", b"Bearer sk-nope")])
    assert caught.value.status == 401


def test_required_keys(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "auth": {"mode": "required"}, "tenants": tenants()})
    url = gw.url + "/v1/chat/completions"
    assert_openai_error(httpx.post(url, json=CHAT), 401, "authentication_error", "invalid_api_key")
    assert_openai_error(httpx.post(url, json=CHAT, headers=bearer("sk-wrong")), 401, "authentication_error")
    assert httpx.post(url, json=CHAT, headers=bearer(SECRET)).status_code == 200
    assert httpx.post(url, json=CHAT, headers=bearer("sk-acme-2")).status_code == 200  # the sha256: form
    assert len(fake.requests) == 2
    assert all("authorization" not in r.headers for r in fake.requests)  # never forwarded
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'edgegw_requests_total{api="chat",status="200",tenant="acme"} 2.0' in metrics
    assert SECRET not in metrics
    # a WebSocket without a known key is refused at the handshake
    with pytest.raises(InvalidStatus):
        ws_connect(gw.url.replace("http", "ws") + "/v1/ws")


def test_optional_keys_and_models_a_tenant_may_not_use(upstreams, gateways):
    fake = upstreams(models=["fake-model", "secret-model"])
    config = {
        "clusters": [cluster(fake, models=("fake-model", "secret-model"))],
        "auth": {"mode": "optional", "anonymous": {"models": ["fake-model"]}},
        "tenants": tenants(models=["fake-model", "secret-model"]),
    }
    gw = gateways(config)
    url = gw.url + "/v1/chat/completions"
    assert httpx.post(url, json=CHAT).status_code == 200  # keyless: the anonymous tenant
    error = assert_openai_error(httpx.post(url, json={**CHAT, "model": "secret-model"}), 403, "invalid_request_error", "model_not_allowed")
    assert error["param"] == "model"
    assert httpx.post(url, json={**CHAT, "model": "secret-model"}, headers=bearer(SECRET)).status_code == 200
    assert_openai_error(httpx.post(url, json=CHAT, headers=bearer("sk-unknown")), 401, "authentication_error")


def test_rate_limits_answer_429_with_the_openai_headers(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "tenants": tenants(requests_per_minute=3, tokens_per_minute=100000)})
    url = gw.url + "/v1/chat/completions"
    answers = [httpx.post(url, json=CHAT, headers=bearer(SECRET)) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    ok = answers[0].headers
    assert ok["x-ratelimit-limit-requests"] == "3" and ok["x-ratelimit-remaining-requests"] == "2"
    assert ok["x-ratelimit-limit-tokens"] == "100000" and int(ok["x-ratelimit-remaining-tokens"]) < 100000
    assert ok["x-ratelimit-reset-requests"].endswith("s")
    refused = answers[3]
    assert_openai_error(refused, 429, "rate_limit_error", "rate_limit_exceeded_requests")
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(fake.requests) == 3  # the refused one never went upstream
    # another tenant has its own quota
    assert httpx.post(url, json=CHAT, headers=bearer("sk-other")).status_code == 200


def test_tokens_are_estimated_then_settled_with_the_real_usage(upstreams, gateways):
    fake = upstreams(tokens=8)  # the fake's usage: 5 prompt + 8 completion tokens
    gw = gateways({"clusters": [cluster(fake)], "tenants": tenants(tokens_per_minute=1000)})
    url = gw.url + "/v1/chat/completions"
    first = httpx.post(url, json={**CHAT, "max_tokens": 400}, headers=bearer(SECRET))
    charged = 1000 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert charged >= 400  # the estimate: the prompt plus max_tokens
    stream = httpx.post(url, json={**CHAT, "max_tokens": 400, "stream": True}, headers=bearer(SECRET))
    assert b'"usage"' not in stream.content  # asked for on the client's behalf, not shown to it
    assert fake.requests[-1].body["stream_options"] == {"include_usage": True}
    after = httpx.post(url, json={**CHAT, "max_tokens": 1}, headers=bearer(SECRET))
    # the two earlier answers were settled at 13 tokens each: far more than 2 x 400 is left
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > 1000 - 2 * 400


def test_a_tenants_concurrency_limit(upstreams, gateways):
    fake = upstreams(ttft=1.0)
    gw = gateways({"clusters": [cluster(fake)], "tenants": tenants(max_concurrency=1)})
    url = gw.url + "/v1/chat/completions"
    with httpx.Client(timeout=10) as client, client.stream("POST", url, json={**CHAT, "stream": True}, headers=bearer(SECRET)):
        second = httpx.post(url, json=CHAT, headers=bearer(SECRET))
        assert_openai_error(second, 429, "rate_limit_error", "concurrency_limit_exceeded")
        assert second.headers["retry-after"] == "1"
        assert httpx.post(url, json=CHAT, headers=bearer("sk-other")).status_code == 200


def test_no_key_reaches_a_log_line(upstreams, gateway_processes):
    fake = upstreams(tokens=2)
    gw = gateway_processes(
        {
            "clusters": [cluster(fake)],
            "listen": {"log_level": "debug", "access_log": True},
            "auth": {"mode": "optional"},
            "tenants": tenants(),
        }
    )
    url = gw.url + "/v1/chat/completions"
    httpx.post(url, json=CHAT, headers=bearer(SECRET))
    httpx.post(url, json=CHAT, headers={"x-api-key": SECRET})
    httpx.post(url, json=CHAT, headers=bearer("sk-guess-that-is-wrong"))
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers=bearer(SECRET)) as ws:
        ws.send(orjson.dumps(CHAT).decode())
        while orjson.loads(ws.recv(timeout=10)).get("type") != "done":
            pass
    gw.stop()
    log = gw.log.read_text()
    assert "tenant=acme" in log  # the access log names the tenant
    for secret in (SECRET, "sk-guess-that-is-wrong"):
        assert secret not in log, [line for line in log.splitlines() if secret in line][:3]


def test_keys_from_a_file_as_a_mounted_secret_gives_them(tmp_path):
    keys = tmp_path / "acme"
    keys.write_text("sk-file-1\nsk-file-2, sk-file-3\n")
    registry = Tenants(AuthSettings(mode="required"), (TenantSettings(name="acme", keys_file=str(keys)),))
    for key in (b"sk-file-1", b"sk-file-2", b"sk-file-3"):
        assert registry.identify([(b"authorization", b"Bearer " + key)]).name == "acme"
    with pytest.raises(ValueError, match="not a readable file"):
        TenantSettings(name="acme", keys_file=str(tmp_path / "missing"))
