"""The OpenAI request parser: the body parsed once (orjson), and the fields checked by the
same rules the edge engine applies (``edge_engine.openai_fields``: one validator, naming
the parameter).

Fields the gateway does not interpret pass through untouched: the body bytes are forwarded
unchanged unless a field has to be rewritten (``with_fields``).

The pass-through APIs (``/v1/embeddings``, ``/v1/responses``, ``/v1/audio/*``... and the
configured ``passthrough`` paths) are parsed only as far as forwarding by model needs: the
``model`` (and ``stream``) of a JSON body, or of a ``multipart/form-data`` body's fields
(audio uploads); the body itself goes upstream as it came.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson

from edge_engine.errors import InvalidRequestError
from edge_engine.openai_fields import MAX_DEPTH, check_request, too_deep
from gateway.core.errors import InvalidRequest
from routing.features import estimate_prompt_tokens

__all__ = ["CHAT", "COMPLETIONS", "LARGE", "PASSTHROUGH", "ParsedRequest", "api_of_path", "kind_of", "parse_request"]

CHAT = "chat"
COMPLETIONS = "completions"
PASSTHROUGH = "passthrough"  # the kind an admission is given for the pass-through paths: the path says which API


LARGE = 64 * 1024  # bytes of body beyond which the work that grows with it goes to a thread


class ParsedRequest:
    __slots__ = (
        "kind", "data", "_body", "size", "model", "stream", "include_usage", "path", "content_type", "passthrough", "large",
        "_estimate",
    )

    def __init__(
        self, kind: str, data: dict[str, Any], body: bytes | None, size: int, path: bytes | None = None, content_type: bytes | None = None
    ) -> None:
        self.kind = kind  # chat | completion | a pass-through API (embeddings, responses, audio...)
        self.data = data
        self._body = body  # None: rewritten, serialised when it is sent (``encoded``)
        self.size = size  # bytes of the body the client sent
        self.model: str = data["model"]
        self.stream: bool = data.get("stream") is True
        options = data.get("stream_options")
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        self.path = path  # a pass-through request: its path below the base URL (b"/embeddings"); None: chat or completion
        self.content_type = content_type  # a body that is not JSON (multipart audio): its Content-Type, forwarded
        self.passthrough = path is not None  # another API's request, relayed as it came
        self.large = size > LARGE  # work that grows with the body (hashing, serialising) belongs on a thread
        self._estimate: tuple[float, tuple[int, bool]] | None = None

    def prompt_estimate(self, chars_per_token: float) -> tuple[int, bool]:
        """(estimated prompt tokens, has attachments) of the body: counted once, read by
        admission (the tenant's charge) and routing (the request's features)."""
        estimate = self._estimate
        if estimate is None or estimate[0] != chars_per_token:
            estimate = self._estimate = (chars_per_token, estimate_prompt_tokens(self.data, chars_per_token))
        return estimate[1]


    def with_fields(self, **fields: Any) -> ParsedRequest:
        """A copy with fields rewritten (its body serialised when it is sent). A form body
        (multipart) is never rewritten: its model must be the served model's own name."""
        if self.content_type is not None:
            raise InvalidRequest(
                f"a {self.content_type.decode('latin-1').split(';')[0]} body cannot be rewritten: name the served model "
                f"itself (not an alias), got '{self.model}'",
                param="model",
                code="model_alias_not_supported",
            )
        return ParsedRequest(self.kind, {**self.data, **fields}, None, self.size, self.path)

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


def api_of_path(path: str) -> str:
    """The API a pass-through path is for, as metrics and the cache name it:
    ``/v1/embeddings`` -> ``embeddings``, ``/v1/audio/transcriptions`` -> ``audio``."""
    rest = path[3:] if path.startswith("/v1/") else path
    return rest.strip("/").split("/", 1)[0] or "passthrough"


def parse_request(kind: str | None, body: bytes, *, path: str | None = None, content_type: str | None = None) -> ParsedRequest:
    """Parse and check ``body`` for the API ``kind`` (None: inferred, ``kind_of``);
    ``PASSTHROUGH``: a pass-through API's request to ``path`` (its ``Content-Type``, for a
    form body)."""
    if kind == PASSTHROUGH:
        return _parse_passthrough(body, path or "/", content_type)
    data = _json_object(body)
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


def _json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or the OpenAI-shaped error that says why not."""
    if not body:
        raise InvalidRequest("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    return data


def _parse_passthrough(body: bytes, path: str, content_type: str | None) -> ParsedRequest:
    """A pass-through request: its model from the JSON body or the form's ``model`` field."""
    api = api_of_path(path)
    below = (path[3:] if path.startswith("/v1/") else path).encode()  # what follows the endpoint's base URL
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        fields = form_fields(body, content_type or "", (b"model", b"stream"))
        model = fields.get("model")
        if not model:
            raise InvalidRequest("you must provide a model parameter (a form field)", param="model", code="missing_required_parameter")
        data: dict[str, Any] = {"model": model, "stream": fields.get("stream") == "true"}
        return ParsedRequest(api, data, body, len(body), below, content_type.encode("latin-1"))
    data = _json_object(body)
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and too_deep(data, MAX_DEPTH):
        raise InvalidRequest(f"the request nests JSON more than {MAX_DEPTH} levels deep", param="body")
    model = data.get("model")
    if model is None:
        raise InvalidRequest("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model must be a non-empty string", param="model", code="invalid_type")
    if "stream" in data and not isinstance(data["stream"], bool):
        raise InvalidRequest("stream must be a boolean", param="stream", code="invalid_type")
    return ParsedRequest(api, data, body, len(body), below)


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)
_MAX_FIELD = 1024  # bytes of a text field read (a model name, a flag)


def form_fields(body: bytes, content_type: str, names: tuple[bytes, ...]) -> dict[str, str]:
    """The text fields ``names`` of a ``multipart/form-data`` body (RFC 7578), found without
    copying its file parts. A malformed form is a 400."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise InvalidRequest("a multipart/form-data body needs a boundary in its Content-Type", code="invalid_multipart")
    delimiter = b"--" + match.group(1).encode("latin-1")
    found: dict[str, str] = {}
    at = body.find(delimiter)
    if at < 0:
        raise InvalidRequest("the multipart/form-data body has none of its boundaries", code="invalid_multipart")
    while True:
        start = at + len(delimiter)
        if body[start:start + 2] == b"--":
            break  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            raise InvalidRequest("a part of the multipart/form-data body has no end of headers", code="invalid_multipart")
        following = body.find(b"\r\n" + delimiter, head_end)
        if following < 0:
            raise InvalidRequest("the multipart/form-data body is not closed by its boundary", code="invalid_multipart")
        head = body[start:head_end]
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                name = _NAME.search(line)
                if name is not None and name.group(1) in names and b"filename=" not in line.lower():
                    value = body[head_end + 4:following]
                    if len(value) <= _MAX_FIELD:
                        found[name.group(1).decode("latin-1")] = value.decode("utf-8", "replace").strip()
        at = following + 2
    return found
