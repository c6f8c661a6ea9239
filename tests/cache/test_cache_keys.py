from __future__ import annotations

import pytest

from cache.keys import canonical_body, make_key

BODY = {
    "model": "m1",
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "temperature": 0,
    "max_tokens": 64,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {}}}}],
}


def test_key_shape_has_version_and_kind() -> None:
    key = make_key("t1", "chat", BODY)
    assert key.startswith("v1:chat:")
    assert len(key.split(":")[2]) == 64
    assert make_key("t1", "chat", BODY) == key  # stable


def test_field_order_does_not_matter() -> None:
    reordered = dict(reversed(list(BODY.items())))
    reordered["tools"] = [{"function": {"parameters": {"properties": {}, "type": "object"},
                                        "name": "f"}, "type": "function"}]
    reordered["messages"] = [{"content": "be brief", "role": "system"},
                             {"content": "hi", "role": "user"}]
    assert make_key("t1", "chat", reordered) == make_key("t1", "chat", BODY)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"stream": True}, id="stream"),
        pytest.param({"stream": True, "stream_options": {"include_usage": True}}, id="stream-usage"),
        pytest.param({"user": "alice"}, id="user"),
        pytest.param({"metadata": {"trace": "x"}}, id="metadata"),
        pytest.param({"request_id": "r-123"}, id="request-id"),
        pytest.param({"stop": None, "seed": None}, id="nulls"),
        pytest.param({"n": 1}, id="n=1"),
    ],
)
def test_fields_that_do_not_change_the_answer_are_ignored(extra: dict) -> None:
    assert make_key("t1", "chat", {**BODY, **extra}) == make_key("t1", "chat", BODY)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"temperature": 0.5}, id="temperature"),
        pytest.param({"max_tokens": 65}, id="max_tokens"),
        pytest.param({"model": "m2"}, id="model"),
        pytest.param({"seed": 1}, id="seed"),
        pytest.param({"stop": ["\n"]}, id="stop"),
        pytest.param({"response_format": {"type": "json_object"}}, id="response_format"),
        pytest.param({"tools": []}, id="tools"),
        pytest.param({"messages": [{"role": "user", "content": "hi!"}]}, id="messages"),
        pytest.param({"logprobs": True}, id="logprobs"),
        pytest.param({"max_tokens": True}, id="bool-is-not-1"),
    ],
)
def test_semantic_fields_change_the_key(change: dict) -> None:
    assert make_key("t1", "chat", {**BODY, **change}) != make_key("t1", "chat", BODY)


def test_numbers_are_normalised() -> None:
    assert make_key("t", "chat", {**BODY, "temperature": 0.0}) == make_key("t", "chat", BODY)
    assert make_key("t", "chat", {**BODY, "temperature": -0.0}) == make_key("t", "chat", BODY)
    assert make_key("t", "chat", {**BODY, "max_tokens": 64.0}) == make_key("t", "chat", BODY)
    assert make_key("t", "chat", {**BODY, "top_p": 0.9}) != make_key("t", "chat", {**BODY, "top_p": 0.90001})


def test_stop_string_equals_single_item_list() -> None:
    assert make_key("t", "chat", {**BODY, "stop": "END"}) == make_key("t", "chat", {**BODY, "stop": ["END"]})


def test_tenants_never_share_an_entry() -> None:
    assert make_key("tenant-a", "chat", BODY) != make_key("tenant-b", "chat", BODY)
    # no ambiguity from concatenation: ("ab", "c...") vs ("a", "bc...")
    assert make_key("ab", "chat", BODY) != make_key("a", "chat", {**BODY, "model": "bm1"})


def test_route_kind_is_part_of_the_key() -> None:
    body = {"model": "m1", "prompt": "hi", "temperature": 0}
    assert make_key("t", "chat", body) != make_key("t", "completions", body)
    with pytest.raises(ValueError):
        make_key("t", "images", body)


def test_canonical_body_is_sorted_compact_json() -> None:
    assert canonical_body({"b": 1.0, "a": [0.0, 1.5], "stream": True, "x": None}) == b'{"a":[0,1.5],"b":1}'
