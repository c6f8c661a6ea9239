"""Continuous batching with a token budget per step (plain Python).

Each ``schedule()`` builds one step: first the running sequences in priority order (a decode
row costs one token, an unfinished prefill continues with a chunk), then waiting sequences
(prefix-cache hits first, then a prefill chunk) while the budget, the batch size and the
block pool allow.  When blocks run out, the lowest-priority, latest-arrived running
sequence is *preempted*: its blocks are freed and it goes back to the waiting queue, to be
recomputed later (its full blocks usually survive in the prefix cache).  A waiting sequence
may preempt running sequences of a strictly lower priority (batch) to get in.

Flow control: a sequence whose reader has more than ``max_pending_outputs`` deltas unread
is *paused*: it is skipped (running, it keeps its blocks; waiting after a preemption, it is
not brought back) until the reader catches up, while the rest of the batch keeps going.
Deadlines: ``remove_expired(now)`` drops waiting sequences that never started and whose
deadline has passed, before they cost a prefill.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pending_outputs = max_pending_outputs  # None: never pause
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0

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

    # -- one step ------------------------------------------------------------------------
    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> int:
        """Free ``victim``'s blocks and requeue it; returns the budget it gives back."""
        refund = 0
        for i, (seq, n) in enumerate(out.scheduled):
            if seq is victim:
                del out.scheduled[i]
                refund = n
                break
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, victim, key=Sequence.sort_key)
        out.preempted.append(victim)
        return refund

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. running sequences: decode rows and unfinished prefills, most urgent first
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if budget == 0:
                break
            if self.is_paused(seq):
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            assert n > 0
            while not bm.can_allocate(bm.num_blocks_needed(seq, n)):
                victim = self.running[-1]  # lowest priority, latest arrival
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n

        # 2. waiting sequences, in priority order, while budget, batch and blocks allow
        for seq in list(self.waiting):
            budget = self.max_num_batched_tokens - out.num_tokens
            if budget <= 0:
                break
            if self.is_paused(seq):  # preempted while its reader lagged: leave it out for now
                continue
            if seq in out.preempted:  # do not bring back what this step just evicted
                break
            if len(self.running) >= self.max_num_seqs and not self._make_room_for(seq, out, need_blocks=0):
                break
            hits = bm.find_cached_blocks(seq)
            num_computed = len(hits) * bm.block_size
            n = min(seq.num_tokens - num_computed, budget)
            need = bm.num_blocks_for(num_computed + n) - len(hits) + bm.num_new_blocks_with_hits(hits)
            if not bm.can_allocate(need):
                if not self._make_room_for(seq, out, need_blocks=need):
                    break
                hits = bm.find_cached_blocks(seq)  # preemption may have changed the free queue
                num_computed = len(hits) * bm.block_size
                budget = self.max_num_batched_tokens - out.num_tokens
                n = min(seq.num_tokens - num_computed, budget)
                need = bm.num_blocks_for(num_computed + n) - len(hits) + bm.num_new_blocks_with_hits(hits)
                if not bm.can_allocate(need):
                    break
            self.waiting.remove(seq)
            bm.allocate_cached(seq, hits)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            if not seq.is_started:
                seq.is_started = True
                seq.started_time = time.monotonic()
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            out.scheduled.append((seq, n))
        return out

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
