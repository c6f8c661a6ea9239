"""A scripted central model that calls tools, for LangChain through the gateway.

The central large model cannot run here, and the small ones that can do not call tools
reliably; this ASGI app copies what OpenAI's chat completions API sends for a tool call, as
the SDKs and LangChain parse it: a whole answer's ``message.tool_calls`` (``id``,
``type: function``, ``function.name`` and ``function.arguments`` as a JSON string) with
``content: null`` and ``finish_reason: "tool_calls"``; a stream's first delta carrying the
role, the call's index, id, type and name with empty arguments, then the arguments in
fragments, then an empty delta with the finish reason, then (``include_usage``) a chunk with
no choices and the usage. Once the conversation holds the tool's result (a ``tool``
message), it answers in words from that result.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["ToolApp"]

_CREATED = 1733000000
_MODEL = "gpt-4o-mini-2024-07-18"  # what OpenAI names in its answers for gpt-4o-mini


class ToolApp:
    """Calls the first tool it is offered with ``arguments``; answers ``reply(result)`` once a
    tool's result is in the conversation. Every request body is kept (``requests``)."""

    def __init__(self, arguments: dict[str, Any], reply: str = "From the tool: {}") -> None:
        self.arguments = arguments
        self.reply = reply
        self.requests: list[dict] = []
        self.gets: list[str] = []
        self._calls = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return  # served with lifespan off
        if scope["method"] == "GET":
            self.gets.append(scope["path"])
            models = {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "created": _CREATED, "owned_by": "system"}]}
            return await _send(send, 200, "application/json", [orjson.dumps(models)])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = orjson.loads(body)
        self.requests.append(data)
        result = next((m["content"] for m in reversed(data["messages"]) if m.get("role") == "tool"), None)
        usage = {"prompt_tokens": 57, "completion_tokens": 17, "total_tokens": 74}
        if result is None and data.get("tools"):
            self._calls += 1
            call = {
                "id": f"call_{self._calls:024d}",
                "type": "function",
                "function": {"name": data["tools"][0]["function"]["name"], "arguments": orjson.dumps(self.arguments).decode()},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": self.reply.format(result), "refusal": None}
            finish = "stop"
        if not data.get("stream"):
            answer = {
                "id": "chatcmpl-scripted", "object": "chat.completion", "created": _CREATED, "model": _MODEL,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage, "system_fingerprint": "fp_scripted",
            }  # fmt: skip
            return await _send(send, 200, "application/json", [orjson.dumps(answer)])
        deltas = _deltas(message)
        chunks = [
            {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]} for delta in deltas
        ] + [{"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]}]
        if (data.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": usage})
        events = [
            b"data: " + orjson.dumps({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": _CREATED,
                                     "model": _MODEL, "system_fingerprint": "fp_scripted", **chunk}) + b"\n\n"
            for chunk in chunks
        ]  # fmt: skip
        await _send(send, 200, "text/event-stream", [*events, b"data: [DONE]\n\n"])


def _deltas(message: dict) -> list[dict]:
    if message.get("tool_calls"):
        call = message["tool_calls"][0]
        arguments = call["function"]["arguments"]
        first = {
            "role": "assistant", "content": None, "refusal": None,
            "tool_calls": [{"index": 0, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}],
        }  # fmt: skip
        pieces = [arguments[i : i + 4] for i in range(0, len(arguments), 4)]
        return [first, *({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} for piece in pieces)]
    words = message["content"].split(" ")
    return [{"role": "assistant", "content": "", "refusal": None}, *({"content": (" " if i else "") + w} for i, w in enumerate(words))]


async def _send(send, status: int, content_type: str, parts: list[bytes]) -> None:
    headers = [(b"content-type", content_type.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for part in parts:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
