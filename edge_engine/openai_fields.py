"""The OpenAI request fields, checked once by the same rules wherever a request is read.

``check_request(kind, body)`` raises ``InvalidRequestError`` naming the parameter (OpenAI's
``param``, e.g. ``messages.[2].content``) for a field that is present and malformed: a wrong
type, a value out of range, an unknown role, a content part that is not an object with a
known ``type``. Fields it does not know pass untouched (a proxy forwards what it does not
interpret). What a particular server supports (n > 1, images, tools) is not validity and
stays with that server.

Used by the engine's OpenAI seam (``serving.py``) and by the gateway's parser; it imports
nothing heavy (no torch), so a gateway that only relays can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import InvalidRequestError
from .structured import check_response_format, check_tool_choice, check_tools

__all__ = ["MAX_DEPTH", "ROLES", "check_request"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
PART_TYPES = frozenset({"text", "image_url", "input_audio", "file", "refusal", "input_text", "input_image"})
MAX_DEPTH = 64  # JSON nesting a request may have (OpenAI's own schemas need a handful)

_NUMBER = (int, float)


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param, code)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _type(name: str, ok: Callable[[Any], bool], what: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not ok(value):
            raise _bad(f"{name} must be {what}", name, "invalid_type")

    return check


def _range(name: str, low: float, high: float, *, integer: bool = False, low_open: bool = False) -> Callable[[Any], None]:
    what = "an integer" if integer else "a number"

    def check(value: Any) -> None:
        if not (_is_int(value) if integer else _is_number(value)):
            raise _bad(f"{name} must be {what}", name, "invalid_type")
        if value < low or value > high or (low_open and value == low):
            bounds = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
            raise _bad(f"{name} must be in {bounds}, got {value}", name)

    return check


def _at_least(name: str, low: int) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not _is_int(value):
            raise _bad(f"{name} must be an integer", name, "invalid_type")
        if value < low:
            raise _bad(f"{name} must be at least {low}, got {value}", name)

    return check


def _stop(value: Any) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop must be a string or an array of strings", "stop", "invalid_type")
    if len(value) > 16:
        raise _bad("stop may have at most 16 sequences", "stop")


def _stream_options(value: Any) -> None:
    if not isinstance(value, dict):
        raise _bad("stream_options must be an object", "stream_options", "invalid_type")
    for key in ("include_usage", "continuous_usage_stats"):
        if key in value and not isinstance(value[key], bool):
            raise _bad(f"stream_options.{key} must be a boolean", f"stream_options.{key}", "invalid_type")


def _logit_bias(value: Any) -> None:
    if not isinstance(value, dict) or not all(_is_number(v) for v in value.values()):
        raise _bad("logit_bias must be an object of token ids to numbers", "logit_bias", "invalid_type")
    for token, bias in value.items():
        if not -100 <= bias <= 100:
            raise _bad(f"logit_bias[{token}] must be in [-100, 100]", "logit_bias")


_COMMON: dict[str, Callable[[Any], None]] = {
    "stream": _type("stream", lambda v: isinstance(v, bool), "a boolean"),
    "stream_options": _stream_options,
    "temperature": _range("temperature", 0.0, 2.0),
    "top_p": _range("top_p", 0.0, 1.0, low_open=True),
    "n": _at_least("n", 1),
    "max_tokens": _at_least("max_tokens", 1),
    "presence_penalty": _range("presence_penalty", -2.0, 2.0),
    "frequency_penalty": _range("frequency_penalty", -2.0, 2.0),
    "seed": _type("seed", _is_int, "an integer"),
    "stop": _stop,
    "user": _type("user", lambda v: isinstance(v, str), "a string"),
    "logit_bias": _logit_bias,
    "top_k": _type("top_k", _is_int, "an integer"),
    "min_tokens": _at_least("min_tokens", 0),
    "ignore_eos": _type("ignore_eos", lambda v: isinstance(v, bool), "a boolean"),
    "stop_token_ids": _type("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "an array of integers"),
    "metadata": _type("metadata", lambda v: isinstance(v, dict), "an object"),
}
_CHAT: dict[str, Callable[[Any], None]] = {
    **_COMMON,
    "max_completion_tokens": _at_least("max_completion_tokens", 1),
    "logprobs": _type("logprobs", lambda v: isinstance(v, bool), "a boolean"),
    "top_logprobs": _range("top_logprobs", 0, 20, integer=True),
    "tools": _type("tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "an array of objects"),
    "response_format": _type("response_format", lambda v: isinstance(v, dict), "an object"),
    "parallel_tool_calls": _type("parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean"),
}
# the shapes of structured output's fields (structured.py: also what they mean)
_CHAT.update({"tools": check_tools, "tool_choice": check_tool_choice, "response_format": check_response_format})
_COMPLETION: dict[str, Callable[[Any], None]] = {
    **_COMMON,
    "logprobs": _range("logprobs", 0, 5, integer=True),
    "echo": _type("echo", lambda v: isinstance(v, bool), "a boolean"),
    "best_of": _at_least("best_of", 1),
    "suffix": _type("suffix", lambda v: isinstance(v, str), "a string"),
}


def check_request(kind: str, body: dict, raw: bytes | None = None) -> None:
    """Raise ``InvalidRequestError`` for the first malformed field of a chat (``kind="chat"``)
    or completions request ``body`` (a dict already parsed from JSON; ``raw``, when given,
    the JSON it was parsed from)."""
    # a document cannot nest deeper than it has brackets: counting bytes spares the walk
    shallow = raw is not None and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH
    if not shallow and too_deep(body, MAX_DEPTH):
        raise _bad(f"the request nests JSON more than {MAX_DEPTH} levels deep", "body")
    if kind == "chat":
        _messages(body.get("messages"))
        fields = _CHAT
    else:
        _prompt(body.get("prompt"))
        fields = _COMPLETION
    for name, value in body.items():  # a request names a few of the fields: walk its own
        check = fields.get(name)
        if check is not None and value is not None:
            check(value)


def too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` levels (iteratively: a
    hostile document must not exhaust the stack checking it)."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 1
    while level:  # the containers at ``depth``, a level at a time
        if depth > limit:
            return True
        deeper = []
        for item in level:
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, (dict, list)):
                    deeper.append(child)
        level = deeper
        depth += 1
    return False


def _messages(messages: Any) -> None:
    if messages is None:
        raise _bad("you must provide a messages parameter", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array", "messages", "invalid_type")
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{param} must be an object", param, "invalid_type")
        role = message.get("role")
        if role is None:
            raise _bad(f"{param}.role is required", f"{param}.role", "missing_required_parameter")
        if role not in ROLES:
            raise _bad(f"{param}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}", f"{param}.role")
        content = message.get("content")
        if content is None:
            if role not in ("assistant", "function"):  # those may carry tool calls instead
                raise _bad(f"{param}.content is required for the {role} role", f"{param}.content", "missing_required_parameter")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                where = f"{param}.content.[{j}]"
                if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
                    raise _bad(f"{where} must be an object with a type of {', '.join(sorted(PART_TYPES))}", where, "invalid_type")
                if part["type"] in ("text", "input_text") and not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.text must be a string", f"{where}.text", "invalid_type")
        elif not isinstance(content, str):
            raise _bad(f"{param}.content must be a string or an array of content parts", f"{param}.content", "invalid_type")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{param}.name must be a string", f"{param}.name", "invalid_type")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise _bad(f"{param}.tool_calls is only allowed on assistant messages", f"{param}.tool_calls")
            _tool_calls(tool_calls, f"{param}.tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is None:
                raise _bad(f"{param}.tool_call_id is required for the tool role", f"{param}.tool_call_id", "missing_required_parameter")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{param}.tool_call_id must be a non-empty string", f"{param}.tool_call_id", "invalid_type")


def _tool_calls(calls: Any, param: str) -> None:
    """An assistant message's ``tool_calls``: a list of ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` (arguments a string, as OpenAI sends them back)."""
    if not isinstance(calls, list):
        raise _bad(f"{param} must be an array of tool calls", param, "invalid_type")
    for k, call in enumerate(calls):
        where = f"{param}.[{k}]"
        if not isinstance(call, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _bad(f"{where}.id must be a non-empty string", f"{where}.id", "invalid_type")
        if call.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function', got {call.get('type')!r}", f"{where}.type")
        function = call.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function must be an object", f"{where}.function", "invalid_type")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name", "invalid_type")
        if not isinstance(function.get("arguments"), str):
            raise _bad(f"{where}.function.arguments must be a string (JSON text)", f"{where}.function.arguments", "invalid_type")


def _prompt(prompt: Any) -> None:
    if prompt is None:
        raise _bad("you must provide a prompt parameter", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_int(t) for t in prompt):
            _token_ids(prompt, "prompt")
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            for i, ids in enumerate(prompt):
                _token_ids(ids, f"prompt.[{i}]")
            return
    raise _bad("prompt must be a string, an array of strings, or an array of token ids", "prompt", "invalid_type")


MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; the server that knows its own checks the rest


def _token_ids(ids: list[int], param: str) -> None:
    for j, token in enumerate(ids):
        if token < 0 or token > MAX_TOKEN_ID:
            raise _bad(f"{param}.[{j}] is not a token id (got {token}): token ids are integers from 0", param)
