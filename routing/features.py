"""OpenAI request body + headers -> ``RouteRequest`` (the features routing looks at).

The gateway parses the body with orjson and passes the dict here; nothing is copied
beyond what routing needs. The prompt token count is an estimate (characters /
``policy.chars_per_token``): routing needs an order of magnitude, not a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from hashlib import blake2b
from typing import Any

import orjson

from .config import RoutingConfig
from .geo import _header
from .prefix import prompt_blocks, prompt_text
from .types import Location, RouteRequest

__all__ = [
    "BUDGET_HEADER", "affinity_key", "budget_of", "estimate_prompt_tokens", "mean_logprob", "request_from_openai", "structured_field",
]

BUDGET_HEADER = "x-latency-budget-ms"

_ATTACHMENT_PARTS = frozenset({"image_url", "input_image", "input_audio", "file", "image", "audio"})


def _content_chars(content: Any) -> tuple[int, bool]:
    """(characters of text, has an attachment) of one message's content."""
    if isinstance(content, str):
        return len(content), False
    chars, attached = 0, False
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in _ATTACHMENT_PARTS:
                    attached = True
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
            elif isinstance(part, str):
                chars += len(part)
    return chars, attached


def estimate_prompt_tokens(body: Mapping[str, Any], chars_per_token: float = 4.0) -> tuple[int, bool]:
    """(estimated prompt tokens, has attachments) for a chat or completions body."""
    chars, attached = 0, False
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                c, a = _content_chars(m.get("content"))
                chars += c + 4 * chars_per_token  # role + template overhead ≈ 4 tokens
                attached = attached or a
    for name in ("input", "system", "instructions"):  # embeddings, responses, messages (Anthropic)
        value = body.get(name)
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    chars += len(item)
                elif isinstance(item, dict):
                    c, a = _content_chars(item.get("content", item.get("text")))
                    chars += c
                    attached = attached or a
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            if isinstance(p, str):
                chars += len(p)
            elif isinstance(p, int):  # a list of token ids
                chars += chars_per_token
    return int(chars / chars_per_token + 0.5), attached


def affinity_key(
    body: Mapping[str, Any], headers: Mapping[str, str], config: RoutingConfig
) -> tuple[bytes | None, str | None]:
    """(key, source): the session header, else the body's ``user``, else a digest of the
    first ``affinity_prefix_messages`` messages (the part of a conversation every later
    turn repeats, hence the part a replica's prefix cache holds). ``(None, None)`` when
    affinity is off or there is nothing to key on."""
    bal = config.balancer
    if not bal.affinity:
        return None, None
    session = _header(headers, bal.session_header.lower())
    if session:
        return blake2b(b"s\0" + session.encode(), digest_size=16).digest(), "session"
    user = body.get("user")
    if isinstance(user, str) and user:
        return blake2b(b"u\0" + user.encode(), digest_size=16).digest(), "user"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head = messages[: bal.affinity_prefix_messages]
        try:
            raw = orjson.dumps(head, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            return None, None
        return blake2b(b"p\0" + raw, digest_size=16).digest(), "prefix"
    return None, None


def structured_field(body: Mapping[str, Any]) -> str | None:
    """The first field of ``body`` that asks for structured output, or None: ``tools`` (or the
    older ``functions``) unless ``tool_choice`` is ``"none"``, a ``tool_choice`` naming a
    tool or ``"required"``, a ``response_format`` of ``json_object`` or ``json_schema``."""
    choice = body.get("tool_choice")
    if body.get("tools") or body.get("functions"):
        if choice != "none":
            return "tools" if body.get("tools") else "functions"
    if isinstance(choice, dict) or choice == "required":
        return "tool_choice"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    return None


def budget_of(headers: Mapping[str, str], tenant_budget_ms: float | None = None, max_ms: float | None = None) -> float | None:
    """A request's TTFT budget in milliseconds: its ``x-latency-budget-ms`` header when that
    is a positive finite number (at most ``max_ms``), else ``tenant_budget_ms``, else None."""
    raw = _header(headers, BUDGET_HEADER)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if 0 < value < float("inf"):
            return value if max_ms is None else min(value, max_ms)
    return tenant_budget_ms


def request_from_openai(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    config: RoutingConfig,
    *,
    client_ip: str | None = None,
    location: Location | None = None,
    budget_ms: float | None = None,
    api: str = "chat",
    prompt_estimate: tuple[int, bool] | None = None,
    prefix: bool = True,
) -> RouteRequest:
    """Build the ``RouteRequest`` for a ``/v1/chat/completions`` or ``/v1/completions`` body
    (or, with ``api``, another API's JSON body: ``embeddings``, ``responses``...).

    ``budget_ms``: the request's TTFT budget as its caller decided it (``budget_of`` reads
    the header; the gateway's ``Deadline`` holds it); ``None``: the policy's default applies.
    ``prompt_estimate``: ``estimate_prompt_tokens`` of the body, when the caller has it;
    ``prefix``: False when there is no endpoint to choose by its prefix cache (no blocks).
    """
    pol = config.policy
    tokens, attached = prompt_estimate or estimate_prompt_tokens(body, pol.chars_per_token)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = None
    tools = body.get("tools") or body.get("functions")
    key, source = affinity_key(body, headers, config)
    load = config.load
    blocks = prompt_blocks(prompt_text(body), load.prefix_block_chars, load.prefix_max_blocks) if load.prefix and prefix else ()
    model = body.get("model")
    return RouteRequest(
        model=model if isinstance(model, str) and model else "auto",
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        has_tools=bool(tools),
        has_attachments=attached,
        structured=structured_field(body),
        api=api,
        stream=bool(body.get("stream")),
        budget_ms=budget_ms,
        affinity_key=key,
        affinity_source=source,
        client_ip=client_ip,
        location=location,
        prefix_blocks=blocks,
    )


def mean_logprob(answer: Mapping[str, Any]) -> float | None:
    """The mean token logprob of a chat or completions answer (its ``logprobs``), or None
    when it carries none."""
    values: list[float] = []
    choices = answer.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        if not isinstance(logprobs, dict):
            continue
        if isinstance(logprobs.get("content"), list):  # chat
            values += [t.get("logprob") for t in logprobs["content"] if isinstance(t, dict)]
        elif isinstance(logprobs.get("token_logprobs"), list):  # completions
            values += logprobs["token_logprobs"]
    finite = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None
