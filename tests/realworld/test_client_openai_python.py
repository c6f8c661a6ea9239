"""The official ``openai`` Python SDK (pinned in the ``dev`` extra) as a client of edgegw in
front of llama.cpp's server: sync and async, streams, the model list, raw responses with the
gateway's headers, and its retries after a 429 honouring ``Retry-After``."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.realworld.conftest import front_config
from tests.realworld.servers import MODEL

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def sdk():
    """``sdk(base, max_retries=0)``: an ``openai.OpenAI`` client, closed after the test."""
    clients = []

    def make(base: str, max_retries: int = 0) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=base, api_key="unused", max_retries=max_retries, timeout=120))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def test_sync_chat_and_completions_whole_and_streamed(llama_target, sdk):
    client = sdk(llama_target.base)
    # once first: llama.cpp's greedy text depends on what it was asked last (its prompt cache)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6)
    assert answer.choices[0].message.content and answer.usage.completion_tokens <= 6
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == answer.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert text.choices[0].text and text.choices[0].finish_reason in ("length", "stop")


def test_the_model_list_and_one_model(llama_target, sdk):
    """``models.retrieve`` asks ``GET /v1/models/{id}`` (the route comes with the API-surface
    work of the ``api`` branch)."""
    client = sdk(llama_target.base)
    assert MODEL in [m.id for m in client.models.list()]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_raw_responses_carry_the_gateways_headers(llama_target, sdk):
    client = sdk(llama_target.base)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2)
    route = raw.headers["x-edgegw-route"]
    assert "target=" in route and llama_target.gateway.state.fleet.upstreams  # the endpoint it went to
    assert next(iter(llama_target.gateway.state.fleet.upstreams)) in route
    stages = {part.split(";", 1)[0].strip() for part in raw.headers["server-timing"].split(",")}
    assert {"admit", "route", "upstream", "total"} <= stages
    assert raw.parse().choices[0].message.content  # and the answer is still there
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2, stream=True
    ) as streamed:
        assert "x-edgegw-route" in streamed.headers and streamed.headers["content-type"].startswith("text/event-stream")
        assert b"data: [DONE]" in b"".join(streamed.iter_bytes())


def test_async_streams_side_by_side(llama_target):
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=llama_target.base, api_key="unused", max_retries=0, timeout=120)

        async def one(topic: str) -> str:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Name a {topic}."}], temperature=0, max_tokens=5,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(one("colour"), one("fruit"), one("city"))
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert all(texts), texts  # each whole: the gateway queued them for the one-at-a-time server


def count_429(gateway_url: str) -> float:
    total = 0.0
    for line in httpx.get(gateway_url + "/metrics").text.splitlines():
        if line.startswith("edgegw_requests_total{") and 'status="429"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_sdk_waits_what_retry_after_says_and_is_not_refused_twice(llama_reference, gateways, sdk):
    """6 requests a minute: the 7th is refused with 429 and a ``Retry-After`` that rounds
    the wait up (it was rounded to the nearest second, and the SDK, which waits exactly what
    it is told, came back too early for a second 429); the SDK retries once and is served.

    The limit is one request every 10 s with a minute's worth at once (GCRA): the 7th is
    refused only if the first six took less than 10 s, a bound a busy machine keeps (with 40
    a minute it was 1.5 s, and llama.cpp's first answer beside a CPU hog took longer)."""
    config = front_config(llama_reference.base, max_concurrency=1)
    gw = gateways({**config, "cache": {"backend": "memory"}, "auth": {"anonymous": {"requests_per_minute": 6}}})
    ask = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=2)
    plain = sdk(gw.url + "/v1")
    for _ in range(6):  # one answer from the server, then from the cache: the quota goes fast
        plain.chat.completions.create(**ask)
    assert count_429(gw.url) == 0
    served = sdk(gw.url + "/v1", max_retries=3).chat.completions.with_raw_response.create(**ask)
    assert served.http_response.status_code == 200
    assert served.retries_taken == 1 and count_429(gw.url) == 1
