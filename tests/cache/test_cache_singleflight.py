from __future__ import annotations

import asyncio

import orjson
import pytest
import redis

from cache.base import Entry
from cache.errors import FlightAborted
from cache.metrics import CacheMetrics
from cache.replay import chunks_to_json, is_usage_chunk
from cache.singleflight import Flight, SingleFlight

CHUNKS = [b'{"i":%d}' % i for i in range(20)]


async def lead(flight: Flight, chunks: list[bytes], delay: float = 0.001) -> None:
    async with flight:
        for chunk in chunks:
            await flight.publish(chunk)
            await asyncio.sleep(delay)
        await flight.finish(Entry(kind="chat", chunks=list(chunks)))


async def collect(flight: Flight, delay: float = 0.0) -> list[bytes]:
    got = []
    async with flight:
        async for chunk in flight.follow():
            got.append(chunk)
            if delay:
                await asyncio.sleep(delay)
    return got


@pytest.fixture
async def flights():
    sf = SingleFlight()
    yield sf
    await sf.close()


@pytest.fixture
async def replicas(redis_url: str, namespace: str):
    """Two SingleFlight instances with their own Redis connections: two replicas."""
    a = SingleFlight(redis_url, namespace=namespace, lock_ttl=1.0, timeout=0.5)
    b = SingleFlight(redis_url, namespace=namespace, lock_ttl=1.0, timeout=0.5)
    yield a, b
    await a.close()
    await b.close()


async def test_in_process_one_leader_followers_get_every_chunk(flights: SingleFlight) -> None:
    joined = await asyncio.gather(*(flights.join("k") for _ in range(10)))
    leaders = [f for f in joined if f.is_leader]
    assert len(leaders) == 1
    followers = [f for f in joined if not f.is_leader]
    assert flights.metrics.counts["coalesced:local"] == 9
    results = await asyncio.wait_for(
        asyncio.gather(lead(leaders[0], CHUNKS), *(collect(f) for f in followers)), 5.0
    )
    assert all(r == CHUNKS for r in results[1:])
    assert len(flights) == 0  # the finished flight is gone: the next join leads
    nxt = await flights.join("k")
    assert nxt.is_leader
    await nxt.release()


async def test_slow_follower_does_not_hold_back_the_leader(flights: SingleFlight) -> None:
    leader = await flights.join("k")
    slow = await flights.join("k")
    go_on = asyncio.Event()
    got: list[bytes] = []

    async def run_slow() -> None:
        async with slow:
            async for chunk in slow.follow():
                got.append(chunk)
                await go_on.wait()  # reads nothing more until the leader is done

    follower = asyncio.create_task(run_slow())
    # the leader finishes while its follower is stuck on its first chunk
    await asyncio.wait_for(lead(leader, CHUNKS[:10], delay=0), 10.0)
    assert len(got) <= 1
    late = await flights.join("k")  # after finish: a new flight
    assert late.is_leader
    go_on.set()
    await asyncio.wait_for(follower, 10.0)
    assert got == CHUNKS[:10]
    await late.release()


async def test_follower_joining_late_reads_from_the_start(flights: SingleFlight) -> None:
    leader = await flights.join("k")
    await leader.publish(CHUNKS[0])
    await leader.publish(CHUNKS[1])
    follower = await flights.join("k")
    task = asyncio.create_task(collect(follower))
    await leader.publish(CHUNKS[2])
    await leader.finish(Entry(kind="chat", chunks=CHUNKS[:3]))
    assert await asyncio.wait_for(task, 10.0) == CHUNKS[:3]
    assert (await follower.wait()).chunks == CHUNKS[:3]


async def test_leader_abort_signals_followers(flights: SingleFlight) -> None:
    leader = await flights.join("k")
    followers = [await flights.join("k") for _ in range(3)]
    await leader.publish(CHUNKS[0])
    tasks = [asyncio.create_task(collect(f)) for f in followers]
    await asyncio.sleep(0.01)
    await leader.abort("upstream 500")
    for task in tasks:
        with pytest.raises(FlightAborted, match="upstream 500"):
            await asyncio.wait_for(task, 10.0)
    with pytest.raises(FlightAborted):
        await followers[0].wait()
    assert leader.status == "aborted"
    # nothing was produced: the next request leads (goes upstream itself)
    again = await flights.join("k")
    assert again.is_leader
    await again.release()


async def test_leader_leaving_without_finish_aborts(flights: SingleFlight) -> None:
    follower_task = None
    with pytest.raises(RuntimeError):
        async with await flights.join("k") as leader:
            assert leader.is_leader
            follower_task = asyncio.create_task(collect(await flights.join("k")))
            await leader.publish(CHUNKS[0])
            raise RuntimeError("broken upstream stream")
    with pytest.raises(FlightAborted, match="RuntimeError"):
        await asyncio.wait_for(follower_task, 10.0)


async def test_cancelled_leader_aborts_rather_than_hanging(flights: SingleFlight) -> None:
    started = asyncio.Event()

    async def client_request() -> None:
        async with await flights.join("k") as flight:
            assert flight.is_leader
            await flight.publish(CHUNKS[0])
            started.set()
            await asyncio.sleep(3600)  # a slow upstream; the client disconnects

    leader_task = asyncio.create_task(client_request())
    await started.wait()
    follower = await flights.join("k")
    follow_task = asyncio.create_task(collect(follower))
    await asyncio.sleep(0.01)
    leader_task.cancel()
    with pytest.raises(FlightAborted, match="cancelled"):
        await asyncio.wait_for(follow_task, 10.0)


async def test_json_leader_is_followed_as_chunks(flights: SingleFlight, chat_body: bytes) -> None:
    leader = await flights.join("k")
    follower = await flights.join("k")
    asker = await flights.join("k")
    task = asyncio.create_task(collect(follower))
    usage_task = asyncio.create_task(asker.follow(include_usage=True).__anext__())
    await leader.finish(Entry(kind="chat", body=chat_body))
    chunks = await task
    assert chunks_to_json("chat", chunks)["choices"] == orjson.loads(chat_body)["choices"]
    assert not any(is_usage_chunk(c) for c in chunks)
    assert await usage_task  # a chunk arrived for the include_usage follower too
    assert (await follower.wait()).body == chat_body


async def test_follow_applies_the_usage_rule(flights: SingleFlight, chat_chunks: list[bytes]) -> None:
    leader = await flights.join("k")
    without = await flights.join("k")
    raw = await flights.join("k")

    async def follow(f: Flight, include_usage: bool | None) -> list[bytes]:
        return [c async for c in f.follow(include_usage=include_usage)]

    tasks = [asyncio.create_task(follow(without, False)), asyncio.create_task(follow(raw, None))]
    await lead(leader, chat_chunks)
    assert await tasks[0] == chat_chunks[:-1]
    assert await tasks[1] == chat_chunks


async def test_across_replicas_one_leader(
    replicas: tuple[SingleFlight, SingleFlight], chat_chunks: list[bytes]
) -> None:
    a, b = replicas
    first = await a.join("k")  # takes the Redis lock
    joined = await asyncio.gather(*(b.join("k") for _ in range(4)), *(a.join("k") for _ in range(4)))
    flights = [first, *joined]
    assert [f.is_leader for f in flights].count(True) == 1 and first.is_leader
    assert b.metrics.counts["coalesced:redis"] == 1  # B follows through one Redis pump
    assert b.metrics.counts["coalesced:local"] == 3
    results = await asyncio.wait_for(
        asyncio.gather(lead(first, chat_chunks, delay=0.01), *(collect(f) for f in joined)), 5.0
    )
    assert all(r == chat_chunks for r in results[1:])
    remote_entry = await joined[0].wait()
    assert remote_entry.chunks == chat_chunks and remote_entry.kind == "chat"


async def test_across_replicas_leader_abort(
    replicas: tuple[SingleFlight, SingleFlight], raw_redis: redis.Redis
) -> None:
    a, b = replicas
    leader = await a.join("k")
    follower = await b.join("k")
    assert leader.is_leader and not follower.is_leader
    task = asyncio.create_task(collect(follower))
    await leader.publish(CHUNKS[0])
    await asyncio.sleep(0.05)
    await leader.abort("upstream 503")
    with pytest.raises(FlightAborted, match="upstream 503"):
        await asyncio.wait_for(task, 2.0)
    await asyncio.sleep(0.05)
    assert raw_redis.exists(a.lock_key("k")) == 0  # the lock was released


async def test_across_replicas_cancelled_leader(replicas: tuple[SingleFlight, SingleFlight]) -> None:
    a, b = replicas
    started = asyncio.Event()

    async def client_request() -> None:
        async with await a.join("k") as flight:
            await flight.publish(CHUNKS[0])
            started.set()
            await asyncio.sleep(3600)

    leader_task = asyncio.create_task(client_request())
    await started.wait()
    follower = await b.join("k")
    assert not follower.is_leader
    task = asyncio.create_task(collect(follower))
    await asyncio.sleep(0.05)
    leader_task.cancel()
    with pytest.raises(FlightAborted, match="cancelled"):
        await asyncio.wait_for(task, 2.0)


async def test_across_replicas_json_leader(
    replicas: tuple[SingleFlight, SingleFlight], chat_body: bytes
) -> None:
    a, b = replicas
    leader = await a.join("k")
    follower = await b.join("k")
    task = asyncio.create_task(follower.wait())
    await asyncio.sleep(0.05)
    await leader.finish(Entry(kind="chat", body=chat_body, created_at=123.25))
    entry = await asyncio.wait_for(task, 2.0)
    assert entry == Entry(kind="chat", body=chat_body, created_at=123.25)


async def test_dead_leader_is_detected(
    replicas: tuple[SingleFlight, SingleFlight], raw_redis: redis.Redis
) -> None:
    _, b = replicas
    # a leader on a replica that died: it holds the lock, never writes, never heartbeats
    raw_redis.set(b.lock_key("k"), "dead-replica-token", px=300)
    follower = await b.join("k")
    assert not follower.is_leader
    with pytest.raises(FlightAborted, match="leader lost"):
        await asyncio.wait_for(follower.wait(), 10.0)  # not a wait for ever


async def test_long_leader_keeps_its_lock_alive(
    replicas: tuple[SingleFlight, SingleFlight],
) -> None:
    a, b = replicas  # lock_ttl 1 s: the leader heartbeats every ~0.33 s
    leader = await a.join("k")
    follower = await b.join("k")
    task = asyncio.create_task(collect(follower))
    await asyncio.sleep(1.5)  # longer than lock_ttl without a chunk (a long prefill)
    assert not task.done()
    await lead(leader, CHUNKS[:3])
    assert await asyncio.wait_for(task, 2.0) == CHUNKS[:3]


async def test_closing_a_replica_aborts_its_flights_everywhere(
    redis_url: str, namespace: str, raw_redis: redis.Redis
) -> None:
    a = SingleFlight(redis_url, namespace=namespace, lock_ttl=30.0, timeout=0.5, block=0.2)
    b = SingleFlight(redis_url, namespace=namespace, lock_ttl=30.0, timeout=0.5, block=0.2)
    try:
        leader = await a.join("k")
        local = await a.join("k")
        remote = await b.join("k")
        tasks = [asyncio.create_task(collect(f)) for f in (local, remote)]
        await leader.publish(CHUNKS[0])
        await asyncio.sleep(0.05)
        await a.close()  # shutdown: the abort marker reaches B long before the 30 s lock TTL
        for task in tasks:
            with pytest.raises(FlightAborted, match="shutting down"):
                await asyncio.wait_for(task, 2.0)
        assert raw_redis.exists(a.lock_key("k")) == 0
    finally:
        await a.close()
        await b.close()


async def test_unreachable_redis_falls_back_to_in_process() -> None:
    metrics = CacheMetrics()
    sf = SingleFlight("redis://127.0.0.1:1/0", timeout=0.2, metrics=metrics)
    try:
        leader = await asyncio.wait_for(sf.join("k"), 10.0)  # bounded by the timeout, not a hang
        follower = await asyncio.wait_for(sf.join("k"), 10.0)
        assert leader.is_leader and not follower.is_leader
        assert metrics.counts["errors:singleflight:lock"] == 1
        task = asyncio.create_task(collect(follower))
        await lead(leader, CHUNKS[:2])
        assert await task == CHUNKS[:2]
    finally:
        await sf.close()


async def test_a_leader_that_cannot_write_to_redis_releases_remote_followers_at_once(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a Redis restart the leader's writer may meet a stale connection: remote
    followers must not wait for its lock to expire (lock_ttl), they go upstream at once."""
    a = SingleFlight(redis_url, namespace=namespace, lock_ttl=120.0, timeout=0.5)
    b = SingleFlight(redis_url, namespace=namespace, lock_ttl=120.0, timeout=0.5)
    try:
        await _leader_loses_redis(a, b, monkeypatch)
    finally:
        await a.close()
        await b.close()


async def _leader_loses_redis(a: SingleFlight, b: SingleFlight, monkeypatch: pytest.MonkeyPatch) -> None:
    leader = await a.join("k")
    follower = await b.join("k")
    assert leader.is_leader and not follower.is_leader
    real_pipeline = a._redis.pipeline
    broken = {"left": 1}

    def pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        if broken["left"]:
            broken["left"] -= 1

            async def fail():
                raise redis.ConnectionError("Connection closed by server.")

            pipe.execute = fail
        return pipe

    monkeypatch.setattr(a._redis, "pipeline", pipeline)
    task = asyncio.create_task(collect(follower))
    await leader.publish(CHUNKS[0])
    with pytest.raises(FlightAborted):
        await asyncio.wait_for(task, 20.0)  # not the lock's 120 s
    await leader.release(None)
