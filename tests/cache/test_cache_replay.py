from __future__ import annotations

import orjson
import pytest

from cache.base import Entry
from cache.memory import MemoryCache
from cache.replay import as_chunks, as_json, chunks_to_json, is_usage_chunk, json_to_chunks

USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def test_chunks_to_json_chat(chat_chunks: list[bytes], chat_body: bytes) -> None:
    assert chunks_to_json("chat", chat_chunks) == orjson.loads(chat_body)


def test_chunks_to_json_merges_tool_call_deltas(tool_chunks: list[bytes]) -> None:
    doc = chunks_to_json("chat", tool_chunks)
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    assert "usage" not in doc


def test_chunks_to_json_completion_with_logprobs(completion_chunks: list[bytes]) -> None:
    doc = chunks_to_json("completions", completion_chunks)
    assert doc["object"] == "text_completion"
    assert doc["id"] == "cmpl-1" and doc["model"] == "m2"
    (choice,) = doc["choices"]
    assert choice["text"] == "Hi there"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Hi": -0.1}, {" there": -0.2}], "text_offset": [0, 2],
    }


def test_chat_logprobs_are_concatenated() -> None:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [
        orjson.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                      "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}, "finish_reason": None}]}),
        orjson.dumps({**base, "choices": [{"index": 0, "delta": {"content": "b"},
                      "logprobs": {"content": [{"token": "b", "logprob": -2.0}]}, "finish_reason": "stop"}]}),
    ]
    (choice,) = chunks_to_json("chat", chunks)["choices"]
    assert choice["message"]["content"] == "ab"
    assert choice["logprobs"] == {"content": [{"token": "a", "logprob": -1.0},
                                              {"token": "b", "logprob": -2.0}]}


def test_json_to_chunks_chat_shape(chat_body: bytes) -> None:
    chunks = [orjson.loads(c) for c in json_to_chunks("chat", chat_body, include_usage=False)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["id"] == "chatcmpl-1" and c["model"] == "m1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Hello, world"}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert not any("usage" in c for c in chunks)
    with_usage = json_to_chunks("chat", chat_body, include_usage=True)
    assert orjson.loads(with_usage[-1]) == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
        "model": "m1", "system_fingerprint": "fp_1", "choices": [], "usage": USAGE,
    }
    assert all(orjson.loads(c)["usage"] is None for c in with_usage[:-1])


@pytest.mark.parametrize("fixture", ["chat_chunks", "tool_chunks", "completion_chunks"])
def test_round_trips(fixture: str, request: pytest.FixtureRequest) -> None:
    chunks = request.getfixturevalue(fixture)
    kind = "completions" if fixture.startswith("completion") else "chat"
    doc = chunks_to_json(kind, chunks)
    # JSON -> chunks -> JSON is the identity, with or without a usage chunk
    assert chunks_to_json(kind, json_to_chunks(kind, orjson.dumps(doc), True)) == doc
    without = chunks_to_json(kind, json_to_chunks(kind, doc, False))
    assert without == {k: v for k, v in doc.items() if k != "usage"}


async def test_streamed_then_non_streamed(chat_chunks: list[bytes], chat_body: bytes) -> None:
    cache = MemoryCache(1 << 20, 1 << 16)
    await cache.set("k", Entry(kind="chat", chunks=chat_chunks), ttl=60)
    hit = await cache.get("k")
    assert hit is not None
    assert orjson.loads(as_json(hit)) == orjson.loads(chat_body)


async def test_non_streamed_then_streamed(chat_body: bytes) -> None:
    cache = MemoryCache(1 << 20, 1 << 16)
    await cache.set("k", Entry(kind="chat", body=chat_body), ttl=60)
    hit = await cache.get("k")
    assert hit is not None
    assert as_json(hit) == chat_body  # stored JSON comes back verbatim
    chunks = as_chunks(hit, include_usage=True)
    assert chunks_to_json("chat", chunks) == orjson.loads(chat_body)
    assert is_usage_chunk(chunks[-1])
    assert not any(is_usage_chunk(c) for c in as_chunks(hit, include_usage=False))


def test_stream_replay_is_byte_faithful() -> None:
    # odd spacing, key order and escapes: a re-serialisation would change these bytes
    chunks = [
        b'{"object":"chat.completion.chunk", "id":"x","choices":[{"delta":{"role":"assistant","content":"caf\\u00e9"},"index":0}]}',
        b'{"choices":[{"index":0,"delta":{"content":" \xf0\x9f\x98\x80 1.0e0"},"finish_reason":null}],"id":"x"}',
        b'{"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        b'{"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}',
    ]
    entry = Entry(kind="chat", chunks=list(chunks))
    assert as_chunks(entry, include_usage=True) == chunks
    assert as_chunks(entry, include_usage=False) == chunks[:3]
    assert Entry.from_bytes(entry.to_bytes()).chunks == chunks
    assert chunks_to_json("chat", chunks)["choices"][0]["message"]["content"] == "café 😀 1.0e0"


def test_usage_chunk_rules(chat_chunks: list[bytes]) -> None:
    no_usage_stream = [c for c in chat_chunks if not is_usage_chunk(c)]
    # stream stored without usage, client asks: nothing to emit
    assert as_chunks(Entry(kind="chat", chunks=no_usage_stream), True) == no_usage_stream
    # stream stored with usage, client did not ask: omitted
    assert as_chunks(Entry(kind="chat", chunks=chat_chunks), False) == no_usage_stream
    # usage only on the last content chunk (continuous usage stats): synthesised when asked
    last = orjson.loads(no_usage_stream[-1])
    last["usage"] = USAGE
    stats_stream = [*no_usage_stream[:-1], orjson.dumps(last)]
    replay = as_chunks(Entry(kind="chat", chunks=stats_stream), True)
    assert replay[:-1] == stats_stream
    assert orjson.loads(replay[-1])["choices"] == [] and orjson.loads(replay[-1])["usage"] == USAGE


def test_completion_json_to_chunks() -> None:
    body = {"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}],
            "usage": USAGE}
    chunks = [orjson.loads(c) for c in json_to_chunks("completions", orjson.dumps(body), True)]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert chunks[0]["choices"][0]["text"] == "abc"
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[2]["choices"] == [] and chunks[2]["usage"] == USAGE


def test_entry_serialisation_round_trip(chat_body: bytes, chat_chunks: list[bytes]) -> None:
    for entry in (Entry(kind="chat", body=chat_body, created_at=123.5),
                  Entry(kind="chat", chunks=chat_chunks, created_at=99.0),
                  Entry(kind="completions", chunks=[], created_at=1.0)):
        assert Entry.from_bytes(entry.to_bytes()) == entry
    with pytest.raises(ValueError):
        Entry.from_bytes(b"garbage")
    with pytest.raises(ValueError):
        Entry.from_bytes(Entry(kind="chat", body=b"{}").to_bytes() + b"x")
    for broken in (b"EGW1", Entry(kind="chat", chunks=[b"abc"]).to_bytes()[:-1], b""):
        with pytest.raises(ValueError):
            Entry.from_bytes(broken)
    with pytest.raises(ValueError):
        Entry(kind="chat")
