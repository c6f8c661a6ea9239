"""One conformance suite against three real upstreams (``target``, tests/realworld/conftest.py):
llama.cpp's OpenAI server (llama-cpp-python), the project's own engine server, and an edgegw
tier (an edgegw process in front of the engine server), each behind an edgegw that probes it
and lists its models every 0.2 s, so that each test also checks that the gateway's own
traffic never disturbs a request (llama.cpp's server would cut the stream it is generating).

Generations are short (a few tokens) except where a test needs one to go on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.realworld.answers import ask
from tests.realworld.conftest import Target, wait_until
from tests.realworld.servers import MODEL, N_CTX

SHORT = 6  # max_tokens of the answers compared
PROMPTS = {"chat": "Name a colour.", "completion": "The capital of France is"}
OVER_CONTEXT = "word " * (N_CTX + 100)
RESET = "Zebras"  # each "word " is at least one token


def request(kind: str, text: str, *, stream: bool = False, max_tokens: int = SHORT, **extra) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": stream, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def breaker_state(target: Target) -> float:
    for line in httpx.get(target.gateway.url + "/metrics").text.splitlines():
        if line.startswith("edgegw_endpoint_breaker_state{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no breaker gauge")


@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="stream")])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_same_answer_direct_and_through_the_gateway(target, kind, stream):
    body = request(kind, PROMPTS[kind], stream=stream)
    # the server's prompt cache alike for the two compared: a prompt that shares not even its
    # first token with this one, then this one (llama.cpp's greedy text depends on which
    # part of a prompt it evaluated when: its KV values differ a little by batch)
    for base in (target.direct, target.base):
        assert ask(base, "completion", request("completion", RESET, max_tokens=1)).status == 200
        assert ask(base, kind, {**body, "max_tokens": 1}).status == 200
    direct = ask(target.direct, kind, body)
    through = ask(target.base, kind, body)
    assert direct.status == through.status == 200
    assert through.text and through.text == direct.text
    assert through.finish == direct.finish
    assert through.usage == direct.usage  # a stream's usage too, where the server sends one
    if stream:
        assert through.done and through.error is None and through.chunks >= 1
    else:
        assert through.usage is not None and through.usage["completion_tokens"] <= SHORT
    assert "x-edgegw-route" in through.headers


def test_a_client_that_leaves_mid_stream_stops_the_generation(target):
    """The client reads three tokens of a long answer and leaves: the upstream itself says it
    stopped before the 400 tokens it was asked for: llama.cpp's server logs that it stopped a
    stream early; the engine server, behind one gateway or two, dropped the sequence (nothing
    runs, and nothing finished: an aborted sequence is not counted as finished)."""
    mark = target.mark()
    body = request("chat", "Tell me a long story about a dragon.", stream=True, max_tokens=400, **target.long)
    tokens = 0
    with httpx.stream("POST", target.base + "/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                tokens += 1
                if tokens == 3:
                    break
    assert tokens == 3  # nothing cut it before the client left
    wait_until(lambda: target.stopped_since(mark), 15, f"{target.name} to stop generating")
    assert ask(target.base, "chat", request("chat", "hi")).status == 200


@pytest.mark.parametrize("stream", [pytest.param(False, id="json"), pytest.param(True, id="stream")])
def test_a_prompt_over_the_context_is_an_openai_error(target, stream):
    """llama.cpp's server answers a streamed prompt over its context with 200 and no event at
    all: the client gets an error event and [DONE]; the others refuse it with 400. Either way
    the SDK raises."""
    status, code = target.errors["over_context_stream" if stream else "over_context_json"]
    body = request("chat", OVER_CONTEXT, stream=stream)
    through = ask(target.base, "chat", body)
    assert through.status == status
    assert through.error is not None and through.error["code"] == code and through.error["message"]
    if status == 200:
        assert through.done and through.chunks == 0  # an error event, then [DONE]
        direct = ask(target.direct, "chat", body)
        assert direct.status == 200 and direct.error is None and not direct.done  # what the server sends
    with openai.OpenAI(base_url=target.base, api_key="unused", max_retries=0) as client, pytest.raises(openai.APIError):
        answer = client.chat.completions.create(**body)
        if stream:
            for _ in answer:
                pass


def test_a_bad_parameter_reaches_the_client_openai_shaped_and_ejects_nothing(target):
    """A ``logit_bias`` keyed by something that is no token id (the gateway checks only that
    its values are numbers), twelve times: the upstream's own status and error each time
    (llama.cpp's server: 500, a Python exception's text; the engine: 400, it takes no
    logit_bias); the endpoint's breaker stays closed and the next good request is served."""
    status, code = target.errors["bad_parameter"]
    body = request("chat", "hi", logit_bias={"abc": 1})
    direct = ask(target.direct, "chat", body)
    assert direct.status == status and direct.error is not None
    for _ in range(12):
        through = ask(target.base, "chat", body)
        assert through.status == status
        assert through.error == direct.error and set(through.error) == {"message", "type", "param", "code"}
        assert through.error["message"] and through.error["code"] == code
    assert breaker_state(target) == 0
    assert ask(target.base, "chat", request("chat", "hi")).status == 200


def test_concurrent_streams_and_the_gateways_own_traffic_never_disturb_each_other(target):
    """Three streams at once, while the gateway probes and lists the upstream every 0.2 s: each
    runs to its length (no end of sequence is allowed), none is cut, and the probes go on
    once they are done."""
    body = lambda text: request("chat", text, stream=True, max_tokens=8, **target.long)  # noqa: E731
    prompts = ["Name a colour.", "Name a fruit.", "Name a city."]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda text: ask(target.base, "chat", body(text)), prompts))
    for answer in answers:
        assert answer.status == 200 and answer.error is None, answer.error
        assert answer.done and answer.finish == "length" and answer.chunks >= 4
    after = target.probed_at() or 0.0
    wait_until(lambda: (target.probed_at() or 0.0) > after, 20, "a probe after the streams")
