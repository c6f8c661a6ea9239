"""Per-request state (plain Python) and the deltas a request yields."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling import SampleResult, SamplingParams

__all__ = ["Sequence", "SequenceStatus", "Delta", "Priority", "StageTimes"]


class Priority(enum.IntEnum):
    """Lower runs first (the gateway's tenant classes, by the same names)."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """One request: its tokens, how far its KV is computed, and its block table.

    ``token_ids`` holds the prompt then the generated tokens.  ``num_computed_tokens`` of
    them have K/V in the cache; the rest (one after a decode step, many for a prefill, all of
    them after a preemption) are what the scheduler hands to the model next.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        priority: int = Priority.INTERACTIVE,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        deadline: float | None = None,
    ) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(_seq_counter)
        self.request_id = request_id or f"seq-{self.seq_id}"
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens if max_tokens is not None else (params.max_tokens or 1)
        self.priority = int(priority)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first schedule)
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks registered so far
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.deadline = deadline  # time.monotonic() after which a sequence not yet started is dropped
        self.is_started = False  # scheduled at least once (a preempted sequence stays started)
        self.started_time: float | None = None  # time.monotonic() of its first schedule
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # filled in by the engine
        self.generator: Any = None  # torch.Generator
        self.sink: Any = None  # (event loop, asyncio.Queue) the deltas go to
        self.detokenizer: Any = None
        self.constraint: Any = None  # grammar.Matcher when params.grammar is set
        self.output_text = ""
        self.num_emitted_chars = 0
        self.logprobs: list[SampleResult] = []
        # flow control: each counter is written by one thread only (produced by the step
        # thread, consumed by the reader), so their difference needs no lock
        self.num_outputs_produced = 0
        self.num_outputs_consumed = 0

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_pending_outputs(self) -> int:
        """Deltas handed to the reader's queue (or on their way to it) and not yet read."""
        return self.num_outputs_produced - self.num_outputs_consumed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then arrival (a preempted sequence keeps its place)."""
        return (self.priority, self.arrival_time, self.seq_id)

    def __repr__(self) -> str:
        return (
            f"<Sequence {self.seq_id} {self.status.value} prio={self.priority} tokens={self.num_tokens} "
            f"computed={self.num_computed_tokens} blocks={self.block_table}>"
        )


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Where a finished sequence's time went inside the engine, in seconds: ``queue`` from
    its arrival to its first schedule, ``prefill`` from there to its first token (prompt
    chunks and any wait for a batch slot between them), ``decode`` from the first token to
    the last. Preemption shows in ``decode``: the engine's view, not the client's."""

    queue: float
    prefill: float
    decode: float

    @classmethod
    def of(cls, seq: Sequence, now: float) -> StageTimes:
        started = seq.started_time if seq.started_time is not None else seq.arrival_time
        first = seq.first_token_time if seq.first_token_time is not None else now
        return cls(started - seq.arrival_time, first - started, now - first)


@dataclass(slots=True)
class Delta:
    """What ``Engine.generate`` yields: the new text and tokens since the previous delta."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None while running
    logprobs: list[SampleResult] | None = None  # one per token in token_ids, when asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    times: StageTimes | None = None  # on the last delta: where the sequence's time went
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
