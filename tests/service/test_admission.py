"""The admission gate alone (service/admission.py): up to `parallel` generations, a bounded
FIFO behind them, level changes that run alone, and waiters that leave when cancelled."""

from __future__ import annotations

import asyncio

import pytest

from strata.engine.service.admission import MAX_RETRY_AFTER_S, AdmissionGate
from strata.engine.service.facade import ServiceError

pytestmark = pytest.mark.timeout(20)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_up_to_parallel_run_and_the_rest_wait_in_arrival_order():
    gate = AdmissionGate(parallel=2, max_queue=8)
    admitted: list[str] = []

    async def enter(name: str) -> None:
        await gate.admit(name)
        admitted.append(name)

    tasks = [asyncio.create_task(enter(f"r{i}")) for i in range(5)]
    await settle()
    assert admitted == ["r0", "r1"]
    assert (gate.num_running, gate.num_waiting, gate.is_busy) == (2, 3, True)
    assert gate.oldest_request_id == "r0"
    gate.release("r1")
    await settle()
    assert admitted == ["r0", "r1", "r2"]
    for name in ("r0", "r2"):
        gate.release(name)
    await asyncio.gather(*tasks)
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    gate.release("r3")
    gate.release("r4")
    assert (gate.num_running, gate.num_waiting, gate.is_busy) == (0, 0, False)


async def test_past_max_queue_a_request_is_refused_at_once_with_retry_after():
    gate = AdmissionGate(parallel=1, max_queue=2)
    await gate.admit("running")
    waiting = [asyncio.create_task(gate.admit(f"w{i}")) for i in range(2)]
    await settle()
    with pytest.raises(ServiceError) as refused:
        await gate.admit("one too many")
    error = refused.value
    assert error.status == 503 and error.code == "queue_full"
    assert "max_queue 2" in error.message
    assert 1 <= error.retry_after_s <= MAX_RETRY_AFTER_S
    assert gate.num_waiting == 2  # the refused one never queued
    gate.release("running")
    await settle()
    assert waiting[0].done() and not waiting[1].done()
    gate.release("w0")
    await asyncio.gather(*waiting)


async def test_max_queue_zero_refuses_whenever_every_place_is_taken():
    gate = AdmissionGate(parallel=1, max_queue=0)
    await gate.admit("a")
    with pytest.raises(ServiceError) as refused:
        await gate.admit("b")
    assert refused.value.code == "queue_full"


async def test_a_cancelled_waiter_leaves_the_queue_at_once():
    gate = AdmissionGate(parallel=1, max_queue=4)
    await gate.admit("running")
    gone = asyncio.create_task(gate.admit("gone"))
    behind = asyncio.create_task(gate.admit("behind"))
    await settle()
    assert gate.num_waiting == 2
    gone.cancel()  # its client disconnected
    await settle()
    assert gate.num_waiting == 1
    gate.release("running")
    await asyncio.wait_for(behind, 1)
    assert gate.oldest_request_id == "behind" and gate.num_running == 1


async def test_a_waiter_cancelled_as_it_was_admitted_gives_its_place_back():
    gate = AdmissionGate(parallel=1, max_queue=4)
    await gate.admit("running")
    late = asyncio.create_task(gate.admit("late"))
    behind = asyncio.create_task(gate.admit("behind"))
    await settle()
    gate.release("running")  # grants "late" ...
    late.cancel()  # ... which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await late
    await asyncio.wait_for(behind, 1)
    assert list(gate._running) == ["behind"]


async def test_a_level_change_waits_for_the_running_and_goes_before_later_arrivals():
    gate = AdmissionGate(parallel=2, max_queue=8)
    order: list[str] = []
    await gate.admit("a")
    await gate.admit("b")

    async def level_change() -> None:
        async with gate.exclusive():
            order.append("level")
            assert gate.num_running == 0
            await asyncio.sleep(0.01)
        order.append("level done")

    async def later() -> None:
        await gate.admit("c")
        order.append("c")

    change = asyncio.create_task(level_change())
    await settle()
    arrival = asyncio.create_task(later())
    await settle()
    assert order == [] and gate.num_waiting == 1  # c waits behind the level change
    gate.release("a")
    await settle()
    assert order == []
    gate.release("b")
    await asyncio.gather(change, arrival)
    assert order == ["level", "level done", "c"]
    assert gate.is_in_use
    gate.release("c")
    assert not gate.is_in_use


async def test_a_generation_arriving_during_a_level_change_waits_for_it():
    gate = AdmissionGate(parallel=4, max_queue=8)
    async with gate.exclusive():
        waiter = asyncio.create_task(gate.admit("r"))
        await settle()
        assert not waiter.done() and gate.num_waiting == 1
    await asyncio.wait_for(waiter, 1)
    assert gate.num_running == 1


def test_nonsense_sizes_are_refused():
    with pytest.raises(ValueError):
        AdmissionGate(parallel=0, max_queue=1)
    with pytest.raises(ValueError):
        AdmissionGate(parallel=1, max_queue=-1)
