"""The OpenAI request parser: the body parsed once (orjson), and the fields checked by the
same rules the edge engine applies (``edge_engine.openai_fields``: one validator, naming
the parameter).

Fields the gateway does not interpret pass through untouched: the body bytes are forwarded
unchanged unless a field has to be rewritten (``with_fields``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from edge_engine.errors import InvalidRequestError
from edge_engine.openai_fields import check_request
from gateway.core.errors import InvalidRequest

__all__ = ["CHAT", "COMPLETIONS", "LARGE", "ParsedRequest", "kind_of", "parse_request"]

CHAT = "chat"
COMPLETIONS = "completions"


LARGE = 64 * 1024  # bytes of body beyond which the work that grows with it goes to a thread


class ParsedRequest:
    __slots__ = ("kind", "data", "_body", "size", "model", "stream", "include_usage")

    def __init__(self, kind: str, data: dict[str, Any], body: bytes | None, size: int) -> None:
        self.kind = kind
        self.data = data
        self._body = body  # None: rewritten, serialised when it is sent (``encoded``)
        self.size = size  # bytes of the body the client sent
        self.model: str = data["model"]
        self.stream: bool = data.get("stream") is True
        options = data.get("stream_options")
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))

    @property
    def large(self) -> bool:
        """Whether work that grows with this body (hashing, serialising) belongs on a thread,
        not on the event loop."""
        return self.size > LARGE

    def with_fields(self, **fields: Any) -> ParsedRequest:
        """A copy with fields rewritten (its body serialised when it is sent)."""
        return ParsedRequest(self.kind, {**self.data, **fields}, None, self.size)

    async def encoded(self) -> bytes:
        """The body to send: the client's bytes unchanged, or the rewritten fields."""
        if self._body is None:
            self._body = await asyncio.to_thread(orjson.dumps, self.data) if self.large else orjson.dumps(self.data)
        return self._body


def kind_of(data: Any) -> str:
    """The API a bare request body is for (a WebSocket message has no path): a completion
    when it has ``prompt`` and no ``messages``, else chat."""
    if isinstance(data, dict) and "prompt" in data and "messages" not in data:
        return COMPLETIONS
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
    try:
        check_request(kind, data, body)  # the engine's rules: one validator for both
    except InvalidRequestError as exc:
        raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from None
    return ParsedRequest(kind, data, body, len(body))
