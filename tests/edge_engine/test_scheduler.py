"""Scheduling decisions: token budget, chunked prefill, priorities, preemption (no model)."""

from __future__ import annotations

from edge_engine.block_manager import BlockManager
from edge_engine.sampling import SamplingParams
from edge_engine.scheduler import Scheduler
from edge_engine.sequence import Priority, Sequence, SequenceStatus


def make(num_blocks=32, block_size=4, budget=16, max_seqs=8):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def seq_of(n: int, priority=Priority.INTERACTIVE, start=0, arrival=None) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(temperature=0), priority=priority, arrival_time=arrival)


def run_step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """Schedule, then pretend the model ran: advance KV and sample token 7 where due."""
    out = sched.schedule()
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.block_manager.register_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    live = sched.running + sched.waiting
    sched.block_manager.check_invariants(live)
    return [(s, n) for s, n in out.scheduled]


def test_budget_chunks_a_long_prefill():
    _, sched = make(budget=16)
    seq = seq_of(40)
    sched.add(seq)
    assert [n for _, n in run_step(sched)] == [16]
    assert [n for _, n in run_step(sched)] == [16]
    assert [n for _, n in run_step(sched)] == [8]
    assert seq.num_output_tokens == 1  # sampled only once the whole prompt was in
    assert [n for _, n in run_step(sched)] == [1]


def test_decode_rows_come_first_and_prefill_takes_the_rest_of_the_budget():
    _, sched = make(budget=16)
    a, b = seq_of(3, arrival=1.0), seq_of(3, arrival=2.0, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefills fit: 6 tokens
    long = seq_of(40, start=100, arrival=3.0)
    sched.add(long)
    step = run_step(sched)
    assert [(s, n) for s, n in step] == [(a, 1), (b, 1), (long, 14)]
    assert sum(n for _, n in step) == 16


def test_max_num_seqs_limits_the_batch():
    _, sched = make(budget=64, max_seqs=2)
    seqs = [seq_of(2, start=10 * i, arrival=float(i)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step = run_step(sched)
    assert [s for s, _ in step] == seqs[:2]
    assert sched.num_waiting == 2


def test_interactive_waits_less_than_batch():
    _, sched = make(budget=4)
    batch = seq_of(4, Priority.BATCH, arrival=1.0)
    interactive = seq_of(4, Priority.INTERACTIVE, start=20, arrival=2.0)
    sched.add(batch)
    sched.add(interactive)
    assert [s for s, _ in run_step(sched)] == [interactive]


def test_preemption_frees_blocks_instead_of_failing_and_recomputes_later():
    # 6 blocks of 4 tokens; two sequences of 11 tokens take 3 blocks each, then grow
    bm, sched = make(num_blocks=6, block_size=4, budget=32)
    old, young = seq_of(11, arrival=1.0), seq_of(11, start=40, arrival=2.0)
    sched.add(old)
    sched.add(young)
    run_step(sched)  # prefill both: pool full, each sampled its 12th token
    assert bm.num_free_blocks == 0
    run_step(sched)  # token 12 still fits in block 3
    step = run_step(sched)  # both need a 4th block for token 13: the younger one is preempted
    assert [s for s, _ in step] == [old]
    assert young.status is SequenceStatus.WAITING and young.block_table == [] and young.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    sched.finish(old, "stop")
    step = run_step(sched)
    # recomputed from its tokens; the head of its prompt came back from the prefix cache
    # (its tail block was evicted first, to give the older sequence room)
    assert [(s, n) for s, n in step] == [(young, 13 - 8)]
    assert young.num_output_tokens == 3


def test_waiting_interactive_preempts_running_batch_when_blocks_run_out():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    batch = seq_of(15, Priority.BATCH, arrival=1.0)
    sched.add(batch)
    run_step(sched)
    assert bm.num_free_blocks == 0
    interactive = seq_of(6, Priority.INTERACTIVE, start=60, arrival=2.0)
    sched.add(interactive)
    step = run_step(sched)
    assert [s for s, _ in step] == [interactive]
    assert batch.status is SequenceStatus.WAITING and batch.num_preemptions == 1


def test_a_batch_request_never_preempts_interactive():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    interactive = seq_of(15, Priority.INTERACTIVE, arrival=1.0)
    sched.add(interactive)
    run_step(sched)
    batch = seq_of(6, Priority.BATCH, start=60, arrival=2.0)
    sched.add(batch)
    step = run_step(sched)
    assert [s for s, _ in step] == [interactive]
    assert batch.status is SequenceStatus.WAITING and sched.num_preemptions == 0


def test_finish_frees_blocks():
    bm, sched = make()
    seq = seq_of(9)
    sched.add(seq)
    run_step(sched)
    assert bm.num_used_blocks == 3
    sched.finish(seq, "abort")
    assert bm.num_used_blocks == 0 and not sched.has_work() and seq.finish_reason == "abort"


def test_a_sequence_whose_reader_lags_is_paused_and_keeps_its_blocks():
    bm, sched = make(budget=16)
    sched.max_pending_outputs = 2
    slow, fast = seq_of(3, arrival=1.0), seq_of(3, start=50, arrival=2.0)
    sched.add(slow)
    sched.add(fast)
    run_step(sched)  # both prefilled
    slow.num_outputs_produced = 2  # two deltas unread
    blocks = list(slow.block_table)
    assert sched.is_paused(slow) and not sched.is_paused(fast)
    assert [s for s, _ in run_step(sched)] == [fast]
    assert slow.block_table == blocks and slow.status is SequenceStatus.RUNNING and sched.num_paused == 1
    slow.num_outputs_consumed = 1  # the reader caught up below the bound
    assert [s for s, _ in run_step(sched)] == [slow, fast]


def test_a_paused_sequence_in_the_waiting_queue_is_skipped_until_its_reader_catches_up():
    _, sched = make(budget=16)
    sched.max_pending_outputs = 1
    paused, other = seq_of(3, arrival=1.0), seq_of(3, start=50, arrival=2.0)
    sched.add(paused)
    sched.add(other)
    paused.num_outputs_produced = 1  # as after a preemption, with a delta still unread
    assert [s for s, _ in run_step(sched)] == [other]  # skipped, the next one in line goes
    assert paused.status is SequenceStatus.WAITING and not paused.is_started
    paused.num_outputs_consumed = 1
    assert [s for s, _ in run_step(sched)] == [other, paused]


def test_expired_waiting_sequences_are_removed_unstarted_ones_only():
    bm, sched = make(budget=4, max_seqs=1)
    started = seq_of(3, arrival=1.0)
    started.deadline = 5.0
    sched.add(started)
    run_step(sched)
    late, in_time = seq_of(3, start=20, arrival=2.0), seq_of(3, start=40, arrival=3.0)
    no_deadline = seq_of(3, start=60, arrival=4.0)
    late.deadline, in_time.deadline = 10.0, 30.0
    for s in (late, in_time, no_deadline):
        sched.add(s)
    assert sched.next_deadline() == 10.0  # the running one's deadline no longer counts
    assert sched.remove_expired(now=9.0) == []
    assert sched.remove_expired(now=10.0) == [late]
    assert late.is_finished and late.finish_reason == "deadline" and late.block_table == []
    assert sched.waiting == [in_time, no_deadline] and sched.running == [started]
    assert sched.next_deadline() == 30.0
    bm.check_invariants(sched.running + sched.waiting)
