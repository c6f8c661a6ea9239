"""What a run asks: synthetic prompts of a chosen length, or the lines of a JSONL dataset.

Synthetic prompts are random common English words, one word standing for one token (short
common words are single tokens in the usual BPE vocabularies, so ``--input-len 256`` asks
roughly 256 prompt tokens of any model without loading its tokenizer). ``--range-ratio r``
draws each prompt's length and ``max_tokens`` uniformly from ``[n·(1−r), n·(1+r)]``. Every
draw comes from a ``random.Random`` seeded from ``--seed`` and the repetition, so a run is
reproducible and the repetitions of one invocation do not repeat each other's prompts (a
response cache would otherwise answer the second repetition).

A dataset line is a JSON object with ``prompt`` (a string) or ``messages`` (OpenAI chat
messages), optionally ``max_tokens`` and ``extra_body`` (fields merged into that request's
body). Lines are used in order, from the start again when the run needs more.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadgen.types import RequestSpec

__all__ = ["BodyBuilder", "DatasetError", "Prompt", "SyntheticPrompts", "dataset_prompts", "load_dataset"]

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should world high every near add food between own below country "
    "plant last school father keep tree never start city earth eye light thought head under story saw left"
).split()


class DatasetError(ValueError):
    """A dataset file that cannot be used, naming the file and line."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's content, before it is rendered for an endpoint."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def words(self) -> int:
        if self.text is not None:
            return len(self.text.split())
        return sum(len(str(m.get("content", "")).split()) for m in self.messages or ())


def _length(rng: random.Random, n: int, ratio: float) -> int:
    low, high = max(1, math.floor(n * (1 - ratio))), max(1, math.ceil(n * (1 + ratio)))
    return n if ratio <= 0 else rng.randint(low, high)


class SyntheticPrompts:
    """Endless prompts of about ``input_len`` words asking ``output_len`` tokens.

    Drawing every word of every prompt would cost ~60 µs a prompt, more than sending it;
    instead a corpus of random words is drawn once and each prompt is a window of it at a
    random offset, behind three freshly drawn words, so that no two prompts share a
    beginning (a prefix or response cache would otherwise answer part of the load)."""

    _HEAD = 3

    def __init__(self, rng: random.Random, input_len: int, output_len: int, range_ratio: float = 0.0) -> None:
        self.rng = rng
        self.input_len = input_len
        self.output_len = output_len
        self.range_ratio = range_ratio
        longest = max(1, math.ceil(input_len * (1 + range_ratio)))
        words = rng.choices(WORDS, k=max(4096, 4 * longest))
        self.text = " ".join(words)
        self.starts = list(itertools.accumulate((len(w) + 1 for w in words), initial=0))  # word i at starts[i]
        self.count = len(words)

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        rng = self.rng
        words = _length(rng, self.input_len, self.range_ratio)
        max_tokens = _length(rng, self.output_len, self.range_ratio)
        head = rng.choices(WORDS, k=min(words, self._HEAD))
        body = words - len(head)
        if body:
            first = rng.randrange(self.count - body + 1)
            head.append(self.text[self.starts[first] : self.starts[first + body] - 1])
        return Prompt(text=" ".join(head), max_tokens=max_tokens)


def load_dataset(path: str) -> list[Prompt]:
    try:
        with open(path, "rb") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append(_prompt(orjson.loads(line)))
        except orjson.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not JSON: {exc}") from None
        except ValueError as exc:
            raise DatasetError(f"{path}:{number}: {exc}") from None
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def _prompt(item: object) -> Prompt:
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    text, messages = item.get("prompt"), item.get("messages")
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if text is not None and not isinstance(text, str):
        raise ValueError("'prompt' must be a string")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise ValueError("'messages' must be a list of objects")
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError("'max_tokens' must be a positive integer")
    extra = item.get("extra_body", {})
    if not isinstance(extra, dict):
        raise ValueError("'extra_body' must be an object")
    return Prompt(text=text, messages=messages, max_tokens=max_tokens, extra_body=extra)


def dataset_prompts(prompts: list[Prompt]) -> Iterator[Prompt]:
    """The dataset's prompts in order, over and over."""
    return itertools.cycle(prompts)


class BodyBuilder:
    """Renders prompts as request bodies for one endpoint, model and streaming mode."""

    def __init__(self, kind: str, model: str, stream: bool, extra_body: dict[str, Any] | None = None) -> None:
        self.kind = kind  # "chat" or "completions"
        self.model = model
        self.stream = stream
        self.extra_body = extra_body or {}

    def build(self, prompt: Prompt) -> RequestSpec:
        body: dict[str, Any] = {"model": self.model}
        if self.kind == "chat":
            body["messages"] = prompt.messages if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text if prompt.text is not None else "\n".join(str(m.get("content", "")) for m in prompt.messages)
        if prompt.max_tokens is not None:
            body["max_tokens"] = prompt.max_tokens
        body["stream"] = self.stream
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        body.update(prompt.extra_body)
        return RequestSpec(orjson.dumps(body), prompt.words, prompt.max_tokens)
