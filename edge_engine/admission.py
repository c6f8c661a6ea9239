"""Admission by prediction: can a request get its first token within its budget, and its
later tokens within its class's time-per-output-token objective? (plain Python)

The engine asks this before it queues a request; a request that cannot make both is refused
at once (``EngineOverloadedError`` with code ``deadline_unattainable`` or
``tpot_unattainable``: 503 + Retry-After), which the gateway takes as a refused target and
escalates to its next one -- better than a 504 after the whole budget was spent waiting.

The prediction reads a ``Load`` (a snapshot the scheduler takes each step: rows decoding,
prompts still to prefill, per priority class) and the engine's ``StepCostModel``, fitted on
the measured steps, so a node that gets busier -- a CPU hog beside the engine -- raises the
predicted times within a few steps and admission refuses what it can no longer serve in
time.  It follows the scheduler's rules (``edge_engine.scheduler``):

- time to first token = what is left of the step in flight + the wait for a batch slot
  (none if a less urgent sequence can be preempted; else until the running sequence with
  the fewest tokens left ends) + the steps that prefill the prompts ahead of it (its class
  and more urgent ones) and its own, each step sized as the scheduler will size it: the
  decode rows of its class and more urgent ones, a prefill chunk cut to keep their
  objectives, and the less urgent rows that still fit its target;
- time per output token = a decode step of every sequence of its class and more urgent
  ones plus itself (less urgent rows are parked for it; at most a full batch), against the
  tightest objective among them.

Prefix-cache hits are not counted: the prediction errs towards refusing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .step_cost import StepCostModel

__all__ = ["Forecast", "Load", "forecast"]


@dataclass(frozen=True, slots=True)
class Load:
    """The engine's work once the step in flight ends, per priority class."""

    max_num_seqs: int
    max_num_batched_tokens: int
    min_chunk: int  # the smallest prefill chunk an urgent sequence gets (a block)
    decode_rows: Mapping[int, int] = field(default_factory=dict)  # running, decoding
    running: Mapping[int, int] = field(default_factory=dict)  # running (decoding or mid-prompt)
    prefilling: Mapping[int, int] = field(default_factory=dict)  # running mid-prompt, or waiting
    waiting: Mapping[int, int] = field(default_factory=dict)  # waiting for a batch slot
    prefill_tokens: Mapping[int, int] = field(default_factory=dict)  # prompt tokens still to compute
    fewest_tokens_left: Mapping[int, int] = field(default_factory=dict)  # running: fewest output tokens left
    num_running: int = 0

    def with_queued(self, queued: Iterable[tuple[int, int]]) -> Load:
        """This load plus requests accepted but not yet seen by the scheduler: (priority,
        prompt tokens) each."""
        prefilling, waiting, tokens = dict(self.prefilling), dict(self.waiting), dict(self.prefill_tokens)
        for priority, n in queued:
            prefilling[priority] = prefilling.get(priority, 0) + 1
            waiting[priority] = waiting.get(priority, 0) + 1
            tokens[priority] = tokens.get(priority, 0) + n
        return Load(
            self.max_num_seqs, self.max_num_batched_tokens, self.min_chunk, self.decode_rows, self.running,
            prefilling, waiting, tokens, self.fewest_tokens_left, self.num_running,
        )


@dataclass(frozen=True, slots=True)
class Forecast:
    """Seconds from now to the first token (``inf``: it cannot start as things stand), and
    between tokens once it decodes, with the objective that must hold (None: none)."""

    ttft: float
    tpot: float
    tpot_limit: float | None

    @property
    def tpot_ok(self) -> bool:
        return self.tpot_limit is None or self.tpot <= self.tpot_limit


def _sum(values: Mapping[int, int], keep) -> int:
    return sum(n for p, n in values.items() if keep(p))


def _tokens_within(cost: StepCostModel, limit: float, rows: int) -> int:
    room = limit - cost.predict(rows, 0)
    per_token = cost.coefficients[2]
    if room <= 0:
        return 0
    return 1 << 30 if per_token <= 0 else int(room / per_token)


def forecast(
    load: Load,
    cost: StepCostModel,
    objectives: Mapping[int, float],
    priority: int,
    num_prompt_tokens: int,
    in_flight_left: float = 0.0,
) -> Forecast:
    """What a request of ``priority`` with a prompt of ``num_prompt_tokens`` tokens can
    expect, ``in_flight_left`` seconds before the step in flight ends."""
    p = priority
    own = objectives.get(p)
    rows_above = _sum(load.decode_rows, lambda q: q <= p)  # decode in every step of its prefill
    rows_all = _sum(load.decode_rows, lambda q: True)
    # the target its chunk must keep: the tightest objective among those rows' classes
    above = [objectives[q] for q, n in load.decode_rows.items() if q <= p and n and q in objectives]
    target = min(above, default=None)
    setter = min((q for q, n in load.decode_rows.items() if q <= p and n and objectives.get(q) == target), default=p)
    room = load.max_num_batched_tokens - rows_above
    if target is None:
        chunk = room
        tightest = min(objectives.values(), default=None)
        if own is None and tightest is not None:  # a prefill without an objective adds at most the tightest one
            per_token = cost.coefficients[2]
            chunk = min(chunk, max(load.min_chunk, int(tightest / per_token) if per_token > 0 else chunk))
    else:
        chunk = _tokens_within(cost, target, rows_above)
        if setter == p:
            chunk = max(chunk, load.min_chunk)
    chunk = min(chunk, room)
    # its prefill row's own objective is the target the less urgent rows must fit
    step_target = min((t for t in (target, own) if t is not None), default=None)
    if chunk <= 0:
        ttft = math.inf
    else:

        def step(tokens: int) -> float:
            base = cost.predict(rows_above, tokens)
            full = cost.predict(rows_all, tokens)
            return full if step_target is None else max(base, min(step_target, full))

        total = _sum(load.prefill_tokens, lambda q: q <= p) + num_prompt_tokens
        full_steps, last = divmod(total, chunk)
        ttft = in_flight_left + full_steps * step(chunk) + (step(last) if last else 0.0)
        waiting_above = _sum(load.waiting, lambda q: q <= p)
        preemptable = _sum(load.running, lambda q: q > p) > 0
        if load.num_running + waiting_above + 1 > load.max_num_seqs and not preemptable:
            left = min((n for q, n in load.fewest_tokens_left.items() if q <= p), default=0)
            ttft += left * cost.predict(rows_all, 0)
    # its tokens, once it decodes: every row of its class and more urgent ones, and itself
    # (at most a full batch: beyond it, sequences wait for a slot instead of slowing steps)
    rows = min(load.max_num_seqs, _sum(load.decode_rows, lambda q: q <= p) + _sum(load.prefilling, lambda q: q <= p) + 1)
    limits = [objectives[q] for q in objectives if q <= p and (q == p or load.decode_rows.get(q, 0) + load.prefilling.get(q, 0))]
    return Forecast(ttft=ttft, tpot=cost.predict(rows, 0), tpot_limit=min(limits) if own is not None else None)
