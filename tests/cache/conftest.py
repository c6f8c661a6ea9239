"""Fixtures for the cache tests: a per-test Redis namespace on DB 15 (cleaned up), a fake
Redis that accepts connections and never answers, and OpenAI-shaped sample responses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/15"
CLOSED_URL = "redis://127.0.0.1:1/0"


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def namespace() -> Iterator[str]:
    """A unique key prefix; every key under it is deleted after the test."""
    ns = f"edgegw-test-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{ns}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def raw_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
async def silent_server() -> AsyncIterator[str]:
    """A TCP server that accepts connections and never answers: a hung Redis."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(-1)  # swallow everything until the client goes away

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    for w in writers:
        w.close()
    server.close()
    await server.wait_closed()


def dumps(doc: object) -> bytes:
    return orjson.dumps(doc)


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
_BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
         "model": "m1", "system_fingerprint": "fp_1"}


def _chat_chunk(delta: dict, finish: str | None = None, **extra: object) -> bytes:
    doc = dict(_BASE)
    doc["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    doc.update(extra)
    return dumps(doc)


@pytest.fixture
def chat_chunks() -> list[bytes]:
    """A chat stream as OpenAI sends it with include_usage (usage: null, then a usage chunk)."""
    return [
        _chat_chunk({"role": "assistant", "content": ""}, usage=None),
        _chat_chunk({"content": "Hello"}, usage=None),
        _chat_chunk({"content": ", world"}, usage=None),
        _chat_chunk({}, "stop", usage=None),
        dumps({**_BASE, "choices": [], "usage": USAGE}),
    ]


@pytest.fixture
def chat_body() -> bytes:
    return dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m1",
        "system_fingerprint": "fp_1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello, world"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
    })


@pytest.fixture
def tool_chunks() -> list[bytes]:
    return [
        _chat_chunk({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}]}),
        _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        _chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chat_chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                     "function": {"name": "get_time", "arguments": "{}"}}]}),
        _chat_chunk({}, "tool_calls"),
    ]


_CBASE = {"id": "cmpl-1", "object": "text_completion", "created": 1700000001, "model": "m2"}


@pytest.fixture
def completion_chunks() -> list[bytes]:
    lp1 = {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Hi": -0.1}],
           "text_offset": [0]}
    lp2 = {"tokens": [" there"], "token_logprobs": [-0.2], "top_logprobs": [{" there": -0.2}],
           "text_offset": [2]}
    return [
        dumps({**_CBASE, "choices": [{"index": 0, "text": "Hi", "logprobs": lp1,
                                      "finish_reason": None}]}),
        dumps({**_CBASE, "choices": [{"index": 0, "text": " there", "logprobs": lp2,
                                      "finish_reason": None}]}),
        dumps({**_CBASE, "choices": [{"index": 0, "text": "", "logprobs": None,
                                      "finish_reason": "length"}]}),
    ]
