"""Reading OpenAI answers, whole or streamed, into one comparable shape (tests/realworld/)."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import orjson

__all__ = ["Answer", "ask", "payloads"]

PATHS = {"chat": "/chat/completions", "completion": "/completions"}


def payloads(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    out = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


@dataclass
class Answer:
    status: int
    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    error: dict | None = None  # the OpenAI error object: the body's, or a stream's error event
    done: bool = False  # a stream ended with data: [DONE]
    chunks: int = 0  # a stream's content-bearing events
    headers: httpx.Headers = field(default_factory=httpx.Headers)


def _usage(usage: dict | None) -> dict | None:
    # the counts only (servers add details such as prompt_tokens_details differently)
    return None if usage is None else {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def ask(base: str, kind: str, body: dict, *, headers: dict | None = None, timeout: float = 120) -> Answer:
    """POST ``body`` to ``base``'s API of ``kind`` ("chat" or "completion") and read it."""
    response = httpx.post(base + PATHS[kind], json=body, headers=headers, timeout=timeout)
    answer = Answer(response.status_code, headers=response.headers)
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        data = orjson.loads(response.content) if response.content else {}
        if response.status_code >= 400:
            answer.error = data.get("error") if isinstance(data, dict) else None
            return answer
        choice = data["choices"][0]
        answer.text = choice["message"]["content"] if kind == "chat" else choice["text"]
        answer.finish = choice["finish_reason"]
        answer.usage = _usage(data.get("usage"))
        return answer
    for payload in payloads(response.content):
        if payload == b"[DONE]":
            answer.done = True
            continue
        event = orjson.loads(payload)
        if "error" in event:
            answer.error = event["error"]
            continue
        if event.get("usage"):
            answer.usage = _usage(event["usage"])
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
            if piece:
                answer.text += piece
                answer.chunks += 1
            if choice.get("finish_reason"):
                answer.finish = choice["finish_reason"]
    return answer
