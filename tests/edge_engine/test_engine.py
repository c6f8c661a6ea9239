"""The async engine: streaming, seeds, stop strings, cancellation, failures, overload, flow
control and deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from edge_engine import (
    DeadlineExceededError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
)
from tests.edge_engine.conftest import make_engine


async def collect(engine, prompt, **params):
    deltas = [d async for d in engine.generate(prompt, SamplingParams(**params))]
    return deltas


def tokens_of(deltas):
    return [t for d in deltas for t in d.token_ids]


async def wait_idle(engine, timeout=5.0):
    """Until the step thread has processed cancellations: nothing running, no block held."""
    for _ in range(int(timeout / 0.01)):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def test_generate_streams_deltas_until_finish(tiny_engine):
    deltas = await collect(tiny_engine, "The capital of France is", temperature=0, max_tokens=12, ignore_eos=True)
    assert len(deltas) == 12
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]
    assert deltas[-1].num_output_tokens == 12
    text = "".join(d.text for d in deltas)
    assert text == tiny_engine.tokenizer.decode(tokens_of(deltas))
    stats = await wait_idle(tiny_engine)
    assert stats.num_requests_finished == 1 and stats.ttft_ms_p50 is not None and stats.tpot_ms_p50 is not None


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_engine):
    params = dict(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    first = tokens_of(await collect(tiny_engine, "Hello", **params))
    second = tokens_of(await collect(tiny_engine, "Hello", **params))
    other = tokens_of(await collect(tiny_engine, "Hello", **{**params, "seed": 99}))
    assert first == second
    assert first != other
    batch = await asyncio.gather(
        collect(tiny_engine, "Hello", **params),
        collect(tiny_engine, "Numbers 0123", temperature=1.0, max_tokens=30, ignore_eos=True),
        collect(tiny_engine, "def add(a, b):", temperature=0.7, seed=5, max_tokens=25, ignore_eos=True),
    )
    assert tokens_of(batch[0]) == first


async def test_stop_string_ends_the_stream_where_it_starts(tiny_engine):
    full = await collect(tiny_engine, "What is the capital", temperature=0, max_tokens=40, ignore_eos=True)
    text = "".join(d.text for d in full)
    assert len(text) > 12
    stop = text[8:11]  # three characters, wherever the token boundaries fall
    expected = text[: text.find(stop)]
    deltas = await collect(tiny_engine, "What is the capital", temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
    streamed = "".join(d.text for d in deltas)
    assert streamed == expected
    assert deltas[-1].finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)
    # and a stop token id ends it too, without its text
    stop_id = tokens_of(full)[5]
    deltas = await collect(tiny_engine, "What is the capital", temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id])
    assert deltas[-1].finish_reason == "stop"
    assert tokens_of(deltas) == tokens_of(full)[: tokens_of(full).index(stop_id) + 1]


@pytest.mark.parametrize("how", [pytest.param("aclose", id="aclose"), pytest.param("cancel", id="task-cancel")])
async def test_cancellation_removes_the_sequence_and_frees_its_blocks(tiny_engine, how):
    gen = tiny_engine.generate("Hello, world!", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    if how == "aclose":
        for _ in range(3):
            await gen.__anext__()
        assert tiny_engine.stats().num_kv_blocks_used > 0
        await gen.aclose()
    else:
        started = asyncio.Event()

        async def consume():
            async for _ in gen:
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    stats = await wait_idle(tiny_engine)
    assert stats.num_requests_finished == 0
    # and the engine still serves
    assert len(await collect(tiny_engine, "Hi", temperature=0, max_tokens=3, ignore_eos=True)) == 3


async def test_a_failing_model_step_fails_its_sequences_and_the_engine_keeps_serving(tiny_engine, monkeypatch):
    real_run = tiny_engine.runner.run
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_run(scheduled)

    monkeypatch.setattr(tiny_engine.runner, "run", flaky)
    with pytest.raises(EngineError, match="boom"):
        await collect(tiny_engine, "Hello", temperature=0, max_tokens=10, ignore_eos=True)
    stats = await wait_idle(tiny_engine)
    assert stats.num_step_failures == 1
    assert len(await collect(tiny_engine, "Hello", temperature=0, max_tokens=4, ignore_eos=True)) == 4


async def test_queue_beyond_its_limit_is_refused_with_retry_after(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_queue_len=2)
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gens = [engine.generate("Hello", params) for _ in range(3)]
        await gens[0].__anext__()  # running
        waiting = [asyncio.create_task(g.__anext__()) for g in gens[1:]]
        for _ in range(500):
            if engine.scheduler.num_waiting == 2:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_waiting == 2
        with pytest.raises(EngineOverloadedError) as info:
            await engine.generate("Hello", params).__anext__()
        assert info.value.retry_after >= 1 and info.value.status_code == 503
        for task in waiting:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gens[0].aclose()
        await wait_idle(engine)
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "param", "overrides"),
    [
        pytest.param(600, 1, "prompt", {}, id="prompt-beyond-context"),
        pytest.param(10, 600, "max_tokens", {}, id="max-tokens-beyond-context"),
        pytest.param(70, 1, "prompt", {"num_kv_blocks": 16}, id="prompt-beyond-kv-pool"),
        pytest.param(0, 1, "prompt", {}, id="empty-prompt"),
    ],
)
async def test_requests_that_can_never_fit_are_rejected_at_once(tiny_gguf, prompt_len, max_tokens, param, overrides):
    engine = make_engine(tiny_gguf, **overrides)
    try:
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate([5] * prompt_len, SamplingParams(max_tokens=max_tokens)).__anext__()
        assert info.value.param == param
        assert engine.stats().num_waiting == 0
    finally:
        await engine.close()


async def test_repeated_prefix_is_served_from_the_cache(tiny_engine):
    prefix = "system user assistant You are a helpful assistant. " * 3
    first = await collect(tiny_engine, prefix + "Hello", temperature=0, max_tokens=2)
    second = await collect(tiny_engine, prefix + "What is", temperature=0, max_tokens=2)
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens >= len(tiny_engine.tokenizer.encode(prefix)) - 4
    assert tiny_engine.stats().prefix_cache_hit_rate > 0.3


async def test_preemption_under_a_small_pool_keeps_greedy_outputs(tiny_gguf):
    prompts = [f"Numbers {i}{i}{i} and the capital of France is" for i in range(6)]
    alone_engine = make_engine(tiny_gguf, num_kv_blocks=256)
    alone = [tokens_of(await collect(alone_engine, p, temperature=0, max_tokens=40, ignore_eos=True)) for p in prompts]
    await alone_engine.close()
    # 6 x (~20 + 40) tokens need ~90 blocks of 4: give it 40 so sequences must be preempted
    engine = make_engine(tiny_gguf, num_kv_blocks=40, max_num_seqs=6)
    try:
        together = await asyncio.gather(
            *(collect(engine, p, temperature=0, max_tokens=40, ignore_eos=True) for p in prompts)
        )
        assert [tokens_of(d) for d in together] == alone
        assert engine.stats().num_preemptions > 0
        await wait_idle(engine)
    finally:
        await engine.close()


async def test_waiting_interactive_requests_run_before_waiting_batch_ones(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=1)
    try:
        order: list[str] = []
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

        async def run(name, priority):
            async for d in engine.generate("Hello", params, priority=priority):
                if d.finished:
                    order.append(name)

        blocker = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await blocker.__anext__()  # holds the only batch slot for ~200 steps
        batch = asyncio.create_task(run("batch", "batch"))
        interactive = asyncio.create_task(run("interactive", "interactive"))
        await asyncio.sleep(0)
        async for _ in blocker:
            pass
        await asyncio.gather(batch, interactive)
        assert order == ["interactive", "batch"]
    finally:
        await engine.close()


async def test_logprobs_of_chosen_tokens(tiny_engine):
    deltas = await collect(tiny_engine, "Hello", temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, ignore_eos=True)
    for d in deltas:
        (lp,) = d.logprobs
        assert lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.top_logprobs[0][1] == pytest.approx(lp.logprob)
        assert lp.top_logprobs[0][1] >= lp.top_logprobs[1][1] >= lp.top_logprobs[2][1]


async def test_close_fails_requests_in_flight(tiny_gguf):
    engine = make_engine(tiny_gguf)
    gen = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    await gen.__anext__()
    await engine.close()
    with pytest.raises(EngineError):
        async for _ in gen:
            pass
    with pytest.raises(EngineError):
        await engine.generate("Hello").__anext__()


async def _until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_a_reader_that_stops_reading_pauses_only_its_own_sequence(tiny_gguf, monkeypatch):
    bound = 4
    engine = make_engine(tiny_gguf, max_pending_outputs=bound)
    try:
        params = dict(temperature=0, max_tokens=40, ignore_eos=True)
        alone = tokens_of(await collect(engine, "Hello, world!", **params))
        slow = engine.generate("Hello, world!", SamplingParams(**params), request_id="slow")
        first = await slow.__anext__()  # started; from now on nobody reads it
        (seq,) = [s for s in engine.scheduler.running if s.request_id == "slow"]
        other = await collect(engine, "Numbers 0123", temperature=0, max_tokens=60, ignore_eos=True)
        assert len(other) == 60 and other[-1].finish_reason == "length"  # the rest of the batch kept going
        await _until(lambda: engine.stats().num_running == 1)
        # paused: at most `bound` deltas buffered, its blocks kept, nothing more generated
        assert seq.sink[1].qsize() == seq.num_pending_outputs == bound
        assert seq.num_output_tokens == 1 + bound and seq.block_table and not seq.is_finished
        assert engine.stats().num_paused == 1
        # and the step thread sleeps instead of spinning over a batch with nothing to run
        calls = {"n": 0}
        real_schedule = engine.scheduler.schedule

        def counting_schedule():
            calls["n"] += 1
            return real_schedule()

        monkeypatch.setattr(engine.scheduler, "schedule", counting_schedule)
        await asyncio.sleep(0.2)
        assert calls["n"] <= 1
        assert seq.num_output_tokens == 1 + bound
        # reading again resumes it, and it finishes as if it had never paused
        rest = [d async for d in slow]
        assert tokens_of([first, *rest]) == alone and rest[-1].finish_reason == "length"
        assert engine.stats().num_paused == 0
        await wait_idle(engine)
    finally:
        await engine.close()


@pytest.mark.parametrize("blocker_reads", [pytest.param(True, id="batch-busy"), pytest.param(False, id="batch-paused")])
async def test_a_request_whose_deadline_passes_in_the_queue_is_dropped_before_its_prefill(
    tiny_gguf, monkeypatch, blocker_reads
):
    # one batch slot, held by a blocker that is either decoding or paused (its reader idle)
    engine = make_engine(tiny_gguf, max_num_seqs=1, max_pending_outputs=2)
    scheduled: set[str] = set()
    real_run = engine.runner.run

    def spy(batch):
        scheduled.update(seq.request_id for seq, _ in batch)
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", spy)
    try:
        blocker = engine.generate(
            "Hello", SamplingParams(temperature=0, max_tokens=240, ignore_eos=True), request_id="blocker"
        )
        await blocker.__anext__()
        reader = asyncio.create_task(collect_rest(blocker)) if blocker_reads else None
        # admitted as if the prediction had let it in (admission would refuse it: see
        # test_admission.py), the deadline passes while it waits for the slot
        late = engine.generate(
            "Hello", SamplingParams(max_tokens=4), request_id="late", deadline=time.monotonic() + 0.02, admitted=True
        )
        with pytest.raises(DeadlineExceededError) as info:
            await asyncio.wait_for(late.__anext__(), 10)
        assert info.value.status_code == 504 and info.value.to_dict()["error"]["code"] == "deadline_exceeded"
        assert "late" not in scheduled and "blocker" in scheduled  # dropped, never prefilled
        assert engine.stats().num_deadline_drops == 1
        # a deadline that has already passed is refused at once
        with pytest.raises(DeadlineExceededError):
            await engine.generate("Hello", deadline=time.monotonic() - 1).__anext__()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        await blocker.aclose()
        await wait_idle(engine)
    finally:
        await engine.close()


async def collect_rest(gen):
    return [d async for d in gen]


async def test_the_last_delta_says_where_the_sequence_spent_its_time(tiny_gguf):
    engine = make_engine(tiny_gguf, max_num_seqs=1)  # the second request waits for the first
    await engine.start()
    try:
        params = dict(temperature=0, max_tokens=8, ignore_eos=True)
        started = time.monotonic()
        first, second = await asyncio.gather(collect(engine, "Hello", **params), collect(engine, "Hello there", **params))
        elapsed = time.monotonic() - started
    finally:
        await engine.close()
    assert all(d.times is None for d in first[:-1] + second[:-1])
    ahead, behind = first[-1].times, second[-1].times
    for times in (ahead, behind):
        assert min(times.queue, times.prefill, times.decode) >= 0
        assert times.queue + times.prefill + times.decode <= elapsed
    # the one behind waited for the whole of the one ahead; the one ahead hardly at all
    assert behind.queue >= ahead.prefill + ahead.decode
    assert ahead.queue < behind.queue
