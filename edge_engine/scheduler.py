"""Continuous batching with a token budget and a time target per step (plain Python).

Each ``schedule()`` builds one step, priority class by priority class (interactive, then
standard, then batch): first the class's running sequences (a decode row costs one token,
an unfinished prefill continues with a chunk), least recently scheduled first, then its
waiting sequences (prefix-cache hits first, then a prefill chunk) while the token budget,
the batch size and the block pool allow.  When blocks run out, the lowest-priority,
latest-arrived running sequence is *preempted*: its blocks are freed and it goes back to the
waiting queue, to be recomputed later (its full blocks usually survive in the prefix cache).
A waiting sequence may preempt running sequences of a strictly lower priority to get in.

Token time: a class may have a time-per-output-token objective (``tpot_objectives``:
priority -> seconds; ``edge.tpot_ms``).  Every token of a step's rows comes when the step
ends, so a step that holds a row of such a class should take at most that objective.  The
step's length is predicted by ``cost`` (``StepCostModel``: fixed + per decode row + per
prefill token, fitted online on the measured steps, so it follows the node's load).  The
tightest objective among the rows already in the step is its *target*; a row of a class at
least as urgent as the one that sets it always runs (its prefill chunk cut to keep the
target, at least a block), a less urgent row -- a batch decode, a batch prefill chunk --
runs only if the step is still predicted to meet the target, else it is *parked* for this
step: it keeps its blocks and its place, and rows parked take turns (least recently
scheduled first).  With no objective in the step, its batch prefill chunks add together at
most the tightest configured objective to it, so long prompts never stall for long a
request that arrives meanwhile.  ``load()`` is the snapshot the engine's admission predicts with
(``edge_engine.admission``).

Flow control: a sequence whose reader has more than ``max_pending_outputs`` deltas unread
is *paused*: it is skipped (running, it keeps its blocks; waiting after a preemption, it is
not brought back) until the reader catches up, while the rest of the batch keeps going.
Deadlines: ``remove_expired(now)`` drops waiting sequences that never started and whose
deadline has passed, before they cost a prefill.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .admission import Load
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus
from .step_cost import StepCostModel

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    parked: list[Sequence] = field(default_factory=list)  # running, left out of this step to keep a target
    predicted_time: float = 0.0  # seconds, by the cost model

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for _, n in self.scheduled if n == 1)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.scheduled if n > 1)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_pending_outputs: int | None = None,
        tpot_objectives: Mapping[int, float | None] | None = None,
        cost: StepCostModel | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pending_outputs = max_pending_outputs  # None: never pause
        # priority -> seconds per output token; a class absent (or None) has no objective
        self.tpot_objectives = {int(p): t for p, t in (tpot_objectives or {}).items() if t is not None}
        assert all(t > 0 for t in self.tpot_objectives.values())
        self.tightest_objective = min(self.tpot_objectives.values(), default=None)
        self.cost = cost if cost is not None else StepCostModel()
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_parked_rows = 0  # row-steps left out to keep a target, since start
        self._last_step: dict[int, int] = {}  # seq_id -> the step that last scheduled it

    # -- queue ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def is_paused(self, seq: Sequence) -> bool:
        """Its reader is ``max_pending_outputs`` deltas behind: schedule nothing for it."""
        return self.max_pending_outputs is not None and seq.num_pending_outputs >= self.max_pending_outputs

    @property
    def num_paused(self) -> int:
        return sum(1 for seq in self.running if self.is_paused(seq))

    def next_deadline(self) -> float | None:
        """The earliest deadline among waiting sequences not yet started (None: no deadline)."""
        deadlines = [s.deadline for s in self.waiting if s.deadline is not None and not s.is_started]
        return min(deadlines) if deadlines else None

    def remove_expired(self, now: float) -> list[Sequence]:
        """Finish (reason "deadline") the waiting sequences that never started and whose
        deadline is ``<= now``; returns them.  Started ones keep going: their prefill is paid."""
        expired = [s for s in self.waiting if s.deadline is not None and not s.is_started and s.deadline <= now]
        for seq in expired:
            self.finish(seq, "deadline")
        return expired

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Remove ``seq`` (finished, aborted or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._last_step.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        if reason is not None and seq.finish_reason is None:
            seq.finish_reason = reason

    def find(self, seq_id: int) -> Sequence | None:
        for seq in self.running:
            if seq.seq_id == seq_id:
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                return seq
        return None

    def load(self, in_flight: SchedulerOutput | None = None) -> Load:
        """What the engine's admission predicts with: the state once ``in_flight`` (the step
        just scheduled, if any) has run.  Call it on the thread that schedules; the value is
        immutable and may be read anywhere."""
        computing = {seq.seq_id: n for seq, n in in_flight.scheduled} if in_flight is not None else {}
        decode_rows: dict[int, int] = {}
        running: dict[int, int] = {}
        waiting: dict[int, int] = {}
        prefilling: dict[int, int] = {}
        prefill_tokens: dict[int, int] = {}
        fewest_left: dict[int, int] = {}
        for seq in self.running:
            p = seq.priority
            running[p] = running.get(p, 0) + 1
            left = seq.max_tokens - seq.num_output_tokens
            fewest_left[p] = min(fewest_left.get(p, left), left)
            uncomputed = seq.num_uncomputed_tokens - computing.get(seq.seq_id, 0)
            if uncomputed <= 1:  # decoding (or about to)
                decode_rows[p] = decode_rows.get(p, 0) + 1
            else:
                prefilling[p] = prefilling.get(p, 0) + 1
                prefill_tokens[p] = prefill_tokens.get(p, 0) + uncomputed
        for seq in self.waiting:
            p = seq.priority
            waiting[p] = waiting.get(p, 0) + 1
            prefilling[p] = prefilling.get(p, 0) + 1
            prefill_tokens[p] = prefill_tokens.get(p, 0) + seq.num_tokens
        return Load(
            decode_rows=decode_rows,
            running=running,
            waiting=waiting,
            prefilling=prefilling,
            prefill_tokens=prefill_tokens,
            fewest_tokens_left=fewest_left,
            num_running=len(self.running),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            min_chunk=self.block_manager.block_size,
        )

    # -- one step ------------------------------------------------------------------------
    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> int:
        """Free ``victim``'s blocks and requeue it; returns the budget it gives back."""
        refund = 0
        for i, (seq, n) in enumerate(out.scheduled):
            if seq is victim:
                del out.scheduled[i]
                refund = n
                break
        if victim in out.parked:
            out.parked.remove(victim)
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, victim, key=Sequence.sort_key)
        out.preempted.append(victim)
        return refund

    def schedule(self) -> SchedulerOutput:
        """One step: the priority classes in order, each its running sequences (least
        recently scheduled first) then its waiting ones, while the token budget, the batch,
        the block pool and the step-time target allow (see the module docstring)."""
        bm = self.block_manager
        out = SchedulerOutput()
        self.num_steps += 1
        waiting_blocked = False  # no batch slot (or blocks) for the waiting: none of a lower class gets one either
        for priority in sorted({s.priority for s in self.running} | {s.priority for s in self.waiting}):
            # 1. this class's running sequences: decode rows and unfinished prefills
            running = [s for s in self.running if s.priority == priority]
            running.sort(key=lambda s: (self._last_step.get(s.seq_id, -1), s.sort_key()))
            for seq in running:
                if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                    continue
                budget = self.max_num_batched_tokens - out.num_tokens
                if budget <= 0:
                    break
                if self.is_paused(seq):
                    continue
                n = self._fit(seq, min(seq.num_uncomputed_tokens, budget), out)
                if n == 0:
                    out.parked.append(seq)
                    continue
                while not bm.can_allocate(bm.num_blocks_needed(seq, n)):
                    victim = self.running[-1]  # lowest priority, latest arrival
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.allocate(seq, n)
                self._scheduled(seq, n, out)

            # 2. this class's waiting sequences, in order, while budget, batch and blocks allow
            for seq in [s for s in self.waiting if s.priority == priority]:
                if waiting_blocked:
                    break
                budget = self.max_num_batched_tokens - out.num_tokens
                if budget <= 0:
                    break
                if self.is_paused(seq):  # preempted while its reader lagged: leave it out for now
                    continue
                if seq in out.preempted:  # do not bring back what this step just evicted
                    waiting_blocked = True
                    break
                if len(self.running) >= self.max_num_seqs and not self._make_room_for(seq, out, need_blocks=0):
                    waiting_blocked = True
                    break
                hits = bm.find_cached_blocks(seq)
                num_computed = len(hits) * bm.block_size
                n = self._fit(seq, min(seq.num_tokens - num_computed, self.max_num_batched_tokens - out.num_tokens), out)
                if n == 0:  # it would make the step miss an objective: it waits
                    break
                need = bm.num_blocks_for(num_computed + n) - len(hits) + bm.num_new_blocks_with_hits(hits)
                if not bm.can_allocate(need):
                    if not self._make_room_for(seq, out, need_blocks=need):
                        waiting_blocked = True
                        break
                    hits = bm.find_cached_blocks(seq)  # preemption may have changed the free queue
                    num_computed = len(hits) * bm.block_size
                    budget = self.max_num_batched_tokens - out.num_tokens
                    n = min(n, seq.num_tokens - num_computed, budget)
                    need = bm.num_blocks_for(num_computed + n) - len(hits) + bm.num_new_blocks_with_hits(hits)
                    if n <= 0 or not bm.can_allocate(need):
                        waiting_blocked = True
                        break
                self.waiting.remove(seq)
                bm.allocate_cached(seq, hits)
                bm.allocate(seq, n)
                seq.status = SequenceStatus.RUNNING
                if not seq.is_started:
                    seq.is_started = True
                    seq.started_time = time.monotonic()
                bisect.insort(self.running, seq, key=Sequence.sort_key)
                self._scheduled(seq, n, out)
        out.predicted_time = self.cost.predict(out.num_decode_rows, out.num_prefill_tokens)
        self.num_parked_rows += len(out.parked)
        return out

    def _scheduled(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        out.scheduled.append((seq, n))
        self._last_step[seq.seq_id] = self.num_steps

    # -- step time ---------------------------------------------------------------------
    def objective(self, seq: Sequence) -> float | None:
        """The time-per-output-token objective of ``seq``'s class, in seconds (None: none)."""
        return self.tpot_objectives.get(seq.priority)

    def _target(self, out: SchedulerOutput) -> tuple[float | None, int]:
        """The step's time target so far (the tightest objective among its rows; None: no
        row has one) and the priority of the class that sets it."""
        target, setter = None, -1
        for seq, _ in out.scheduled:
            objective = self.tpot_objectives.get(seq.priority)
            if objective is not None and (target is None or objective < target):
                target, setter = objective, seq.priority
        return target, setter

    def _fit(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        """How many of ``n`` tokens ``seq`` may compute in this step (0: park it).

        A row at least as urgent as the class that sets the step's target always runs;
        its prefill chunk is cut so the step still meets the target (at least a block).
        A less urgent row runs only if the step then still meets the target, its prefill
        chunk cut to fit.  With no target in the step, the prefill chunks of classes without
        an objective add together at most the tightest configured objective to the step (at
        least a block), so long batch prompts never hold up for long an interactive request
        that arrives meanwhile.
        """
        if n <= 0:
            return 0
        cost = self.cost
        target, setter = self._target(out)
        rows, tokens = out.num_decode_rows, out.num_prefill_tokens
        decode = n == 1
        if target is None:
            if decode or self.tightest_objective is None or self.objective(seq) is not None:
                return n
            # all such chunks of the step together add at most the tightest objective; the
            # first one gets at least a block, so prompts always progress
            allowed = self._tokens_within(cost.predict(rows, 0) + self.tightest_objective, rows, tokens)
            if tokens == 0:
                allowed = max(allowed, self.block_manager.block_size)
            return min(n, allowed)
        urgent = seq.priority <= setter
        if decode:
            return 1 if urgent or cost.predict(rows + 1, tokens) <= target else 0
        fit = min(n, self._tokens_within(target, rows, tokens))
        if urgent:
            return max(fit, min(n, self.block_manager.block_size))
        return max(fit, 0)

    def _tokens_within(self, limit: float, rows: int, tokens: int) -> int:
        """The most prefill tokens a step of ``rows`` decodes and ``tokens`` prefill tokens
        can add and still be predicted to take at most ``limit`` seconds."""
        per_token = self.cost.coefficients[2]
        room = limit - self.cost.predict(rows, tokens)
        if room <= 0:
            return 0
        if per_token <= 0:
            return self.max_num_batched_tokens
        return int(room / per_token)

    def _make_room_for(self, seq: Sequence, out: SchedulerOutput, *, need_blocks: int) -> bool:
        """Preempt running sequences of lower priority than ``seq`` until a batch slot and
        ``need_blocks`` free blocks are available.  Returns whether that worked."""
        bm = self.block_manager
        victims = [s for s in reversed(self.running) if s.priority > seq.priority]
        # only worth it if preempting all of them would be enough
        freeable = sum(1 for v in victims for b in v.block_table if bm.blocks[b].ref_count == 1)
        if not victims or bm.num_free_blocks + freeable < need_blocks:
            return False
        for victim in victims:
            if len(self.running) < self.max_num_seqs and bm.can_allocate(need_blocks):
                break
            self._preempt(victim, out)
        return len(self.running) < self.max_num_seqs and bm.can_allocate(need_blocks)
