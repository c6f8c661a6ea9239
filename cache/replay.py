"""Answer a hit in the shape the client asked for, whatever shape it was stored in.

An entry holds the response as received: the JSON body, or the SSE chunk payloads. Pure
conversions turn one into the other:

- `chunks_to_json(kind, chunks)`: deltas/text concatenated, tool_calls deltas merged by
  index, finish_reason, logprobs and usage carried over.
- `json_to_chunks(kind, body, include_usage)`: per choice a role chunk (chat), a content
  chunk, tool-call/extra chunks, a finish chunk; then a usage chunk when asked.

`as_chunks` replays a stream stored as a stream byte for byte (the exact payloads as
received), leaving out its usage chunk unless the client asked for
`stream_options.include_usage`. The gateway frames each payload as `data: ...\\n\\n`
(or sends it as one WebSocket message) and ends SSE with `data: [DONE]`.
"""

from __future__ import annotations

from typing import Any

import orjson

from cache.base import Entry

CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}
FULL_OBJECT = {"chat": "chat.completion", "completions": "text_completion"}
_TOP_FIELDS = ("id", "created", "model", "system_fingerprint", "service_tier")
_MESSAGE_SPECIAL = ("role", "content", "tool_calls", "function_call")


def _loads(payload: bytes) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def is_usage_chunk(payload: bytes) -> bool:
    """A chunk carrying only usage (`choices: []`, `usage` set), as sent for include_usage."""
    if b'"usage"' not in payload:
        return False
    doc = _loads(payload)
    return doc is not None and not doc.get("choices") and doc.get("usage") is not None


def _usage_of_chunks(chunks: list[bytes]) -> Any:
    usage = None
    for payload in chunks:
        if b'"usage"' in payload:
            doc = _loads(payload)
            if doc is not None and doc.get("usage") is not None:
                usage = doc["usage"]
    return usage


def usage_of(entry: Entry) -> Any:
    """The entry's usage object, from either form, or None."""
    if entry.body is not None:
        doc = _loads(entry.body)
        if doc is not None and doc.get("usage") is not None:
            return doc["usage"]
    if entry.chunks is not None:
        return _usage_of_chunks(entry.chunks)
    return None


def _merge_logprobs(acc: dict[str, Any] | None, lp: Any) -> dict[str, Any] | None:
    if not isinstance(lp, dict):
        return acc
    if acc is None:
        acc = {}
    for k, v in lp.items():
        if isinstance(v, list):
            acc.setdefault(k, [])
            if acc[k] is None:
                acc[k] = []
            acc[k].extend(v)
        elif v is not None or k not in acc:
            acc[k] = v
    return acc


class _ChoiceState:
    __slots__ = ("index", "role", "content", "texts", "extra_text", "extra", "tool_calls",
                 "function_call", "logprobs", "finish_reason", "choice_extra")

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] | None = None  # None until a string content delta arrives
        self.texts: list[str] = []
        self.extra_text: dict[str, list[str]] = {}
        self.extra: dict[str, Any] = {}
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, str] | None = None
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: Any = None
        self.choice_extra: dict[str, Any] = {}

    def add_delta(self, delta: dict[str, Any]) -> None:
        for k, v in delta.items():
            if k == "role":
                if v is not None:
                    self.role = v
            elif k == "content":
                if isinstance(v, str):
                    if self.content is None:
                        self.content = []
                    self.content.append(v)
            elif k == "tool_calls":
                for tc in v or ():
                    self._add_tool_call(tc)
            elif k == "function_call":
                if isinstance(v, dict):
                    fc = self.function_call or {"name": "", "arguments": ""}
                    fc["name"] += v.get("name") or ""
                    fc["arguments"] += v.get("arguments") or ""
                    self.function_call = fc
            elif isinstance(v, str):
                self.extra_text.setdefault(k, []).append(v)
            elif v is not None:
                self.extra[k] = v

    def _add_tool_call(self, tc: dict[str, Any]) -> None:
        slot = self.tool_calls.setdefault(
            tc.get("index", len(self.tool_calls)),
            {"id": None, "type": None, "function": {"name": "", "arguments": ""}},
        )
        for k, v in tc.items():
            if k == "index" or v is None:
                continue
            if k == "function":
                fn = slot["function"]
                if v.get("name") and not fn["name"]:
                    fn["name"] = v["name"]
                fn["arguments"] += v.get("arguments") or ""
            elif k in ("id", "type"):
                slot[k] = slot[k] or v
            else:
                slot[k] = v

    def add_choice(self, choice: dict[str, Any], kind: str) -> None:
        if kind == "chat":
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self.add_delta(delta)
        else:
            text = choice.get("text")
            if isinstance(text, str):
                self.texts.append(text)
        self.logprobs = _merge_logprobs(self.logprobs, choice.get("logprobs"))
        for k, v in choice.items():
            if k == "finish_reason":
                if v is not None:
                    self.finish_reason = v
            elif k not in ("index", "delta", "text", "logprobs") and v is not None:
                self.choice_extra[k] = v

    def to_json(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if kind == "chat":
            message: dict[str, Any] = {
                "role": self.role or "assistant",
                "content": None if self.content is None else "".join(self.content),
            }
            for k, parts in self.extra_text.items():
                message[k] = "".join(parts)
            message.update(self.extra)
            if self.tool_calls:
                calls = []
                for _, slot in sorted(self.tool_calls.items()):
                    call = {k: v for k, v in slot.items() if v is not None}
                    call.setdefault("type", "function")
                    calls.append(call)
                message["tool_calls"] = calls
            if self.function_call is not None:
                message["function_call"] = self.function_call
            out["message"] = message
        else:
            out["text"] = "".join(self.texts)
        out["logprobs"] = self.logprobs
        out["finish_reason"] = self.finish_reason
        out.update(self.choice_extra)
        return out


def chunks_to_json(kind: str, chunks: list[bytes]) -> dict[str, Any]:
    """The full response (chat.completion / text_completion) a chunk sequence adds up to."""
    top: dict[str, Any] = {}
    usage = None
    choices: dict[int, _ChoiceState] = {}
    for payload in chunks:
        doc = _loads(payload)
        if doc is None:
            continue
        for k in _TOP_FIELDS:
            if k not in top and doc.get(k) is not None:
                top[k] = doc[k]
        if doc.get("usage") is not None:
            usage = doc["usage"]
        for choice in doc.get("choices") or ():
            if isinstance(choice, dict):
                index = choice.get("index", 0)
                state = choices.get(index)
                if state is None:
                    state = choices[index] = _ChoiceState(index)
                state.add_choice(choice, kind)
    out: dict[str, Any] = {
        "id": top.get("id"),
        "object": FULL_OBJECT[kind],
        "created": top.get("created"),
        "model": top.get("model"),
    }
    for k in ("system_fingerprint", "service_tier"):
        if k in top:
            out[k] = top[k]
    out["choices"] = [choices[i].to_json(kind) for i in sorted(choices)]
    if usage is not None:
        out["usage"] = usage
    return out


def _chunk_base(kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    """id, object, created, model (+ system_fingerprint, service_tier) for chunks."""
    base: dict[str, Any] = {}
    for k in ("id", "object", "created", "model", "system_fingerprint", "service_tier"):
        if k == "object":
            base[k] = CHUNK_OBJECT[kind]
        elif k in doc:
            base[k] = doc[k]
    return base


def _chunk(base: dict[str, Any], choice: dict[str, Any], with_usage: bool) -> bytes:
    doc = dict(base)
    doc["choices"] = [choice]
    if with_usage:
        doc["usage"] = None  # as OpenAI does on every non-usage chunk under include_usage
    return orjson.dumps(doc)


def usage_chunk(base: dict[str, Any], usage: Any) -> bytes:
    doc = dict(base)
    doc["choices"] = []
    doc["usage"] = usage
    return orjson.dumps(doc)


def json_to_chunks(kind: str, body: bytes | dict[str, Any], include_usage: bool) -> list[bytes]:
    """A chunk sequence (JSON payloads, no [DONE]) equivalent to a full JSON response."""
    doc = _loads(body) if isinstance(body, (bytes, bytearray)) else body
    if doc is None:
        raise ValueError("not a JSON completion response")
    base = _chunk_base(kind, doc)
    out: list[bytes] = []
    u = include_usage
    for choice in doc.get("choices") or ():
        index = choice.get("index", 0)
        extra = {
            k: v for k, v in choice.items()
            if k not in ("index", "message", "text", "logprobs", "finish_reason")
        }
        if kind == "chat":
            msg = choice.get("message") or {}
            content = msg.get("content")
            role = msg.get("role") or "assistant"
            first = {"role": role, "content": "" if isinstance(content, str) else None}
            out.append(_chunk(base, {"index": index, "delta": first, "logprobs": None,
                                     "finish_reason": None}, u))
            before = {k: v for k, v in msg.items()
                      if k.startswith("reasoning") and v not in (None, "", [])}
            after = {k: v for k, v in msg.items() if k not in _MESSAGE_SPECIAL
                     and not k.startswith("reasoning") and v not in (None, "", [])}
            if before:
                out.append(_chunk(base, {"index": index, "delta": before, "logprobs": None,
                                         "finish_reason": None}, u))
            if content or choice.get("logprobs") is not None:
                out.append(_chunk(base, {"index": index, "delta": {"content": content or ""},
                                         "logprobs": choice.get("logprobs"),
                                         "finish_reason": None}, u))
            if after:
                out.append(_chunk(base, {"index": index, "delta": after, "logprobs": None,
                                         "finish_reason": None}, u))
            if msg.get("tool_calls"):
                calls = []
                for i, tc in enumerate(msg["tool_calls"]):
                    call = {"index": i}
                    call.update(tc)
                    calls.append(call)
                out.append(_chunk(base, {"index": index, "delta": {"tool_calls": calls},
                                         "logprobs": None, "finish_reason": None}, u))
            if msg.get("function_call"):
                out.append(_chunk(base, {"index": index,
                                         "delta": {"function_call": msg["function_call"]},
                                         "logprobs": None, "finish_reason": None}, u))
            last = {"index": index, "delta": {}, "logprobs": None,
                    "finish_reason": choice.get("finish_reason")}
        else:
            out.append(_chunk(base, {"index": index, "text": choice.get("text") or "",
                                     "logprobs": choice.get("logprobs"),
                                     "finish_reason": None}, u))
            last = {"index": index, "text": "", "logprobs": None,
                    "finish_reason": choice.get("finish_reason")}
        last.update(extra)
        out.append(_chunk(base, last, u))
    if include_usage and doc.get("usage") is not None:
        out.append(usage_chunk(base, doc["usage"]))
    return out


def as_json(entry: Entry) -> bytes:
    """The JSON response body for a hit: the stored body verbatim, or built from chunks."""
    if entry.body is not None:
        return entry.body
    assert entry.chunks is not None
    return orjson.dumps(chunks_to_json(entry.kind, entry.chunks))


def as_chunks(entry: Entry, include_usage: bool) -> list[bytes]:
    """The SSE/WebSocket payloads for a hit. A stored stream replays byte for byte; its
    usage chunk appears only when `include_usage`; usage from a stored body is emitted
    as a usage chunk when `include_usage`."""
    if entry.chunks is None:
        assert entry.body is not None
        return json_to_chunks(entry.kind, entry.body, include_usage)
    if not include_usage:
        return [c for c in entry.chunks if not is_usage_chunk(c)]
    if any(is_usage_chunk(c) for c in entry.chunks):
        return list(entry.chunks)
    usage = _usage_of_chunks(entry.chunks)
    if usage is None and entry.body is not None:
        usage = usage_of(entry)
    if usage is None:
        return list(entry.chunks)
    base = _chunk_base(entry.kind, (_loads(entry.chunks[0]) if entry.chunks else None) or {})
    return [*entry.chunks, usage_chunk(base, usage)]
