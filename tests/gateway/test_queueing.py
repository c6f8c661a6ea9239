"""The queue in front of a target, on its own: fair shares, priority with ageing, deadlines,
preemption room for the engine, Little's-law predictions, the adaptive limit."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import pytest

from gateway.core.errors import Overloaded
from gateway.pipeline import queue as queue_module
from gateway.pipeline.queue import QueueDeadline, TargetQueue
from gateway.core.settings import TenantPolicy
from gateway.core.tenant import Tenant


def tenant(name: str, priority: str = "standard", weight: float = 1.0) -> Tenant:
    return Tenant(name, TenantPolicy(priority=priority, weight=weight))


async def serve(queue: TargetQueue, who: Tenant, served: list, hold: float = 0.0, deadline: float | None = None) -> None:
    slot = await queue.acquire(who, deadline)
    served.append(who.name)
    await asyncio.sleep(hold)
    slot.release()


async def test_equal_tenants_share_a_contended_target_equally_whoever_came_first():
    queue = TargetQueue("t", 1)
    a, b = tenant("a"), tenant("b")
    served: list[str] = []
    blocker = await queue.acquire(a, None)
    tasks = [asyncio.ensure_future(serve(queue, a, served)) for _ in range(40)]  # a floods first
    tasks += [asyncio.ensure_future(serve(queue, b, served)) for _ in range(40)]
    await asyncio.sleep(0)
    blocker.release()
    await asyncio.gather(*tasks)
    first_half = collections.Counter(served[:40])
    assert abs(first_half["a"] - first_half["b"]) <= 2, first_half  # interleaved, not a then b


async def test_weights_set_the_shares():
    queue = TargetQueue("t", 1)
    heavy, light = tenant("heavy", weight=3), tenant("light", weight=1)
    served: list[str] = []
    blocker = await queue.acquire(heavy, None)
    tasks = [asyncio.ensure_future(serve(queue, w, served)) for w in [heavy] * 60 + [light] * 60]
    await asyncio.sleep(0)
    blocker.release()
    await asyncio.gather(*tasks)
    share = collections.Counter(served[:40])
    assert 27 <= share["heavy"] <= 33, share  # 3:1 of the first 40


class FakeClock:
    """The queue's clock (its ``time.monotonic``), moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


async def test_priority_first_and_a_batch_request_is_served_within_its_ageing_bound(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(queue_module, "time", clock)
    queue = TargetQueue("t", 1, ageing_s=10.0)
    interactive, batch = tenant("i", "interactive"), tenant("b", "batch")
    slot = await queue.acquire(interactive, None)
    waiting_batch = asyncio.ensure_future(queue.acquire(batch, None))  # enqueued at 0 s
    await asyncio.sleep(0)
    served = []  # who got the slot at each second: constant interactive load, always one waiting
    for second in range(1, 40):
        waiting_interactive = asyncio.ensure_future(queue.acquire(interactive, None))
        await asyncio.sleep(0)
        clock.now = float(second)
        slot.release()
        await asyncio.sleep(0)
        if waiting_batch.done():
            served.append(("b", second))
            break
        served.append(("i", second))
        slot = await waiting_interactive
    else:
        raise AssertionError("the batch request was never served")
    (await waiting_batch).release()
    await waiting_interactive
    # a batch request is two classes behind: interactive goes first while it is young, and it
    # is served once it has waited twice the ageing step, however much interactive work comes
    assert served[-1] == ("b", 20), served
    assert all(who == "i" for who, _ in served[:-1])


async def test_a_request_whose_deadline_passes_while_waiting_is_dropped():
    queue = TargetQueue("t", 1)
    who = tenant("a")
    holder = await queue.acquire(who, None)
    with pytest.raises(QueueDeadline) as caught:
        await queue.acquire(who, deadline=time.monotonic() + 0.05)
    assert caught.value.status == 504 and caught.value.code == "deadline_exceeded"
    assert queue.waiting == 0 and queue.active == 1
    holder.release()
    assert queue.active == 0


async def test_a_request_that_gives_up_hands_its_slot_on():
    queue = TargetQueue("t", 1)
    who = tenant("a")
    holder = await queue.acquire(who, None)
    quitter = asyncio.ensure_future(queue.acquire(who, None))
    stayer = asyncio.ensure_future(queue.acquire(who, None))
    await asyncio.sleep(0)
    quitter.cancel()
    holder.release()
    slot = await asyncio.wait_for(stayer, 10)
    assert queue.active == 1 and queue.waiting == 0
    slot.release()
    assert queue.active == 0


async def test_the_engine_makes_room_for_a_better_class():
    queue = TargetQueue("edge", 2, preemptive=True)
    batch, interactive = tenant("b", "batch"), tenant("i", "interactive")
    held = [await queue.acquire(batch, None) for _ in range(2)]
    # full of batch work: an interactive request still goes in (the engine preempts batch)
    slot = await asyncio.wait_for(queue.acquire(interactive, None), 0.5)
    assert queue.active == 3 and queue.predicted_wait(interactive) == 0.0
    # another batch request waits
    waiting = asyncio.ensure_future(queue.acquire(batch, None))
    await asyncio.sleep(0.01)
    assert not waiting.done() and queue.waiting == 1
    for s in held + [slot]:
        s.release()
    (await waiting).release()


async def test_predicted_wait_is_littles_law_and_the_queue_is_bounded():
    queue = TargetQueue("t", 2, max_queue=3)
    who = tenant("a")
    held = [await queue.acquire(who, None) for _ in range(2)]
    assert queue.predicted_wait(who) == 0.0  # nothing measured: no grounds to refuse
    queue.service_s = 1.0  # slots are held a second on average: two come free per second
    assert queue.predicted_wait(who) == pytest.approx(0.5)
    waiting = [asyncio.ensure_future(queue.acquire(who, None)) for _ in range(3)]
    await asyncio.sleep(0)
    assert queue.predicted_wait(who) == pytest.approx(2.0)  # three ahead, then this one
    assert queue.predicted_wait(tenant("vip", "interactive")) == pytest.approx(0.5)  # nobody of its class ahead
    with pytest.raises(Overloaded):
        await queue.acquire(who, None)
    for s in held:
        s.release()
    for w in waiting:
        (await w).release()


async def test_the_adaptive_limit_shrinks_when_ttft_degrades_and_grows_when_saturated():
    queue = TargetQueue("t", None, adaptive=True, max_limit=64)
    who = tenant("a")
    assert queue.limit == 16
    for _ in range(40):  # saturated, fast answers: the limit grows
        slots = [await queue.acquire(who, None) for _ in range(queue.limit)]
        for s in slots:
            s.release(ttft=0.05)
    grown = queue.limit
    assert grown > 16
    await asyncio.sleep(0.06)
    slot = await queue.acquire(who, None)
    slot.release(ttft=0.5)  # ten times slower than the best: cut by a tenth
    assert queue.limit == int(grown * 0.9)


async def test_a_flood_raises_only_its_own_tenants_predicted_wait():
    """Tenants acme and gamma, same class and weight, one slot: acme's backlog of eight is
    acme's to wait behind; gamma's next request would be served second, and is predicted so."""
    queue = TargetQueue("t", 1)
    queue.service_s = 0.5
    acme, gamma = tenant("acme"), tenant("gamma")
    held = await queue.acquire(acme, None)
    flood = [asyncio.ensure_future(queue.acquire(acme, None)) for _ in range(8)]
    await asyncio.sleep(0)
    assert queue.ahead_of(gamma) == 1 and queue.predicted_wait(gamma) == pytest.approx(1.0)
    assert queue.ahead_of(acme) == 8 and queue.predicted_wait(acme) == pytest.approx(4.5)
    held.release()
    for waiting in flood:
        (await waiting).release()


@pytest.mark.parametrize("seed", range(8))
async def test_random_mixes_share_by_weight_and_predict_each_tenants_place(seed):
    """Random tenants, classes, weights and backlogs on a one-slot target: the place
    ``ahead_of`` predicts for a new request is exactly where it is served, and while every
    tenant of a class has a backlog, each gets its weight's share of that class's turns."""
    rng = random.Random(seed)
    queue = TargetQueue("t", 1, ageing_s=1e9)  # no ageing: the order is the fair queue's alone
    tenants = [tenant(f"t{i}", rng.choice(["standard", "standard", "batch"]), rng.choice([1, 2, 3])) for i in range(rng.randint(2, 5))]
    served: list[str] = []
    order: dict[int, int] = {}

    async def one(who: Tenant, mark: int | None = None) -> None:
        slot = await queue.acquire(who, None)
        if mark is not None:
            order[mark] = len(served)
        served.append(who.name)
        slot.release()

    blocker = await queue.acquire(tenants[0], None)
    backlog = {t.name: rng.randint(30, 60) * int(t.weight) for t in tenants}
    tasks = []
    for _ in range(max(backlog.values())):
        for t in tenants:
            if backlog[t.name]:
                backlog[t.name] -= 1
                tasks.append(asyncio.ensure_future(one(t)))
    await asyncio.sleep(0)
    probe = rng.choice(tenants)
    predicted = queue.ahead_of(probe)
    tasks.append(asyncio.ensure_future(one(probe, mark=0)))
    await asyncio.sleep(0)
    blocker.release()
    await asyncio.gather(*tasks)
    assert order[0] == predicted
    standard = [t for t in tenants if t.rank == 1]
    if len(standard) > 1:
        first = [name for name in served if name in {t.name for t in standard}][: 12 * len(standard)]
        total = sum(t.weight for t in standard)
        for t in standard:
            share = first.count(t.name) / len(first)
            assert abs(share - t.weight / total) <= 0.1, (t, share, first)
