"""The model's tool-call block back into OpenAI's ``tool_calls``, as the text streams in.

The grammar (``structured.StructuredPlan.grammar``) makes the output exactly
``[content]<tool_call>[\\n{"name": "N", "arguments": {...}},\\n...\\n]</tool_call>``, so an
incremental scanner is enough: content text until ``<tool_call>`` (a suffix that may be
its beginning is held back), then per call a header giving its name and a braces-and-strings
scanner over its ``arguments`` object, whose text is passed on as it arrives. The pieces
given out by ``feed`` are OpenAI's streaming ``delta.tool_calls`` entries (the first of a
call carries ``id``, ``type`` and ``function.name``; the rest ``function.arguments``
fragments); their concatenation per call equals the final ``function.arguments``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .structured import TOOL_CALL_BEGIN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_SEP, StructuredPlan

__all__ = ["ParsedDelta", "ToolCallParser", "new_call_id"]

_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
_HEADER_PREFIX = '{"name": "'


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI streaming entries

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


_CONTENT, _BEGIN, _CONTENT_ONLY, _OPEN, _HEADER_STATE, _ARGS, _AFTER, _DONE = range(8)


class ToolCallParser:
    def __init__(self, plan: StructuredPlan) -> None:
        # where a block may start: anywhere in free text (the first <tool_call> opens it),
        # only at the start after a JSON answer's alternative, at once when only calls may come
        self._anywhere = not plan.calls_only and plan.format == "text"
        self._state = _BEGIN if plan.calls_only or not self._anywhere else _CONTENT
        self._buf = ""
        self.content = ""
        self.calls: list[dict] = []  # final shape: id, type, function{name, arguments}
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def tool_calls(self) -> list[dict]:
        return self.calls

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """The end of the output: content held back as a possible ``<tool_call>`` is content."""
        out = ParsedDelta()
        if self._state in (_CONTENT, _BEGIN) and self._buf:
            out.content = self._buf
            self.content += self._buf
            self._buf = ""
        return out

    # -- the scanner ---------------------------------------------------------------------
    def _step(self, out: ParsedDelta) -> bool:
        buf = self._buf
        state = self._state
        if state == _CONTENT:
            i = buf.find(TOOL_CALL_BEGIN)
            if i >= 0:
                self._emit_content(out, buf[:i])
                self._buf = buf[i + len(TOOL_CALL_BEGIN) :]
                self._state = _OPEN
                return True
            keep = _held_prefix(buf, TOOL_CALL_BEGIN)
            self._emit_content(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if state == _BEGIN:  # the block may only start here (or the answer is not a block)
            if buf.startswith(TOOL_CALL_BEGIN):
                self._buf = buf[len(TOOL_CALL_BEGIN) :]
                self._state = _OPEN
                return True
            if TOOL_CALL_BEGIN.startswith(buf):
                return False
            self._state = _CONTENT_ONLY
            return True
        if state == _CONTENT_ONLY:
            self._emit_content(out, buf)
            self._buf = ""
            return False
        if state == _OPEN:
            return self._expect(TOOL_CALL_OPEN, _HEADER_STATE)
        if state == _HEADER_STATE:
            m = _HEADER.match(buf)
            if m is None:
                if not (_HEADER_PREFIX.startswith(buf) or buf.startswith(_HEADER_PREFIX)):
                    self._state = _DONE  # not the grammar's shape: nothing more to read
                return False
            call = {"id": new_call_id(), "type": "function", "function": {"name": json.loads(m.group(1)), "arguments": ""}}
            self.calls.append(call)
            out.tool_calls.append(
                {"index": len(self.calls) - 1, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}
            )
            self._buf = buf[m.end() :]
            self._state = _ARGS
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if state == _ARGS:
            end = self._scan(buf)
            piece = buf if end is None else buf[:end]
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                self._emit_arguments(out, piece)
            self._buf = "" if end is None else buf[end:]
            if end is None:
                return False
            self._state = _AFTER
            return True
        if state == _AFTER:
            if buf.startswith("}" + TOOL_CALL_SEP):
                self._buf = buf[1 + len(TOOL_CALL_SEP) :]
                self._state = _HEADER_STATE
                return True
            if buf.startswith("}" + TOOL_CALL_CLOSE):
                self._buf = buf[1 + len(TOOL_CALL_CLOSE) :]
                self._state = _DONE
                return False
            if not (("}" + TOOL_CALL_SEP).startswith(buf) or ("}" + TOOL_CALL_CLOSE).startswith(buf)):
                self._state = _DONE
            return False
        return False  # _DONE: anything after the block is ignored

    def _expect(self, literal: str, then: int) -> bool:
        if self._buf.startswith(literal):
            self._buf = self._buf[len(literal) :]
            self._state = then
            return True
        if not literal.startswith(self._buf):
            self._state = _DONE
        return False

    def _scan(self, text: str) -> int | None:
        """Where the arguments value ends in ``text`` (carrying state across calls), or None."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.content += text
            self.content += text

    def _emit_arguments(self, out: ParsedDelta, piece: str) -> None:
        index = len(self.calls) - 1
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last["index"] == index and "id" not in last:  # a call's first entry keeps arguments ""
            last["function"]["arguments"] += piece
        else:
            out.tool_calls.append({"index": index, "function": {"arguments": piece}})



def _held_prefix(text: str, literal: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``literal``."""
    for n in range(min(len(text), len(literal) - 1), 0, -1):
        if literal.startswith(text[-n:]):
            return n
    return 0
