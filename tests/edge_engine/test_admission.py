"""The engine's admission by prediction and its deadline watchdog: what a request can
expect from the load and the step cost model (plain Python), refusals at once, and a
waiting request answered when its deadline passes while a model step is still running
(steps held on an Event; no wall-clock asserts)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from edge_engine import DeadlineExceededError, EngineOverloadedError, SamplingParams
from edge_engine.admission import Load, forecast
from edge_engine.sequence import Priority
from tests.edge_engine.conftest import make_engine
from tests.edge_engine.costs import FrozenCost, freeze

OBJECTIVES = {Priority.INTERACTIVE: 0.100, Priority.STANDARD: 0.200}
I, S, B = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH


def load(**kw) -> Load:
    return Load(max_num_seqs=32, max_num_batched_tokens=512, min_chunk=16, **kw)


def test_an_interactive_prompt_beside_batch_rows_gets_its_prefill_within_its_objective():
    cost = FrozenCost(fixed=0.010, per_row=0.005, per_token=0.002)
    busy = load(decode_rows={B: 20}, running={B: 20}, num_running=20)
    f = forecast(busy, cost, OBJECTIVES, I, 50, in_flight_left=0.080)
    # what is left of the batch step in flight, then one step: its 50 tokens (110 ms), batch parked
    assert f.ttft == pytest.approx(0.080 + 0.110)
    assert f.tpot == pytest.approx(0.015) and f.tpot_limit == 0.100 and f.tpot_ok
    # a batch request with a deadline waits for nothing more urgent, but its chunk adds at most 100 ms
    f = forecast(busy, cost, OBJECTIVES, B, 200)
    assert f.ttft == pytest.approx(4 * cost.predict(20, 50)) and f.tpot_limit is None


def test_the_prompts_ahead_and_the_rows_of_more_urgent_classes_count():
    cost = FrozenCost(fixed=0.010, per_row=0.010, per_token=0.001)
    # 5 interactive rows decode (60 ms): an interactive prompt gets 40 tokens a step, after the
    # 100 prompt tokens already waiting in its class
    ahead = load(decode_rows={I: 5}, running={I: 5}, prefilling={I: 1}, waiting={I: 1}, prefill_tokens={I: 100}, num_running=5)
    f = forecast(ahead, cost, OBJECTIVES, I, 60)
    assert f.ttft == pytest.approx(math.ceil(160 / 40) * 0.100)
    # 6 interactive sequences + itself decode together: 80 ms, within 100 ms
    assert f.tpot == pytest.approx(0.080) and f.tpot_ok
    # a standard request is held to the interactive rows' 100 ms as well
    assert forecast(ahead, cost, OBJECTIVES, S, 10).tpot_limit == 0.100


def test_tpot_that_cannot_be_kept_and_a_full_engine_are_foreseen():
    cost = FrozenCost(fixed=0.010, per_row=0.010, per_token=0.001)
    crowded = load(decode_rows={I: 9, B: 3}, running={I: 9, B: 3}, num_running=12)
    f = forecast(crowded, cost, OBJECTIVES, I, 10)
    assert f.tpot == pytest.approx(0.110) and not f.tpot_ok  # 9 + itself: 110 ms > 100 ms
    assert forecast(crowded, cost, OBJECTIVES, B, 10).tpot_ok  # batch has no objective
    # every batch slot held by its own class, none less urgent to preempt: it waits for the
    # one with the fewest tokens left
    full = load(decode_rows={S: 32}, running={S: 32}, fewest_tokens_left={S: 50}, num_running=32)
    f = forecast(full, cost, OBJECTIVES, S, 10)
    assert f.ttft >= 50 * cost.predict(32, 0)
    # an interactive request preempts one of them instead
    assert forecast(full, cost, OBJECTIVES, I, 10).ttft < cost.predict(32, 0)


def test_queued_requests_not_yet_scheduled_count_as_waiting():
    cost = FrozenCost(fixed=0.010, per_row=0.010, per_token=0.001)
    empty = load()
    alone = forecast(empty, cost, OBJECTIVES, I, 100).ttft
    behind = forecast(empty.with_queued([(I, 400), (B, 1000)]), cost, OBJECTIVES, I, 100).ttft
    assert alone == pytest.approx(cost.predict(0, 100)) and behind == pytest.approx(cost.predict(0, 500))


# -- the engine ----------------------------------------------------------------------------


class HeldSteps:
    """Stands in for the model run: while ``hold`` is set, each step waits for ``release``
    (a step taking seconds on a busy node); ``entered`` says a step is being held."""

    def __init__(self, engine) -> None:
        self.real = engine.run_model
        self.hold = threading.Event()
        self.release = threading.Semaphore(0)
        self.entered = threading.Event()
        self.finished = 0
        self.seen: set[str] = set()  # request ids of every sequence a step ran

    def __call__(self, out):
        self.seen.update(seq.request_id for seq, _ in out.scheduled)
        if self.hold.is_set():
            self.entered.set()
            assert self.release.acquire(timeout=60), "a held step was never released"
        result = self.real(out)
        self.finished += 1
        return result


async def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("where", ["inbox", "queue"])
async def test_a_waiting_requests_deadline_is_enforced_while_a_step_is_still_running(tiny_gguf, monkeypatch, where):
    engine = make_engine(tiny_gguf, max_num_seqs=1)
    steps = HeldSteps(engine)
    monkeypatch.setattr(engine, "run_model", steps)
    await engine.start()
    try:
        blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        await blocker.__anext__()
        steps.hold.set()
        await asyncio.to_thread(steps.entered.wait, 30)  # a step is running and will not end
        held = steps.finished
        if where == "inbox":  # arrives while the step thread is inside the model run
            late = engine.generate(
                "Hi", SamplingParams(max_tokens=4), request_id="late", deadline=time.monotonic() + 0.05, admitted=True
            )
            with pytest.raises(DeadlineExceededError):
                await asyncio.wait_for(late.__anext__(), 30)
        else:  # already in the scheduler's queue (no batch slot) when the held step began
            late_seq = engine.add_request(
                "Hi", SamplingParams(max_tokens=4), request_id="late", deadline=time.monotonic() + 3600, admitted=True
            )
            steps.entered.clear()
            steps.release.release()  # one step: the step thread takes it into its queue, then is held again
            await asyncio.to_thread(steps.entered.wait, 30)
            assert late_seq in engine.scheduler.waiting
            held = steps.finished
            # the watchdog, as when the hour has passed (its own clock is the wall's)
            assert await asyncio.to_thread(engine.expire, time.monotonic() + 3601) == 1
            item = await asyncio.wait_for(late_seq.sink[1].get(), 30)
            assert isinstance(item, DeadlineExceededError) and late_seq not in engine.scheduler.waiting
        assert steps.finished == held  # answered before the held step ended
        assert engine.stats().num_deadline_drops == 1 and "late" not in steps.seen  # never ran
        steps.hold.clear()
        steps.release.release()
        rest = [d async for d in blocker]
        assert rest[-1].finish_reason == "length"
    finally:
        steps.hold.clear()
        steps.release.release()
        await engine.close()


async def test_a_request_that_would_break_its_classs_tpot_objective_is_refused_at_once(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=8, max_pending_outputs=1)
    freeze(engine, fixed=0.010, per_row=0.030)  # every decode row is believed to cost 30 ms
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        streams = [engine.generate("Hello", params, priority="interactive") for _ in range(3)]
        for stream in streams:
            await stream.__anext__()
        # 3 interactive rows + a fourth: 130 ms a token, past interactive's 100 ms
        with pytest.raises(EngineOverloadedError) as info:
            await engine.generate("Hi", params, priority="interactive").__anext__()
        assert info.value.code == "tpot_unattainable" and info.value.status_code == 503
        # a standard request too: its looser 200 ms would hold, but its rows would be parked
        # whenever they made the interactive rows' steps longer than 100 ms: every step
        with pytest.raises(EngineOverloadedError) as info:
            await engine.generate("Hi", params, priority="standard").__anext__()
        assert info.value.code == "tpot_unattainable"
        # batch has no objective: admitted (it runs in what the interactive rows leave)
        other = engine.generate("Hi", SamplingParams(max_tokens=1), priority="batch")
        assert (await other.__anext__()).finish_reason == "length"
        assert engine.stats().num_refused == 2
        for stream in streams:
            await stream.aclose()
    finally:
        await engine.close()


async def test_admission_follows_the_measured_step_time(tiny_gguf):
    """The same request, the same queue: admitted while the engine's steps measure fast,
    refused once they measure slow (a busy node), admitted again when they are fast again."""
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_pending_outputs=1)
    await engine.start()
    try:
        blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        await blocker.__anext__()  # holds the slot (paused: nobody reads), 99 tokens to go
        budget = 1.0

        def admits() -> bool:
            try:
                engine.check_capacity(5, Priority.STANDARD, time.monotonic() + budget)
                return True
            except EngineOverloadedError as exc:
                assert exc.code == "deadline_unattainable"
                return False

        for _ in range(100):
            engine.cost.observe(1, 0, 0.001)  # steps measured at 1 ms: 99 of them fit in 1 s
        assert admits()
        for _ in range(100):
            engine.cost.observe(1, 0, 0.050)  # a CPU hog: 50 ms a step, ~5 s to wait
        assert not admits()
        for _ in range(100):
            engine.cost.observe(1, 0, 0.001)
        assert admits()
        await blocker.aclose()
    finally:
        await engine.close()
