"""The free-VRAM guard, alone and in front of load, wake and refill (injected readers)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes.fake_engine import expected_tokens
from fakes.services import answer, make_service, moe, request

from strata.engine.api import create_app
from strata.engine.service.facade import ServiceError
from strata.engine.service.vram_guard import MIB, VramGuard

pytestmark = pytest.mark.timeout(120)

PROMPT = (51, 52)


class Reader:
    """Free VRAM as a test sets it; counts the reads."""

    def __init__(self, free_mib: int | None):
        self.free_mib = free_mib
        self.num_reads = 0

    def __call__(self) -> int | None:
        self.num_reads += 1
        return None if self.free_mib is None else self.free_mib * MIB


async def test_the_guard_waits_then_refuses_with_the_missing_mib():
    reader = Reader(400)
    guard = VramGuard(1000, 0.3, reader=reader, poll_interval_s=0.05)
    started_s = time.monotonic()
    with pytest.raises(ServiceError) as refused:
        await guard.wait_for_room("wake the model")
    assert 0.3 <= time.monotonic() - started_s < 1.5 and reader.num_reads >= 3
    error = refused.value
    assert (error.status, error.code) == (503, "insufficient_vram") and error.retry_after_s > 0
    assert error.message.startswith(
        "cannot wake the model yet: needs 1000 MiB free (1000 MiB reserve), 400 MiB free")
    assert "600 MiB missing" in error.message and "--min-free-vram-mib" in error.message


async def test_the_guard_passes_when_vram_frees_up_or_cannot_be_read():
    reader = Reader(100)
    guard = VramGuard(500, 5.0, reader=reader, poll_interval_s=0.05)
    waiting = asyncio.create_task(guard.wait_for_room("load the model"))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    reader.free_mib = 800
    assert await waiting == 800 * MIB
    assert await VramGuard(500, 5.0, reader=Reader(None)).wait_for_room("load") is None
    off = Reader(1)
    assert await VramGuard(0, 5.0, reader=off).wait_for_room("load") is None
    assert off.num_reads == 0  # a minimum of 0 turns the guard off


async def test_too_little_vram_refuses_the_load_and_later_loads(tiny_model_dir, aiohttp_client):
    reader = Reader(400)
    service = make_service(tiny_model_dir, vram_reader=reader, min_free_vram_mib=1000,
                           vram_wait_s=0.3)
    await service.start()  # stays up, unloaded, and says why
    try:
        status = service.status()
        # Waiting for VRAM is a state, not an error (a game holds the GPU).
        assert status["state"] == "waiting_for_vram" and status["engine_starts"] == 0
        assert "600 MiB missing" in status["waiting_for_vram"]["reason"]
        assert status["last_error"] is None and status["engine_crashes"] == 0
        assert status["free_vram_bytes"] == 400 * MIB

        client = await aiohttp_client(create_app(service))
        response = await client.post("/v1/completions", json={"prompt": "w51", "max_tokens": 2})
        assert response.status == 503 and response.headers["Retry-After"] == "5"
        body = await response.json()
        assert body["error"]["code"] == "insufficient_vram"
        assert "600 MiB missing" in body["error"]["message"]
        assert (await client.post("/load")).status == 503
        assert service.status()["state"] == "waiting_for_vram"
        assert service.status()["engine_starts"] == 0

        reader.free_mib = 2000
        ids, _ = await answer(service, PROMPT)
        assert ids == expected_tokens(PROMPT, 6) and service.status()["state"] == "loaded"
        assert service.status()["last_error"] is None
    finally:
        await service.stop()


async def test_wake_and_refill_are_guarded_and_a_queued_request_waits_for_room(tiny_model_dir):
    reader = Reader(None)  # no NVML at load: nothing to wait on
    service = make_service(tiny_model_dir, engine=moe(), vram_reader=reader,
                           min_free_vram_mib=1000, vram_wait_s=0.3)
    await service.start()
    try:
        assert service.status()["state"] == "loaded"
        await answer(service, PROMPT)
        for down, up in (("sleep", "wake"), ("release_experts", "refill_experts")):
            await service.control(down)
            state = service.status()["state"]
            reader.free_mib = 10
            with pytest.raises(ServiceError) as refused:
                await service.control(up)
            # What it maps back (the released arenas) + workspace + the 1000 MiB reserve
            released = sum(a["released_bytes"] for a in service.status()["vram"].values())
            assert released >= (64 + 32) * MIB if up == "wake" else released == 32 * MIB
            missing_mib = -(-(released + 256 * MIB) // MIB) + 1000 - 10
            assert refused.value.code == "insufficient_vram" and f"{missing_mib} MiB missing" in (
                refused.value.message)
            assert service.status()["state"] == state  # nothing changed
            assert service.status()["counters"]["level_failures"][up] == 1
            reader.free_mib = missing_mib + 10  # exactly what it needs is enough
            assert (await service.control(up))["changed"] is True

        await service.control("sleep")
        reader.free_mib = 10

        # With a longer wait, a request waits in "waking" until the VRAM is there, then runs.
        service._guard.wait_s = 10.0
        task = asyncio.create_task(answer(service, PROMPT))
        await asyncio.sleep(0.3)
        assert service.status()["state"] == "waiting_for_vram" and not task.done()
        reader.free_mib = 4000
        ids, usage = await task
        assert ids == expected_tokens(PROMPT, 6) and usage.cached_tokens == len(PROMPT) - 1
        assert service.status()["state"] == "loaded"
    finally:
        await service.stop()


async def test_a_refused_request_raises_before_any_event(tiny_model_dir):
    service = make_service(tiny_model_dir, vram_reader=Reader(0), min_free_vram_mib=1,
                           vram_wait_s=0.1)
    await service.start()
    try:
        stream = service.generate(request(PROMPT))
        with pytest.raises(ServiceError) as refused:
            await anext(stream)
        assert refused.value.status == 503 and refused.value.retry_after_s
        assert service.status()["counters"]["rejected_total"] == 1
        assert not service.status()["is_busy"]
    finally:
        await service.stop()
