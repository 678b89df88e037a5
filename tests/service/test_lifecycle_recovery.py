"""kill -9 of the engine process (mid-stream, idle, asleep) and the standby process."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from fakes.fake_engine import expected_tokens
from fakes.services import answer, make_service, moe, request
from helpers.processes import KILLED_WORDS, kill_hard

pytestmark = pytest.mark.timeout(120)

PROMPT = (41, 42)


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_kill_9_during_a_stream_then_while_idle_and_asleep_recovers(tiny_model_dir):
    service = make_service(tiny_model_dir, engine=moe(token_delay_s=0.01))
    await service.start()
    try:
        pid = service.status()["engine_pid"]
        events = []
        async for event in service.generate(request(PROMPT, max_tokens=10_000)):
            events.append(event)
            if len(events) == 1:
                kill_hard(pid)
        assert events[-1].code == "engine_crashed" and KILLED_WORDS in events[-1].message
        status = service.status()
        assert status["state"] == "failed" and KILLED_WORDS in status["last_error"]
        assert status["vram"] == {} and status["levels"]["weights"] == "unloaded"
        assert not status["is_busy"]

        ids, _ = await answer(service, PROMPT)  # the first crash restarts at once
        assert ids == expected_tokens(PROMPT, 6)
        assert service.status()["engine_pid"] not in (None, pid)

        # Idle, with experts released: the restarted engine has everything resident again.
        await service.control("release_experts")
        pid = service.status()["engine_pid"]
        kill_hard(pid)
        # The crash is seen, and the engine restarts by itself (the failed state is brief).
        await wait_for(lambda: service.status()["engine_crashes"] == 2)
        ids, _ = await answer(service, PROMPT)  # a finished request reset the crash count
        assert ids == expected_tokens(PROMPT, 6)
        status = service.status()
        assert status["state"] == "loaded" and status["levels"]["experts"] == "resident"

        # Asleep: the next request loads a new process instead of waking a dead one.
        await service.control("sleep")
        kill_hard(status["engine_pid"])
        await wait_for(lambda: service.status()["engine_crashes"] == 3)
        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6) and service.status()["state"] == "loaded"
        assert service.status()["engine_crashes"] == 3
    finally:
        await service.stop()


async def test_unload_leaves_a_standby_process_that_the_next_load_uses(tiny_model_dir):
    service = make_service(tiny_model_dir)
    await service.start()
    try:
        first_pid = service.status()["engine_pid"]
        result = await service.control("unload")
        standby_pid = result["engine"]["standby_pid"]
        assert result["state"] == "unloaded" and result["engine_pid"] is None
        assert standby_pid and standby_pid != first_pid
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == "zombie"
        assert psutil.Process(standby_pid).is_running()
        standby = await service.supervisor.standby_status()
        assert standby.engine.state == "standby" and standby.engine.standby["is_factory_imported"]
        assert not standby.engine.standby["is_cuda_initialized"]

        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6)
        status = service.status()
        assert status["engine_pid"] == standby_pid and status["engine"]["standby_pid"] is None
        assert status["engine_starts"] == 2  # the first process and the standby, no third
    finally:
        await service.stop()
    assert not psutil.pid_exists(standby_pid) or psutil.Process(standby_pid).status() == "zombie"


async def test_without_standby_an_unload_leaves_no_process(tiny_model_dir):
    service = make_service(tiny_model_dir, keep_standby=False)
    await service.start()
    try:
        result = await service.control("unload")
        assert result["engine"]["standby_pid"] is None and result["engine_pid"] is None
        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6) and service.status()["engine_starts"] == 2
    finally:
        await service.stop()


async def test_a_dead_standby_is_replaced_by_a_fresh_process(tiny_model_dir):
    service = make_service(tiny_model_dir)
    await service.start()
    try:
        standby_pid = (await service.control("unload"))["engine"]["standby_pid"]
        await service.supervisor.standby_status()  # it is up
        kill_hard(standby_pid)
        await wait_for(lambda: service.status()["engine"]["standby_pid"] is None)
        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6)
        assert service.status()["engine_pid"] not in (None, standby_pid)
    finally:
        await service.stop()
