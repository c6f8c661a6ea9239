"""Scheduling decisions: token budget, chunked prefill, priorities, preemption, steps sized to
TPOT objectives by a given step cost model (no model, no clock)."""

from __future__ import annotations

import pytest

from edge_engine.block_manager import BlockManager
from edge_engine.sampling import SamplingParams
from edge_engine.scheduler import Scheduler
from edge_engine.sequence import Priority, Sequence, SequenceStatus
from edge_engine.step_cost import StepCostModel
from tests.edge_engine.costs import FrozenCost


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


# -- time-per-output-token objectives: steps sized by the step cost model -------------------

OBJECTIVES = {Priority.INTERACTIVE: 0.100, Priority.STANDARD: 0.200}  # batch: none


def timed(cost: StepCostModel, budget=512, max_seqs=32, block_size=4) -> Scheduler:
    bm = BlockManager(512, block_size)
    return Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, tpot_objectives=OBJECTIVES, cost=cost)


def decoding(sched: Scheduler, n: int, priority: Priority, start: int) -> list[Sequence]:
    """``n`` sequences of ``priority`` past their prefill (each one decode row per step)."""
    seqs = [seq_of(2, priority, start=start + 3 * i, arrival=float(start + i)) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(100):
        if all(s.num_output_tokens for s in seqs):
            return seqs
        run_step(sched)
    raise AssertionError("not all of them got through their prefill")


def test_with_a_measured_step_time_that_misses_the_objective_batch_rows_are_parked_and_take_turns():
    cost = StepCostModel()
    for k in range(1, 33):  # measured: 10 ms a decode row, nothing fixed
        for _ in range(3):
            cost.observe(k, 0, 0.010 * k)
    sched = timed(cost)
    batch = decoding(sched, 20, Priority.BATCH, start=100)
    assert len(run_step(sched)) == 20  # no objective in the step: every batch row runs
    interactive = decoding(sched, 1, Priority.INTERACTIVE, start=0)[0]
    parked = sched.num_parked_rows
    step = run_step(sched)
    rows = [s for s, _ in step]
    # as many batch rows as fit beside it in 100 ms (1 + 9 at the measured ~10 ms a row): the
    # other ~11 batch rows wait this step
    assert rows[0] is interactive and len(rows) in (9, 10) and sched.num_parked_rows - parked == 21 - len(rows)
    assert cost.predict(len(rows), 0) <= 0.100 < cost.predict(len(rows) + 1, 0)
    assert all(s.status is SequenceStatus.RUNNING and s.block_table for s in batch)  # parked, not preempted
    second = [s for s, _ in run_step(sched)]
    assert second[0] is interactive and not set(rows[1:]) & set(second[1:])  # the parked ones go next
    assert cost.predict(len(second), 0) <= 0.100 + 1e-9
    for _ in range(60):  # the node gets faster: 2 ms a row
        cost.observe(21, 0, 0.002 * 21)
    assert len(run_step(sched)) == 21  # everyone fits again
    sched.finish(interactive, "stop")
    assert len(run_step(sched)) == 20


def test_an_urgent_prefill_is_chunked_to_keep_the_objective_of_the_rows_decoding():
    cost = FrozenCost(fixed=0.010, per_row=0.010, per_token=0.001)
    sched = timed(cost)
    decoding(sched, 5, Priority.INTERACTIVE, start=0)  # 5 rows: 60 ms
    new = seq_of(100, Priority.INTERACTIVE, start=200, arrival=100.0)
    sched.add(new)
    step = dict(run_step(sched))
    assert step[new] == 40  # 40 ms of prefill left in the 100 ms target
    assert cost.predict(5, step[new]) == pytest.approx(0.100)


def test_an_urgent_prefill_gets_at_least_a_block_even_when_the_target_is_spent():
    cost = FrozenCost(fixed=0.010, per_row=0.020, per_token=0.001)
    sched = timed(cost, block_size=4)
    decoding(sched, 5, Priority.INTERACTIVE, start=0)  # 110 ms already: past the target
    new = seq_of(100, Priority.INTERACTIVE, start=200, arrival=100.0)
    sched.add(new)
    assert dict(run_step(sched))[new] == 4


def test_a_batch_prefill_alone_adds_at_most_the_tightest_objective_to_a_step():
    cost = FrozenCost(fixed=0.010, per_row=0.004, per_token=0.002)
    sched = timed(cost)
    decoding(sched, 10, Priority.BATCH, start=0)
    long = seq_of(300, Priority.BATCH, start=100, arrival=100.0)
    sched.add(long)
    step = dict(run_step(sched))
    assert len(step) == 11 and step[long] == 50  # 100 ms of prefill at 2 ms a token
    # an interactive prompt is not held to it: its first token matters more
    prompt = seq_of(300, Priority.INTERACTIVE, start=500, arrival=200.0)
    sched.add(prompt)
    step = dict(run_step(sched))
    assert step[prompt] == 300


def test_while_an_urgent_prompt_is_prefilled_batch_rows_only_fill_what_its_objective_leaves():
    cost = FrozenCost(fixed=0.010, per_row=0.005, per_token=0.001)
    sched = timed(cost)
    batch = decoding(sched, 20, Priority.BATCH, start=0)
    prompt = seq_of(60, Priority.INTERACTIVE, start=500, arrival=200.0)
    sched.add(prompt)
    step = dict(run_step(sched))
    # 10 ms fixed + 60 ms prefill: 30 ms left of its 100 ms objective, i.e. 6 batch rows
    assert step[prompt] == 60 and sum(1 for s in batch if s in step) == 6
    assert cost.predict(6, 60) == pytest.approx(0.100)


def test_standard_rows_keep_their_own_looser_objective_beside_batch():
    cost = FrozenCost(fixed=0.0, per_row=0.010, per_token=0.001)
    sched = timed(cost)
    batch = decoding(sched, 30, Priority.BATCH, start=100)
    standard = decoding(sched, 5, Priority.STANDARD, start=0)
    step = dict(run_step(sched))
    assert all(s in step for s in standard) and sum(1 for s in batch if s in step) == 15  # 20 rows = 200 ms


def test_several_batch_prompts_share_one_allowance_per_step():
    cost = FrozenCost(fixed=0.010, per_row=0.004, per_token=0.002)
    sched = timed(cost, block_size=4)
    prompts = [seq_of(40, Priority.BATCH, start=100 * i, arrival=float(i)) for i in range(5)]
    for seq in prompts:
        sched.add(seq)
    step = run_step(sched)
    assert sum(n for _, n in step) == 50  # 100 ms of prefill at 2 ms a token, across them
