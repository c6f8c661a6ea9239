"""The other OpenAI APIs, forwarded by model (issue 22): ``/v1/embeddings`` (cached: it is
deterministic), ``/v1/responses`` and ``/v1/messages`` (streams relayed as SSE),
``/v1/moderations``, ``/v1/rerank``, ``/v1/audio/*`` (multipart forms), ``/v1/images/*`` and
the configured ``passthrough`` paths, each to the cluster serving the model, with the same
admission, rate limits, accounting and header forwarding as chat.

``/v1/embeddings`` is also tested against llama.cpp's server started with embeddings
enabled (tests/realworld/test_embeddings.py); no server here serves the others, so these
tests use two scripted upstreams (``Scripted``, also for routing by model) answering as the
real servers do: OpenAI's embeddings list with ``usage.prompt_tokens``/``total_tokens`` (what
llama.cpp's and vLLM's servers send), the Responses API's named SSE events
(``event: response.output_text.delta``...) ending without ``[DONE]``, Anthropic's Messages
stream (``event: message_start`` ... ``message_stop``), Whisper-style transcriptions from a
multipart form.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest
import uvicorn

from tests.fakes import free_port

MODELS = {"embed-a": "one", "embed-b": "two", "gpt-x": "one", "claude-x": "two", "whisper-x": "one"}


class Scripted:
    """An OpenAI-compatible server for the pass-through APIs on 127.0.0.1 (see the module
    docstring for what it copies); ``seen`` records (path, headers, body) of each POST."""

    def __init__(self, name: str, models: list[str]) -> None:
        self.name = name
        self.models = models
        self.seen: list[tuple[str, dict, bytes]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off", interface="asgi3"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Scripted:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "scripted upstream did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def app(self, scope, receive, send) -> None:
        path = scope["path"]
        if scope["method"] == "GET":
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "scripted"} for m in self.models]
            return await _send(send, 200, orjson.dumps({"object": "list", "data": data}))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((path, headers, body))
        if path == "/v1/audio/transcriptions":
            return await _send(send, 200, orjson.dumps({"text": f"{self.name} heard {len(body)} bytes"}))
        if path == "/v1/audio/speech":
            return await _send(send, 200, b"ID3\x04fake-mp3-bytes", b"audio/mpeg")
        data = orjson.loads(body)
        model = data["model"]
        if path == "/v1/embeddings":
            inputs = data["input"] if isinstance(data["input"], list) else [data["input"]]
            vectors = [{"object": "embedding", "index": i, "embedding": [len(t) / 10, 0.5, -0.25]} for i, t in enumerate(inputs)]
            tokens = sum(len(t.split()) for t in inputs)
            answer = {"object": "list", "data": vectors, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
            return await _send(send, 200, orjson.dumps(answer))
        if path == "/v1/responses" and data.get("stream"):
            events = [
                ("response.created", {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}),
                ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hel"}),
                ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "lo"}),
                ("response.completed", {"type": "response.completed", "response": {"id": "resp_1", "status": "completed",
                                        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}}),
            ]
            return await _stream(send, events)
        if path == "/v1/responses":
            answer = {"id": "resp_1", "object": "response", "model": model, "status": "completed",
                      "output": [{"type": "message", "content": [{"type": "output_text", "text": f"{self.name} says hi"}]}],
                      "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}
            return await _send(send, 200, orjson.dumps(answer))
        if path == "/v1/messages":
            events = [
                ("message_start", {"type": "message_start", "message": {"id": "msg_1", "model": model, "usage": {"input_tokens": 4, "output_tokens": 0}}}),
                ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
                ("message_stop", {"type": "message_stop"}),
            ]
            return await _stream(send, events)
        return await _send(send, 200, orjson.dumps({"path": path, "model": model, "served_by": self.name}))


async def _send(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _stream(send, events: list[tuple[str, dict]]) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    for name, payload in events:
        await send({"type": "http.response.body", "body": f"event: {name}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def fleet(gateways):
    started = []

    def start(**config):
        one = Scripted("one", [m for m, s in MODELS.items() if s == "one"]).start()
        two = Scripted("two", [m for m, s in MODELS.items() if s == "two"]).start()
        started.extend((one, two))
        clusters = [
            {"name": "one", "models": one.models, "endpoints": [{"url": one.url}]},
            {"name": "two", "models": two.models, "endpoints": [{"url": two.url}]},
        ]
        gw = gateways({"clusters": clusters, **config})
        started.insert(0, gw)  # stopped before its upstreams
        return one, two, gw

    yield start
    for thing in started:
        thing.stop()


def test_embeddings_go_by_model_and_a_repeat_is_a_cache_hit(fleet):
    one, two, gw = fleet(cache={"backend": "memory"})
    body = {"model": "embed-b", "input": ["a b c", "d e"]}
    first = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=10)
    assert first.status_code == 200, first.text
    assert [d["index"] for d in first.json()["data"]] == [0, 1]
    assert first.headers["x-cache"] == "MISS" and "cluster=two" in first.headers["x-edgegw-route"]
    assert [p for p, _, _ in two.seen] == ["/v1/embeddings"] and not one.seen
    assert orjson.loads(two.seen[0][2]) == body  # the body as the client sent it
    again = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=10)
    assert again.headers["x-cache"] == "HIT" and again.json() == first.json()
    assert len(two.seen) == 1
    other = httpx.post(gw.url + "/v1/embeddings", json={"model": "embed-a", "input": "x"}, timeout=10)
    assert other.status_code == 200 and len(one.seen) == 1


def test_unknown_model_and_bad_bodies_are_openai_errors(fleet):
    one, two, gw = fleet()
    missing = httpx.post(gw.url + "/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    no_model = httpx.post(gw.url + "/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["code"] == "missing_required_parameter"
    bad = httpx.post(gw.url + "/v1/responses", content=b"{", headers={"content-type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert not one.seen and not two.seen


@pytest.mark.parametrize("path", ["/v1/moderations", "/v1/rerank", "/v1/images/generations", "/v1/score"])
def test_other_apis_and_configured_paths_are_forwarded(fleet, path):
    one, two, gw = fleet(passthrough=["/v1/score"])
    response = httpx.post(gw.url + path, json={"model": "gpt-x", "input": "x"}, headers={"openai-project": "p1"}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json() == {"path": path, "model": "gpt-x", "served_by": "one"}
    sent_path, headers, _ = one.seen[-1]
    assert sent_path == path and headers["openai-project"] == "p1"  # end-to-end headers forwarded as for chat
    assert "authorization" not in headers


def test_an_unlisted_path_is_not_forwarded(fleet):
    one, two, gw = fleet()
    assert httpx.post(gw.url + "/v1/score", json={"model": "gpt-x"}, timeout=10).status_code == 404
    assert not one.seen


def test_responses_and_messages_streams_are_relayed_as_sse(fleet):
    one, two, gw = fleet()
    with httpx.stream("POST", gw.url + "/v1/responses", json={"model": "gpt-x", "input": "hi", "stream": True}, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert "event: response.output_text.delta" in text and text.index('"Hel"') < text.index('"lo"')
    assert "event: response.completed" in text
    assert "stream_options" not in orjson.loads(one.seen[-1][2])  # nothing chat-only added to another API
    with httpx.stream("POST", gw.url + "/v1/messages", json={"model": "claude-x", "max_tokens": 5, "stream": True,
                                                            "messages": [{"role": "user", "content": "hi"}]},
                      headers={"x-api-key": "sk-client", "anthropic-version": "2023-06-01"}, timeout=10) as r:
        text = r.read().decode()
    assert text.startswith("event: message_start") and "event: message_stop" in text
    _, headers, _ = two.seen[-1]
    assert headers["anthropic-version"] == "2023-06-01" and "x-api-key" not in headers  # the client's key stays here
    whole = httpx.post(gw.url + "/v1/responses", json={"model": "gpt-x", "input": "hi"}, timeout=10)
    assert whole.json()["output"][0]["content"][0]["text"] == "one says hi"


def test_audio_forms_go_by_their_model_field_unchanged(fleet):
    one, two, gw = fleet()
    audio = b"RIFF" + bytes(range(256)) * 40
    response = httpx.post(
        gw.url + "/v1/audio/transcriptions",
        data={"model": "whisper-x", "language": "en"},
        files={"file": ("clip.wav", audio, "audio/wav")},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    path, headers, body = one.seen[-1]
    assert path == "/v1/audio/transcriptions" and headers["content-type"].startswith("multipart/form-data; boundary=")
    assert audio in body and b'name="language"' in body
    assert response.json()["text"] == f"one heard {len(body)} bytes"
    speech = httpx.post(gw.url + "/v1/audio/speech", json={"model": "whisper-x", "input": "hi", "voice": "x"}, timeout=10)
    assert speech.status_code == 200 and speech.headers["content-type"] == "audio/mpeg" and speech.content.startswith(b"ID3")
    no_model = httpx.post(gw.url + "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF", "audio/wav")}, timeout=10)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"


def test_keys_rate_limits_and_token_accounting_apply(fleet):
    one, two, gw = fleet(
        auth={"mode": "required"},
        tenants=[{"name": "acme", "keys": ["sk-acme"], "requests_per_minute": 1, "tokens_per_minute": 100000, "models": ["embed-a"]}],
    )
    url = gw.url + "/v1/embeddings"
    assert httpx.post(url, json={"model": "embed-a", "input": "x"}, timeout=10).status_code == 401
    key = {"authorization": "Bearer sk-acme"}
    assert httpx.post(url, json={"model": "embed-b", "input": "x"}, headers=key, timeout=10).status_code == 403
    ok = httpx.post(url, json={"model": "embed-a", "input": "one two three"}, headers=key, timeout=10)
    assert ok.status_code == 200 and ok.headers["x-ratelimit-remaining-requests"]
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 100000
    limited = httpx.post(url, json={"model": "embed-a", "input": "x"}, headers=key, timeout=10)
    assert limited.status_code == 429 and "retry-after" in limited.headers
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'api="embeddings"' in metrics
