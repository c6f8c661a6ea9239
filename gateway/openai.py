"""The OpenAI request parser: the body parsed once (orjson), and the fields the gateway
itself interprets checked.

Only the fields that routing, caching and relaying need are looked at; the body bytes are
forwarded unchanged unless a field has to be rewritten (``with_fields``).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import InvalidRequest

__all__ = ["CHAT", "COMPLETION", "ParsedRequest", "kind_of", "parse_request"]

CHAT = "chat"
COMPLETION = "completion"

_NUMBER = (int, float)


class ParsedRequest:
    __slots__ = ("kind", "data", "body", "model", "stream", "include_usage")

    def __init__(self, kind: str, data: dict[str, Any], body: bytes) -> None:
        self.kind = kind
        self.data = data
        self.body = body
        self.model: str = data["model"]
        self.stream: bool = data.get("stream") is True
        options = data.get("stream_options")
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))

    def with_fields(self, **fields: Any) -> ParsedRequest:
        """A copy with fields rewritten (and the body re-serialised)."""
        data = {**self.data, **fields}
        return ParsedRequest(self.kind, data, orjson.dumps(data))


def kind_of(data: Any) -> str:
    """The API a bare request body is for (a WebSocket message has no path): a completion
    when it has ``prompt`` and no ``messages``, else chat."""
    if isinstance(data, dict) and "prompt" in data and "messages" not in data:
        return COMPLETION
    return CHAT


def parse_request(kind: str | None, body: bytes) -> ParsedRequest:
    """Parse and check ``body`` for the API ``kind`` (None: inferred, ``kind_of``)."""
    if not body:
        raise InvalidRequest("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if kind is None:
        kind = kind_of(data)
    model = data.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", param="model", code="invalid_type")
    if kind == CHAT:
        _check_messages(data.get("messages"))
    else:
        prompt = data.get("prompt")
        if prompt is None:
            raise InvalidRequest("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
        if not isinstance(prompt, (str, list)):
            raise InvalidRequest("prompt must be a string or an array", param="prompt", code="invalid_type")
    _check_type(data, "stream", bool)
    _check_type(data, "stream_options", dict)
    _check_range(data, "temperature", 0.0, 2.0)
    _check_range(data, "top_p", 0.0, 1.0, low_open=True)
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidRequest(f"{name} must be an integer of at least 1", param=name, code="invalid_value")
    return ParsedRequest(kind, data, body)


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise InvalidRequest("you must provide a messages parameter", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages", code="invalid_type")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{index}] must be an object with a string role",
                param=f"messages.[{index}].role",
                code="invalid_type",
            )


def _check_type(data: dict, name: str, kind: type) -> None:
    value = data.get(name)
    if value is not None and not isinstance(value, kind):
        raise InvalidRequest(f"{name} must be of type {kind.__name__}", param=name, code="invalid_type")


def _check_range(data: dict, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    value = data.get(name)
    if value is None:
        return
    if not isinstance(value, _NUMBER) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number", param=name, code="invalid_type")
    if value < low or value > high or (low_open and value == low):
        bounds = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise InvalidRequest(f"{name} must be in {bounds}, got {value}", param=name, code="invalid_value")
