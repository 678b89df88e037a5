"""Idle timers: each level by itself, counted from the end of the last request, never reset by
status reads (the real aiohttp app polled every 100 ms), waiting while a request runs."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes.fake_engine import expected_tokens
from fakes.services import answer, make_service, moe, request

from strata.engine.api import create_app

pytestmark = pytest.mark.timeout(120)

PROMPT = (31, 32, 33)
STATUS_PATHS = ("/health", "/metrics", "/v1/status", "/slots", "/props", "/v1/models")


async def wait_for_state(service, state: str, timeout_s: float) -> float:
    """Seconds until service.status()["state"] == state; fails past timeout_s."""
    started_s = time.monotonic()
    while service.status()["state"] != state:
        assert time.monotonic() - started_s < timeout_s, (
            f"state is {service.status()['state']}, not {state}, after {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started_s


async def test_each_idle_timer_fires_its_level_in_turn_and_a_request_comes_back(tiny_model_dir):
    service = make_service(tiny_model_dir, engine=moe(), cache_release_idle_s=0.3,
                           session_offload_idle_s=0.6, sleep_idle_s=0.9, idle_unload_s=1.2)
    await service.start()
    try:
        before, _ = await answer(service, PROMPT)
        status = service.status()
        assert status["idle_timeouts"] == {"cache_release": 0.3, "session_offload": 0.6,
                                           "sleep": 0.9, "unload": 1.2}
        assert 0 < status["idle"]["cache_release"] <= 0.3
        seen: list[str] = []
        started_s = time.monotonic()
        while service.status()["state"] != "unloaded" and time.monotonic() - started_s < 10:
            state = service.status()["state"]
            if not seen or seen[-1] != state:
                seen.append(state)
            await asyncio.sleep(0.02)
        assert seen == ["loaded", "experts_released", "session_offloaded", "sleeping"]
        for _ in range(250):  # the standby is spawned right after the engine exits
            if service.status()["engine"]["standby_pid"]:
                break
            await asyncio.sleep(0.02)
        status = service.status()
        assert status["state"] == "unloaded" and status["engine"]["standby_pid"]
        assert all(v is None for v in status["idle"].values())  # nothing left to time
        changes = status["counters"]["level_changes"]
        assert all(changes.get(a) == 1 for a in ("release_experts", "offload_session", "sleep",
                                                 "unload"))

        after, _ = await answer(service, PROMPT)  # loads again (into the standby)
        assert after == before == expected_tokens(PROMPT, 6)
        assert service.status()["state"] == "loaded"
        # A fresh load starts the clocks again: the timers fire again.
        await wait_for_state(service, "experts_released", 5)
    finally:
        await service.stop()


async def test_status_polling_every_100_ms_does_not_keep_the_model_awake(
        tiny_model_dir, aiohttp_client):
    service = make_service(tiny_model_dir, sleep_idle_s=0.6)
    await service.start()
    client = await aiohttp_client(create_app(service))
    try:
        await answer(service, PROMPT)
        ended_s = time.monotonic()
        countdowns = []
        while service.status()["state"] != "sleeping":
            assert time.monotonic() - ended_s < 5, "polling kept the model awake"
            for path in STATUS_PATHS:
                response = await client.get(path)
                assert response.status == 200, path
                if path == "/v1/status":
                    left = (await response.json())["idle"]["sleep"]
                    if left is not None:
                        countdowns.append(left)
            await asyncio.sleep(0.1)
        slept_after_s = time.monotonic() - ended_s
        assert 0.5 < slept_after_s < 2.0
        assert len(countdowns) >= 3 and countdowns == sorted(countdowns, reverse=True)
        health = await (await client.get("/health")).json()
        assert health == {"status": "ok", "state": "sleeping", "ram_mib": 0.0}  # a CPU engine
        assert (await (await client.get("/props")).json())["is_sleeping"] is True
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["status"] == "sleeping"
        metrics = await (await client.get("/metrics")).text()
        assert 'strata_state{state="sleeping"} 1' in metrics
        assert 'strata_arena_resident_bytes{arena="weights"} 0' in metrics
        assert f'strata_arena_released_bytes{{arena="weights"}} {64 << 20}' in metrics

        # A completion through the API wakes it; the answer is the one from before.
        response = await client.post("/v1/completions", json={"prompt": "w31 w32 w33",
                                                               "max_tokens": 4})
        assert response.status == 200, await response.text()
        assert service.status()["state"] == "loaded"
        assert (await (await client.get("/health")).json())["ram_mib"] > 0
    finally:
        await service.stop()


async def test_a_timer_that_comes_due_while_a_request_runs_waits_for_it(tiny_model_dir):
    service = make_service(tiny_model_dir, engine={"token_delay_s": 0.05}, sleep_idle_s=0.3)
    await service.start()
    try:
        await wait_for_state(service, "sleeping", 5)  # counted from the load
        ran_s = time.monotonic()
        states = set()
        async for _ in service.generate(request(PROMPT, max_tokens=15)):
            states.add(service.status()["state"])
        assert time.monotonic() - ran_s > 0.6  # longer than the timer
        assert states == {"busy"}  # never put to sleep under the running request
        assert service.status()["state"] == "loaded"
        assert 0.2 < await wait_for_state(service, "sleeping", 5) < 1.5  # from the end
    finally:
        await service.stop()


async def test_a_timer_for_a_level_the_model_lacks_stays_off(tiny_model_dir):
    service = make_service(tiny_model_dir, cache_release_idle_s=0.2, sleep_idle_s=0.5)
    await service.start()
    try:
        await answer(service, PROMPT)
        assert service.status()["idle"]["cache_release"] is None  # dense: no expert cache
        await wait_for_state(service, "sleeping", 5)
        assert service.status()["counters"]["level_failures"] == {}
    finally:
        await service.stop()


async def test_a_fired_timer_says_when_and_a_listener_hears_the_cause(tiny_model_dir):
    service = make_service(tiny_model_dir, sleep_idle_s=0.3)
    events = []
    service.level_listeners.append(events.append)
    await service.start()
    try:
        await answer(service, PROMPT)
        await wait_for_state(service, "sleeping", 10)
        status = service.status()
        assert status["idle"]["sleep"] is None  # not counting down: it fired
        assert 0 <= status["idle_fired"]["sleep"] < 10
        assert [(e.action, e.is_ok, e.cause) for e in events] == [
            ("load", True, None), ("sleep", True, "idle for 0.3 s")]
        await answer(service, PROMPT)  # the next request: the timer runs again
        status = service.status()
        assert status["idle_fired"] == {} and 0 < status["idle"]["sleep"] <= 0.3
    finally:
        await service.stop()
