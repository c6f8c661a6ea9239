"""What llama.cpp's server (llama-cpp-python) does that the conformance suite cannot ask of
every upstream, each seen on the real server first, then through the gateway:

- it answers 400 with an empty body to any ``x-request-id`` that is not a UUID;
- with its default ``interrupt_requests``, any new request ends the generation in progress.

A gateway of a test's own goes in front of ``llama_reference``, never of ``llama_server``:
that one has the suite's gateway in front, whose probes would cut another gateway's streams
(a gateway knows only its own requests).
"""

from __future__ import annotations

import threading

import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import ws_answer
from tests.realworld.answers import Answer, ask, payloads
from tests.realworld.conftest import front_config
from tests.realworld.servers import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 4}
LONG = {**CHAT, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200, "logit_bias": {"2": -100}}


def test_a_clients_own_request_id_is_not_what_llama_cpp_gets(llama_reference, llama_target):
    direct = httpx.post(llama_reference.base + "/chat/completions", json=CHAT, headers={"x-request-id": "my-req-1"}, timeout=60)
    assert direct.status_code == 400 and direct.content == b""  # the server's own answer
    through = httpx.post(llama_target.base + "/chat/completions", json=CHAT, headers={"x-request-id": "my-req-1"}, timeout=60)
    assert through.status_code == 200 and through.headers["x-request-id"] == "my-req-1"


def test_its_empty_400_reaches_the_client_as_an_openai_error(llama_reference, gateways):
    """With ``request_id: passthrough`` the client's own id goes up and the server refuses it
    with an empty body: the client gets an OpenAI error with a message, over HTTP, in the SDK
    (which once reported ``Error code: 400`` and a body of ``None``) and over a WebSocket."""
    gw = gateways(front_config(llama_reference.base, max_concurrency=1, request_id="passthrough"))
    response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "my-req-1"}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the upstream answered 400 with no body"
    headers = {"x-request-id": "my-req-1"}
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, default_headers=headers) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**CHAT)
    assert caught.value.body["message"] == "the upstream answered 400 with no body"
    with ws_connect(gw.url.replace("http", "ws") + "/v1/ws", additional_headers={"x-request-id": "my-req-1"}) as ws:
        ws.send(orjson.dumps(CHAT).decode())
        (message,) = ws_answer(ws)
    assert message["type"] == "error" and message["status"] == 400 and message["error"]["message"]


def test_every_request_on_a_websocket_gets_an_id_it_accepts(llama_target):
    """The socket's second and third requests were once sent as ``<id>.2``, ``<id>.3``."""
    url = llama_target.gateway.url.replace("http", "ws") + "/v1/ws"
    with ws_connect(url, additional_headers={"x-request-id": "sock-1"}) as ws:
        for _ in range(3):
            ws.send(orjson.dumps(CHAT).decode())
            assert ws_answer(ws)[-1]["type"] == "done"


def _stream_then_interrupt(base: str) -> tuple[Answer, Answer]:
    """A long stream to ``base``; once its first token is in, a second request: (first, second)."""
    second: list[Answer] = []
    other = threading.Thread(target=lambda: second.append(ask(base, "chat", CHAT)))
    body = b""
    with httpx.stream("POST", base + "/chat/completions", json={**LONG, "stream": True}, timeout=120) as response:
        try:
            for piece in response.iter_raw():
                body += piece
                if not other.is_alive() and not second and b'"content"' in body:
                    other.start()
        except httpx.RemoteProtocolError:
            pass  # the server may end the interrupted stream without finishing its body
    other.join(60)
    first = Answer(response.status_code)
    for payload in payloads(body):
        if payload == b"[DONE]":
            first.done = True
        elif b'"error"' in payload:
            first.error = orjson.loads(payload)["error"]
        else:
            for choice in orjson.loads(payload).get("choices") or []:
                first.finish = choice.get("finish_reason") or first.finish
    return first, second[0]


def test_a_second_request_cuts_the_first_and_the_gateway_says_so(llama_reference, gateways):
    """Directly, the interrupted stream just stops: no finish_reason, no error. Through a
    gateway that lets both go at once (no ``max_concurrency``), the client is told with an
    error event before [DONE] (``upstream_stream_cut``, or the broken-stream error when the
    server drops the body); the second is served. The front gateway of the conformance suite
    queues them instead (``max_concurrency: 1``), and none is cut."""
    first, second = _stream_then_interrupt(llama_reference.base)
    assert first.status == 200 and first.finish is None and first.error is None  # silently short
    assert second.status == 200
    gw = gateways(front_config(llama_reference.base))
    first, second = _stream_then_interrupt(gw.url + "/v1")
    assert first.status == 200 and first.finish is None and first.done
    assert first.error is not None and first.error["message"], first
    assert second.status == 200
