"""Bad input gets an OpenAI-shaped error with the right status, and the worker lives on."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.conftest import cluster

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def gw(upstreams, gateways):
    fake = upstreams()
    return gateways({"clusters": [cluster(fake)], "limits": {"max_body_bytes": 4096}})


def assert_openai_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert "x-request-id" in response.headers
    assert response.headers["x-edgegw-route"].startswith("target=")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "content,param,code",
    [
        pytest.param(b"{not json", None, "invalid_json", id="malformed-json"),
        pytest.param(b"", None, "invalid_json", id="empty-body"),
        pytest.param(b"[1, 2]", None, "invalid_json", id="not-an-object"),
        pytest.param(b'{"messages": [{"role": "user", "content": "x"}]}', "model", "missing_required_parameter", id="no-model"),
        pytest.param(b'{"model": 7, "messages": []}', "model", "invalid_type", id="model-not-string"),
        pytest.param(b'{"model": "fake-model"}', "messages", "missing_required_parameter", id="no-messages"),
        pytest.param(b'{"model": "fake-model", "messages": "hi"}', "messages", "invalid_type", id="messages-not-list"),
        pytest.param(b'{"model": "fake-model", "messages": [{"content": "x"}]}', "messages.[0].role", "missing_required_parameter", id="no-role"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "hacker", "content": "x"}]}', "messages.[0].role", "invalid_value", id="role-unknown"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": 123}]}', "messages.[0].content", "invalid_type", id="content-number"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "pic"}]}]}', "messages.[0].content.[0]", "invalid_type", id="content-part"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stop": {}}', "stop", "invalid_type", id="stop-object"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}', "logprobs", "invalid_type", id="logprobs-string"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}', "top_logprobs", "invalid_value", id="top-logprobs"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "seed": "abc"}', "seed", "invalid_type", id="seed-string"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}}', "stream_options.include_usage", "invalid_type", id="stream-options"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 80 + b"]" * 80 + b"}", "body", "invalid_value", id="nested-too-deep"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "temperature": -1}', "temperature", "invalid_value", id="temperature"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p", "invalid_value", id="top-p"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens", "invalid_type", id="max-tokens"),
        pytest.param(b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream", "invalid_type", id="stream"),
    ],
)
def test_bad_requests_are_400(gw, content, param, code):
    response = httpx.post(gw.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400, param, code)
    assert error["type"] == "invalid_request_error"


def test_completion_needs_a_prompt(gw):
    response = httpx.post(gw.url + "/v1/completions", json={"model": "fake-model"})
    assert_openai_error(response, 400, "prompt", "missing_required_parameter")


def test_unknown_model_is_404(gw):
    response = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "no-such-model"})
    assert_openai_error(response, 404, "model", "model_not_found")


def test_body_over_the_limit_is_413(gw):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    response = httpx.post(gw.url + "/v1/chat/completions", json=big)
    assert_openai_error(response, 413, code="request_too_large")


def test_chunked_body_over_the_limit_is_413_while_still_sending(gw):
    """A chunked upload with no Content-Length is refused once it passes the limit: the
    answer comes while the client has not finished its body (it never sends the last chunk)."""
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        piece = b"x" * 1024
        for _ in range(6):  # 6 KiB against a 4 KiB limit, and no terminating chunk
            sock.sendall(b"400\r\n" + piece + b"\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b'"code":"request_too_large"' in answer


def test_a_body_that_does_not_arrive_in_time_is_408_and_holds_no_slot(upstreams, gateways):
    """A client that sends its headers and half a body, then nothing: after
    ``limits.body_timeout_s`` it gets a 408, and other requests were served meanwhile."""
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "limits": {"body_timeout_s": 0.5, "max_in_flight": 1}})
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        served = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)  # the slow body holds no slot
        answer = b""
        while not answer.endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert served.status_code == 200
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in answer


def test_unknown_route_and_method(gw):
    assert_openai_error_plain(httpx.get(gw.url + "/v1/nothing"), 404)
    assert_openai_error_plain(httpx.get(gw.url + "/v1/chat/completions"), 405)


def assert_openai_error_plain(response: httpx.Response, status: int) -> None:
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_worker_survives_garbage(gw):
    for content in (b"\xff\xfe\x00", b'{"model": null}', b"9" * 3000, b'{"model": "fake-model", "messages": [null]}'):
        httpx.post(gw.url + "/v1/chat/completions", content=content)
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_an_unexpected_failure_is_an_openai_500_and_the_worker_lives_on(gw, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(gw.state.dispatcher, "route", broken)
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    error = assert_openai_error(response, 500)
    assert "a bug" not in error["message"]  # internals stay in the log
    monkeypatch.undo()
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_a_body_that_says_it_is_not_json_is_415(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}'
    refused = httpx.post(gw.url + "/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.post(gw.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    assert not any(r.body.get("x") for r in fake.requests) and len(fake.requests) == 1


def test_a_trailing_slash_is_not_redirected_to_the_clients_host(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    response = httpx.get(gw.url + "/v1/models/", headers={"host": "evil.example"}, follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers
    assert response.json()["error"]["code"] == "not_found"
