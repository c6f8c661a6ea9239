"""The queue in front of a target, on its own: fair shares, priority with ageing, deadlines,
preemption room for the engine, Little's-law predictions, the adaptive limit."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import pytest

from gateway.core.errors import Overloaded
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


async def test_priority_first_and_a_batch_request_is_served_within_its_ageing_bound():
    queue = TargetQueue("t", 1, ageing_s=0.1)
    interactive, batch = tenant("i", "interactive"), tenant("b", "batch")
    served: list[tuple[str, float]] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    holder = await queue.acquire(interactive, None)
    waiting_batch = asyncio.ensure_future(queue.acquire(batch, None))

    async def interactive_load() -> None:  # constant interactive load: always one waiting
        for _ in range(60):
            slot = await queue.acquire(interactive, None)
            served.append(("i", loop.time() - started))
            await asyncio.sleep(0.01)
            slot.release()

    load = [asyncio.ensure_future(interactive_load()) for _ in range(2)]
    await asyncio.sleep(0)
    holder.release()
    slot = await waiting_batch
    waited = loop.time() - started
    slot.release()
    await asyncio.gather(*load)
    assert served[0][0] == "i"  # interactive goes first while the batch request is young
    # a batch request is two classes behind: it is served once it has waited twice the ageing
    # step, however much interactive work keeps coming
    assert 0.2 <= waited < 0.5, waited
    assert any(t > waited for _, t in served), "the interactive load went on after it"


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
    slot = await asyncio.wait_for(stayer, 1)
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
