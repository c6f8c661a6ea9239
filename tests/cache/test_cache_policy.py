from __future__ import annotations

import pytest

from cache.policy import (
    Directives,
    is_complete_body,
    is_complete_stream,
    parse_cache_control,
    plan,
)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(None, Directives(), id="none"),
        pytest.param("", Directives(), id="empty"),
        pytest.param("no-cache", Directives(no_cache=True), id="no-cache"),
        pytest.param("No-Store", Directives(no_store=True), id="case"),
        pytest.param("max-age=30", Directives(max_age=30.0), id="max-age"),
        pytest.param('max-age="30"', Directives(max_age=30.0), id="quoted"),
        pytest.param("max-age=60, max-age=10", Directives(max_age=10.0), id="smallest-wins"),
        pytest.param(" no-cache , max-age=5 ", Directives(no_cache=True, max_age=5.0), id="spaces"),
        pytest.param("max-age=-1, max-age=abc", Directives(), id="malformed-ignored"),
        pytest.param("only-if-cached, private", Directives(only_if_cached=True), id="unknown"),
    ],
)
def test_parse_cache_control(header: str | None, expected: Directives) -> None:
    assert parse_cache_control(header) == expected


@pytest.mark.parametrize(
    ("body", "default_greedy", "lookup", "store", "reason"),
    [
        pytest.param({"temperature": 0}, True, True, True, "cacheable", id="t0"),
        pytest.param({"temperature": 0.0}, False, True, True, "cacheable", id="t0.0"),
        pytest.param({}, True, True, True, "cacheable", id="absent-greedy-default"),
        pytest.param({}, False, False, False, "nondeterministic", id="absent-sampling-default"),
        pytest.param({"temperature": 0.7}, True, False, False, "nondeterministic", id="sampling"),
        pytest.param({"temperature": 0.7, "seed": 42}, True, True, True, "cacheable", id="seed"),
        pytest.param({"temperature": 0, "n": 2}, True, False, False, "n>1", id="n2"),
        pytest.param({"seed": 1, "n": 3}, True, False, False, "n>1", id="n3-seed"),
        pytest.param({"temperature": 0, "n": 1}, True, True, True, "cacheable", id="n1"),
        pytest.param({"temperature": "0"}, True, False, False, "invalid", id="bad-temp"),
        pytest.param({"seed": "x"}, True, False, False, "invalid", id="bad-seed"),
    ],
)
def test_only_deterministic_requests_are_cached(body, default_greedy, lookup, store, reason) -> None:
    p = plan(body, Directives(), 60.0, default_greedy=default_greedy)
    assert (p.lookup, p.store, p.reason) == (lookup, store, reason)


def test_plan_cache_control() -> None:
    body = {"temperature": 0}
    p = plan(body, parse_cache_control("no-store"), 60.0)
    assert (p.lookup, p.store, p.reason) == (False, False, "no-store")
    p = plan(body, parse_cache_control("no-cache"), 60.0)
    assert (p.lookup, p.store, p.reason) == (False, True, "no-cache")
    p = plan(body, parse_cache_control("max-age=30"), 60.0)
    assert (p.lookup, p.store, p.max_age, p.ttl) == (True, True, 30.0, 60.0)
    p = plan(body, parse_cache_control("max-age=0"), 60.0)
    assert (p.lookup, p.store) == (False, True)
    p = plan(body, Directives(), 0.0)
    assert (p.lookup, p.store, p.reason) == (False, False, "ttl=0")
    # nondeterminism wins over no-cache: nothing is stored
    assert plan({"temperature": 1}, parse_cache_control("no-cache"), 60.0).store is False


def test_complete_body(chat_body: bytes) -> None:
    assert is_complete_body(chat_body)
    assert not is_complete_body(b'{"error": {"message": "boom", "type": "server_error"}}')
    assert not is_complete_body(b"not json")
    assert not is_complete_body(b'{"choices": []}')
    assert not is_complete_body(
        b'{"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": null}]}'
    )
    assert not is_complete_body(
        b'{"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "abort"}]}'
    )


def test_complete_stream(chat_chunks: list[bytes], completion_chunks: list[bytes]) -> None:
    assert is_complete_stream(chat_chunks)
    assert is_complete_stream(completion_chunks)
    assert not is_complete_stream(chat_chunks, saw_done=False)  # broken before [DONE]
    assert not is_complete_stream(chat_chunks[:3])  # no finish_reason
    assert not is_complete_stream([*chat_chunks[:2], b'{"error": {"message": "overloaded"}}'])
    assert not is_complete_stream([])
    assert not is_complete_stream([chat_chunks[0], b"{trunc"])
