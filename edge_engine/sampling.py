"""Sampling parameters and the sampler.

``SamplingParams`` is plain Python and validated when built (``InvalidRequestError`` naming
the parameter). ``sample`` turns one step's logits into token ids, row by row, each row
with its own ``torch.Generator`` so a seeded request draws the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import InvalidRequestError

__all__ = ["SamplingParams", "SampleResult", "apply_token_bitmask", "sample"]

MAX_TOP_LOGPROBS = 20


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # reproducible per request when set
    max_tokens: int | None = 16  # None = up to the context window
    min_tokens: int = 0  # stop conditions are ignored before this many tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop token ids (not included)
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each chosen token
    top_logprobs: int = 0  # and the n most likely alternatives
    # a compiled grammar (edge_engine.grammar.Grammar) the output must follow; each sequence
    # gets its own matcher, and its mask is applied to the logits before sampling
    grammar: Any = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature must be a number >= 0", "temperature", "invalid_value")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError("top_k must be an integer >= -1 (-1 or 0 disable it)", "top_k", "invalid_value")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be a number in (0, 1]", "top_p", "invalid_value")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError("seed must be an integer", "seed", "invalid_type")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidRequestError("max_tokens must be an integer >= 1", "max_tokens", "invalid_value")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens must be an integer >= 0", "min_tokens", "invalid_value")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of them", "stop", "invalid_type")
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop strings", "stop", "invalid_value")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids", "invalid_type")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError("logprobs must be a boolean", "logprobs", "invalid_type")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs", "invalid_value"
            )
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    # logits: [V] float32
    x = logits / params.temperature
    vocab_size = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    if top_k == 0 and params.top_p >= 1.0:
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
    if top_k:
        values, indices = torch.topk(x, top_k)
    else:
        values, indices = torch.sort(x, descending=True)
    if params.top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = (torch.cumsum(probs, dim=-1) - probs) < params.top_p
        values, indices = values[keep], indices[keep]
    probs = torch.softmax(values, dim=-1)
    return int(indices[torch.multinomial(probs, 1, generator=generator)])


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the tokens each row's grammar forbids.

    logits: [N, V] float32; rows: the n rows to mask; bitmask: [n, W] int32 (CPU), bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (W = ceil(V / 32)).

    On the CPU this is numpy, on one thread: a row is 49,152 elements, above torch's grain
    for splitting an op across its threads, and a parallel region on a busy machine waits
    for its slowest thread -- measured here at 50-260 ms a call instead of ~50 us.
    """
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype == torch.float32:
        # little-endian int32 words are bytes in token order, each byte's bits low first
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]  # [n, V]
        view = logits.numpy()
        for j, r in enumerate(rows):
            np.putmask(view[r], allowed[j] == 0, -np.inf)
        return
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    mask = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()  # [n, V]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~mask, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampleResult]:
    """Pick one token per row.  logits: [B, V] (float32, any device)."""
    assert logits.shape[0] == len(params) == len(generators)
    logits = logits.float()
    greedy_ids = torch.argmax(logits, dim=-1).tolist() if any(p.is_greedy for p in params) else None
    need_logprobs = any(p.logprobs for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
    results: list[SampleResult] = []
    for i, (p, gen) in enumerate(zip(params, generators)):
        token_id = greedy_ids[i] if p.is_greedy else _sample_row(logits[i], p, gen)
        result = SampleResult(token_id)
        if p.logprobs:
            assert logprobs is not None
            result.logprob = float(logprobs[i, token_id])
            if p.top_logprobs:
                values, indices = torch.topk(logprobs[i], p.top_logprobs)
                result.top_logprobs = list(zip(indices.tolist(), values.tolist()))
        results.append(result)
    return results
