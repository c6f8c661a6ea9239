"""The OpenAI-shaped seam: request JSON in, OpenAI response / chunk JSON out.

``OpenAIServing.prepare`` validates and tokenises synchronously (``InvalidRequestError`` ->
400, ``EngineOverloadedError`` -> 503); a prompt too long to fit is refused from its length
in characters before it is tokenised or its chat template rendered.  ``prepare(...,
deadline=)`` carries a ``time.monotonic()`` deadline: a request still queued when it passes
fails with ``DeadlineExceededError`` (504).  ``stream`` yields one compact JSON chunk per item
(no ``data:`` framing, no ``[DONE]``: the caller frames them); ``complete`` returns the whole
non-streaming response.  The gateway and ``edge_engine.server`` both sit on top of it.

Supported fields: ``messages`` (chat; string content or a list of ``text`` parts) or
``prompt`` (completion; a string, a list of token ids, or a one-element list of either),
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop``, ``stop_token_ids``, ``min_tokens``, ``ignore_eos``, ``logprobs`` (+
``top_logprobs`` for chat; an integer for completions), ``n`` (1 only), ``stream``,
``stream_options.include_usage`` and ``priority`` ("interactive" | "standard" | "batch", or
0 | 1 | 2); for chat, ``response_format``, ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (``structured.py``: the grammar and the tools prompt;
``tool_calls.py``: the answer's ``tool_calls``). ``prepare`` also runs the engine's
admission: a request whose first token is predicted after its deadline, or whose class's
TPOT objective cannot be kept, is refused (``EngineOverloadedError``, 503) before it is queued.
``presence_penalty`` / ``frequency_penalty`` are range-checked; only 0 is implemented.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import orjson

from .engine import Engine
from .errors import InvalidRequestError
from .openai_fields import check_request
from .sampling import SampleResult, SamplingParams
from .sequence import Delta, Priority, StageTimes
from .structured import StructuredPlan, plan, render_tool_calls, tools_system_prompt
from .tool_calls import ToolCallParser

__all__ = ["OpenAIServing", "PreparedRequest"]


@dataclass(slots=True)
class PreparedRequest:
    kind: str  # "chat" | "completions"
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = Priority.INTERACTIVE
    completion_logprobs: int | None = None  # completions: the integer ``logprobs`` field
    deadline: float | None = None  # time.monotonic(): dropped with DeadlineExceededError if not started by then
    extra: dict = field(default_factory=dict)
    times: StageTimes | None = None  # set when the answer has ended: the engine's stages
    structured: StructuredPlan | None = None  # chat: response_format / tools, when asked

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _bad(message: str, param: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param, code)


def _field(body: dict, name: str, default: Any) -> Any:
    """``body[name]`` (already checked by ``check_request``), or ``default`` when absent or null."""
    value = body.get(name)
    return default if value is None else value


class OpenAIServing:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer

    # -- request ------------------------------------------------------------------------
    def prepare(self, kind: str, body: dict, *, deadline: float | None = None, checked: bool = False) -> PreparedRequest:
        """Validate ``body`` and tokenise its prompt; ``deadline`` is a ``time.monotonic()``
        value past which the request, if it has not started, is dropped (504); ``checked``:
        ``check_request`` already passed ``body`` (the gateway's parser runs it on every
        request), so it is not run again.

        Whether a field is well-formed is ``openai_fields.check_request``'s to say (the
        gateway applies the same rules before a request reaches any target); what is left
        here is what this engine supports (one choice, text content, no logit bias, echo or
        suffix) and what only it can check (the prompt and ``max_tokens`` against its
        context window, the tokens of a prompt given as ids)."""
        if kind not in ("chat", "completions"):
            raise ValueError(f"kind must be 'chat' or 'completions', not {kind!r}")
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", "body", "invalid_type")
        if not checked:
            check_request(kind, body)
        structured = None
        if kind == "chat":
            structured = plan(body)
            prompt_ids, prompt_param = self._chat_prompt(body, structured), "messages"
        else:
            prompt_ids, prompt_param = self._completion_prompt(body), "prompt"

        if _field(body, "n", 1) != 1:
            raise _bad("only n = 1 is supported", "n", "unsupported")
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported", "logit_bias", "unsupported")
        stream = _field(body, "stream", False)
        include_usage = _field(body, "stream_options", {}).get("include_usage") is True

        max_tokens_param = "max_tokens"
        max_tokens = _field(body, "max_tokens", None)
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            max_tokens_param = "max_completion_tokens"
            max_tokens = body["max_completion_tokens"]
        elif kind == "completions" and max_tokens is None and "max_tokens" not in body:
            max_tokens = 16  # the completions API's documented default

        completion_logprobs: int | None = None
        if kind == "chat":
            logprobs = _field(body, "logprobs", False)
            top_logprobs = _field(body, "top_logprobs", 0)
        else:
            completion_logprobs = _field(body, "logprobs", None)
            logprobs = completion_logprobs is not None
            top_logprobs = completion_logprobs or 0
            for name in ("echo", "suffix"):
                if body.get(name):
                    raise _bad(f"{name} is not supported", name, "unsupported")

        try:
            params = SamplingParams(
                temperature=_field(body, "temperature", 1.0),
                top_p=_field(body, "top_p", 1.0),
                top_k=_field(body, "top_k", 0),
                seed=_field(body, "seed", None),
                max_tokens=max_tokens,
                min_tokens=_field(body, "min_tokens", 0),
                stop=_field(body, "stop", []),
                stop_token_ids=_field(body, "stop_token_ids", []),
                ignore_eos=_field(body, "ignore_eos", False),
                logprobs=logprobs,
                top_logprobs=top_logprobs,
            )
        except InvalidRequestError as exc:
            if exc.param == "max_tokens":
                exc.param = max_tokens_param
                exc.message = exc.message.replace("max_tokens", max_tokens_param)
            raise
        priority = body.get("priority", "interactive")
        if isinstance(priority, bool) or priority not in ("interactive", "standard", "batch", 0, 1, 2):
            raise _bad("priority must be 'interactive', 'standard' or 'batch'", "priority")
        priority = Priority[priority.upper()] if isinstance(priority, str) else Priority(priority)

        max_tokens = self.engine.validate(
            prompt_ids, params, prompt_param=prompt_param, max_tokens_param=max_tokens_param
        )
        params.max_tokens = max_tokens
        self.engine.check_capacity(len(prompt_ids), priority, deadline)
        if structured is not None and structured.is_constrained:
            params.grammar = self._grammar(structured)
        return PreparedRequest(
            kind=kind,
            prompt_token_ids=prompt_ids,
            params=params,
            stream=stream,
            include_usage=include_usage,
            priority=priority,
            completion_logprobs=completion_logprobs,
            deadline=deadline,
            structured=structured,
        )

    def _grammar(self, structured: StructuredPlan):
        """The compiled grammar of ``structured``; a schema that does not compile is a 400
        naming its place (``response_format.json_schema.schema``, ``tools.[i].function.parameters``)."""
        compiler = self.engine.grammar
        if compiler is None:
            param = "tools" if structured.uses_tools else "response_format"
            raise _bad(f"{param} needs constrained decoding, which this engine lacks (install llguidance)", param, "unsupported")
        try:
            return compiler.compile(structured.grammar(), "tools" if structured.uses_tools else "response_format")
        except InvalidRequestError:
            for param, text in structured.part_grammars():
                compiler.compile(text, param)  # raises, naming the part at fault
            raise

    def _chat_prompt(self, body: dict, structured: StructuredPlan | None = None) -> list[int]:
        rendered: list[dict] = []
        for i, message in enumerate(body["messages"]):  # well-formed: check_request saw them
            param = f"messages.[{i}]"
            role = message["role"]
            if role == "function":
                raise _bad(f"{param}.role function is not supported (use tool)", f"{param}.role", "unsupported")
            content = message.get("content")
            if content is None:
                content = ""  # an assistant turn that only called tools
            elif isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part["type"] not in ("text", "input_text"):
                        where = f"{param}.content.[{j}]"
                        raise _bad(f"{where} is a {part['type']} part; this model reads text only", where, "unsupported")
                    parts.append(part["text"])
                content = "".join(parts)
            if role == "assistant" and message.get("tool_calls"):
                if not isinstance(message["tool_calls"], list):
                    raise _bad(f"{param}.tool_calls must be an array", f"{param}.tool_calls", "invalid_type")
                content += render_tool_calls(message["tool_calls"], param)
            elif role == "tool":  # a tool's result, as SmolLM2's format gives it back
                role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
            rendered.append({"role": "system" if role == "developer" else role, "content": content})
        if structured is not None and structured.uses_tools:
            tools_prompt = tools_system_prompt(structured)
            if rendered and rendered[0]["role"] == "system":
                rendered[0] = {"role": "system", "content": tools_prompt + "\n\n" + rendered[0]["content"]}
            else:
                rendered.insert(0, {"role": "system", "content": tools_prompt})
        self.engine.check_prompt_chars(sum(len(m["content"]) for m in rendered), "messages")
        try:
            return self.tokenizer.encode_chat(rendered, add_generation_prompt=True)
        except jinja2.TemplateError as exc:
            raise _bad(f"the chat template rejected these messages: {exc}", "messages") from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self.engine.check_prompt_chars(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise _bad("prompt must be a string or a list of token ids (one prompt per request)", "prompt", "invalid_type")

    # -- responses ----------------------------------------------------------------------
    def _generate(self, prepared: PreparedRequest, request_id: str) -> AsyncIterator[Delta]:
        return self.engine.generate(
            prepared.prompt_token_ids,
            prepared.params,
            request_id=request_id,
            priority=prepared.priority,
            deadline=prepared.deadline,
            admitted=True,  # prepare's check_capacity
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_logprobs(self, results: list[SampleResult]) -> dict:
        content = []
        for r in results:
            entry = {
                "token": self._token_text(r.token_id),
                "logprob": r.logprob,
                "bytes": list(self.tokenizer.token_bytes(r.token_id)),
                "top_logprobs": [
                    {"token": self._token_text(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))}
                    for t, lp in (r.top_logprobs or [])
                ],
            }
            content.append(entry)
        return {"content": content}

    def _completion_logprobs(self, results: list[SampleResult], offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for r in results:
            text = self._token_text(r.token_id)
            tokens.append(text)
            token_logprobs.append(r.logprob)
            top.append({self._token_text(t): lp for t, lp in (r.top_logprobs or [])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    @staticmethod
    def _usage(delta: Delta | None, num_prompt_tokens: int) -> dict:
        completion = delta.num_output_tokens if delta else 0
        cached = delta.num_cached_tokens if delta else 0
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def stream(self, prepared: PreparedRequest, request_id: str) -> AsyncIterator[bytes]:
        """One OpenAI chunk per item (compact JSON bytes); the last carries finish_reason,
        then a usage chunk when ``include_usage``."""
        created = int(time.time())
        is_chat = prepared.kind == "chat"
        obj = "chat.completion.chunk" if is_chat else "text_completion"
        usage_field = {"usage": None} if prepared.include_usage else {}
        first = True
        text_offset = 0
        last: Delta | None = None
        structured = prepared.structured
        parser = ToolCallParser(structured) if structured is not None and structured.uses_tools else None
        async with contextlib.aclosing(self._generate(prepared, request_id)) as deltas:
            async for delta in deltas:
                last = delta
                if parser is not None:  # tools: content and tool_calls as the parser finds them
                    for choice in self._tool_choice_chunks(parser, delta, first):
                        first = False
                        yield orjson.dumps(
                            {"id": request_id, "object": obj, "created": created, "model": self.model_name,
                             "choices": [choice], **usage_field}
                        )
                    continue
                if not delta.text and not delta.logprobs and delta.finish_reason is None and not (first and is_chat):
                    continue
                elif is_chat:
                    message: dict = {"role": "assistant", "content": delta.text} if first else {}
                    if not first and delta.text:
                        message["content"] = delta.text
                    choice = {
                        "index": 0,
                        "delta": message,
                        "logprobs": self._chat_logprobs(delta.logprobs) if delta.logprobs else None,
                        "finish_reason": delta.finish_reason,
                    }
                else:
                    choice = {
                        "index": 0,
                        "text": delta.text,
                        "logprobs": self._completion_logprobs(delta.logprobs, text_offset) if delta.logprobs else None,
                        "finish_reason": delta.finish_reason,
                    }
                    text_offset += len(delta.text)
                first = False
                yield orjson.dumps(
                    {
                        "id": request_id,
                        "object": obj,
                        "created": created,
                        "model": self.model_name,
                        "choices": [choice],
                        **usage_field,
                    }
                )
        prepared.times = last.times if last is not None else None
        if prepared.include_usage:
            yield orjson.dumps(
                {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(last, prepared.num_prompt_tokens),
                }
            )

    def _tool_choice_chunks(self, parser: ToolCallParser, delta: Delta, first: bool) -> list[dict]:
        """A chat stream's choices for one delta when tools may be called, in OpenAI's
        shapes: content as it comes; for each call a first chunk with its ``id``, ``type``,
        ``function.name`` and empty ``arguments``, then ``arguments`` fragments (one chunk per
        entry, as OpenAI streams them). Nothing yet while the text may still be the start
        of ``<tool_call>`` (the role chunk waits too)."""
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.content += parser.finish().content
        messages: list[dict] = []
        if parsed.content:
            messages.append({"content": parsed.content})
        messages += [{"tool_calls": [entry]} for entry in parsed.tool_calls]
        if not messages and (delta.logprobs or delta.finish_reason is not None):
            messages.append({})
        if first and messages:
            messages[0] = {"role": "assistant", "content": messages[0].pop("content", None), **messages[0]}
        finish = delta.finish_reason
        if finish == "stop" and parser.calls:
            finish = "tool_calls"
        logprobs = self._chat_logprobs(delta.logprobs) if delta.logprobs else None
        return [
            {"index": 0, "delta": message, "logprobs": logprobs if i == 0 else None,
             "finish_reason": finish if i == len(messages) - 1 else None}
            for i, message in enumerate(messages)
        ]

    async def complete(self, prepared: PreparedRequest, request_id: str) -> bytes:
        """The whole non-streaming response (chat.completion / text_completion) with usage."""
        created = int(time.time())
        texts: list[str] = []
        logprobs: list[SampleResult] = []
        last: Delta | None = None
        async with contextlib.aclosing(self._generate(prepared, request_id)) as deltas:
            async for delta in deltas:
                last = delta
                texts.append(delta.text)
                if delta.logprobs:
                    logprobs.extend(delta.logprobs)
        prepared.times = last.times if last is not None else None
        text = "".join(texts)
        finish = last.finish_reason if last else "stop"
        if prepared.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            structured = prepared.structured
            if structured is not None and structured.uses_tools:
                parser = ToolCallParser(structured)
                parser.feed(text)
                parser.finish()
                if parser.calls:
                    message = {"role": "assistant", "content": parser.content or None, "tool_calls": parser.calls}
                    if finish == "stop":
                        finish = "tool_calls"
            body = {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": self._chat_logprobs(logprobs) if prepared.params.logprobs else None,
                        "finish_reason": finish,
                    }
                ],
            }
        else:
            body = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": self._completion_logprobs(logprobs, 0) if prepared.params.logprobs else None,
                        "finish_reason": finish,
                    }
                ],
            }
        body["usage"] = self._usage(last, prepared.num_prompt_tokens)
        return orjson.dumps(body)

    def models(self) -> bytes:
        """The ``GET /v1/models`` body."""
        return orjson.dumps(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgegw"}],
            }
        )
