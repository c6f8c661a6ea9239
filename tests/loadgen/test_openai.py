"""The OpenAI side of the client without sockets: request bytes, and SSE/JSON answers read
whatever way the bytes are split across reads."""

from __future__ import annotations

import orjson
import pytest

from loadgen.http import BaseURL
from loadgen.openai import ErrorReader, JsonReader, RequestHead, StreamReader, error_message, make_reader


def chat_event(text: str | None = None, *, finish: str | None = None, usage: dict | None = None, reasoning: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    if reasoning is not None:
        delta = {"reasoning_content": reasoning, "content": None}
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    payload = {"id": "x", "object": "chat.completion.chunk", "choices": choices}
    if usage:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


STREAM = (
    b": ping\n\n"
    + chat_event("")  # the role chunk: no content
    + chat_event("Hel")
    + chat_event("lo")
    + chat_event(" world")
    + chat_event(finish="stop")
    + chat_event(usage={"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14})
    + b"data: [DONE]\n\n"
)


def feed_in_pieces(data: bytes, size: int) -> StreamReader:
    reader = StreamReader()
    for i in range(0, len(data), size):
        reader.feed(data[i : i + size], float(i))
    return reader


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_content_chunks_usage_and_done_whatever_the_read_sizes(size):
    reader = feed_in_pieces(STREAM, size)
    assert len(reader.times) == 3
    assert (reader.output_tokens, reader.input_tokens, reader.done) == (3, 11, True)
    assert reader.error is None and reader.bad is None and reader.buffer == b""


def test_each_content_chunk_is_stamped_with_the_read_that_completed_it():
    reader = StreamReader()
    first, second = chat_event("a"), chat_event("b")
    reader.feed(first[:10], 1.0)
    reader.feed(first[10:] + second[:5], 2.0)  # the first event ends in this read
    reader.feed(second[5:], 3.0)
    assert reader.times == [2.0, 3.0]


def test_crlf_line_ends_multi_line_data_and_comments():
    payload = orjson.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    data = b": keep-alive\r\n\r\nevent: message\r\ndata: " + payload[:20] + b"\r\ndata: " + payload[20:] + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    for size in (1, 3, len(data)):
        reader = feed_in_pieces(data, size)
        assert len(reader.times) == 1 and reader.done and reader.bad is None


def test_reasoning_tokens_count_as_output_and_completions_use_text():
    reader = StreamReader()
    reader.feed(chat_event(reasoning="thinking"), 1.0)
    completion = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "tok", "finish_reason": None}]}) + b"\n\n"
    reader.feed(completion, 2.0)
    reader.feed(b"data: " + orjson.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}) + b"\n\n", 3.0)
    assert reader.times == [1.0, 2.0]


@pytest.mark.parametrize(
    "event,message",
    [
        pytest.param({"error": {"message": "upstream went away", "type": "upstream_error"}}, "upstream went away", id="openai"),
        pytest.param({"object": "error", "message": "engine dead", "code": 500}, "engine dead", id="vllm"),
    ],
)
def test_an_error_event_is_recorded_with_its_message(event, message):
    reader = StreamReader()
    reader.feed(chat_event("a") + b"data: " + orjson.dumps(event) + b"\n\ndata: [DONE]\n\n", 1.0)
    assert reader.error == message and len(reader.times) == 1


def test_an_unparseable_event_makes_the_stream_bad():
    reader = StreamReader()
    reader.feed(b"data: {not json\n\n", 1.0)
    assert reader.bad is not None and "not JSON" in reader.bad


@pytest.mark.parametrize(
    "body,message",
    [
        pytest.param(b'{"error": {"message": "model not found", "type": "x"}}', "model not found", id="openai"),
        pytest.param(b'{"object": "error", "message": "too long", "code": 400}', "too long", id="vllm"),
        pytest.param(b'{"detail": "Not Found"}', "Not Found", id="fastapi"),
        pytest.param(b"<html>\n  Bad   Gateway\n</html>", "<html> Bad Gateway </html>", id="text"),
    ],
)
def test_error_messages_of_the_usual_servers(body, message):
    assert error_message(body) == message


def test_the_reader_follows_the_status_and_content_type():
    assert isinstance(make_reader(200, {"content-type": "text/event-stream; charset=utf-8"}), StreamReader)
    assert isinstance(make_reader(200, {"content-type": "application/json"}), JsonReader)
    assert isinstance(make_reader(429, {"content-type": "text/event-stream"}), ErrorReader)
    errors = ErrorReader()
    errors.feed(b"x" * 10_000, 0.0)
    assert len(errors.data) == 4096


@pytest.mark.parametrize(
    "url,prefix,authority,port",
    [
        pytest.param("http://127.0.0.1:8080/v1", "/v1", "127.0.0.1:8080", 8080, id="v1"),
        pytest.param("https://api.example.com/openai/v1/", "/openai/v1", "api.example.com", 443, id="https-prefix"),
        pytest.param("http://[::1]:9000/v1", "/v1", "[::1]:9000", 9000, id="ipv6"),
        pytest.param("http://host", "", "host", 80, id="bare"),
    ],
)
def test_base_urls_keep_their_prefix(url, prefix, authority, port):
    base = BaseURL.parse(url)
    assert (base.prefix, base.authority, base.port) == (prefix, authority, port)
    assert base.url("/chat/completions").endswith(prefix + "/chat/completions")


@pytest.mark.parametrize("url", ["ftp://x/v1", "127.0.0.1:8080/v1", "http:///v1", "http://x:99999/v1", "http://x/v1?key=1"])
def test_bad_base_urls_are_refused(url):
    with pytest.raises(ValueError):
        BaseURL.parse(url)


def test_request_head_user_headers_replace_defaults_and_cannot_inject():
    base = BaseURL.parse("https://api.example.com/openai/v1")
    head = RequestHead(base, "/chat/completions", {"authorization": "Bearer k", "User-Agent": "mine", "X-Trace": "1"}, stream=True)
    raw = head.encode(b'{"a":1}')
    lines = raw.split(b"\r\n")
    assert lines[0] == b"POST /openai/v1/chat/completions HTTP/1.1"
    assert b"host: api.example.com" in lines and b"authorization: Bearer k" in lines
    assert b"user-agent: mine" in lines and b"x-trace: 1" in lines and b"accept: text/event-stream" in lines
    assert raw.endswith(b'content-length: 7\r\n\r\n{"a":1}')
    with pytest.raises(ValueError, match="one line"):
        RequestHead(base, "/x", {"x-evil": "a\r\nhost: other"}, stream=False)
    with pytest.raises(ValueError, match="not a valid"):
        RequestHead(base, "/x", {"bad name": "v"}, stream=False)
