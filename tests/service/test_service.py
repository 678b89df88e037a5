"""The Service (ServiceFacade) over a real engine process running the fake engine.

Most tests share one Service (one loop, one engine process) to keep spawn costs down; each
test leaves it usable, and generate() brings the engine back when a test took it down.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig, expected_tokens
from helpers.processes import kill_hard

from strata.engine.protocol import Done, Error, SamplingSpec, Tokens
from strata.engine.service.facade import GenerationRequest, ServiceError
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings

from .conftest import drain, token_ids

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]


def make_service(model_dir, **config) -> Service:
    engine_config = FakeEngineConfig(model_path=str(model_dir), **config)
    return Service(ServeSettings(model=str(model_dir)), engine_factory=FAKE_ENGINE_FACTORY,
                   engine_config=engine_config,
                   supervisor_options={"backoff_base_s": 0.2, "backoff_max_s": 0.4})


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def service(tiny_model_dir):
    service = make_service(tiny_model_dir, token_delay_s=0.005)
    await service.start()
    yield service
    await service.stop()


def request(prompt, max_tokens=8, slot=0) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingSpec(max_tokens=max_tokens), slot)


async def test_generate_streams_tokens_and_counts_usage(service, tiny_model_dir):
    before = service.status()["counters"]
    events = await drain(service.generate(request([10, 11, 12], max_tokens=6)))
    assert token_ids(events) == expected_tokens([10, 11, 12], 6)
    assert all(isinstance(e, Tokens) for e in events[:-1]) and isinstance(events[-1], Done)
    assert events[-1].usage.completion_tokens == 6
    after = service.status()["counters"]
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["completion_tokens_total"] == before["completion_tokens_total"] + 6
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"] + 3
    assert after["tokens_per_second"] > 0

    # The slot's history is reused: the engine reports the cached prefix, the service sums it.
    events = await drain(service.generate(request([10, 11, 12, 99], max_tokens=2)))
    assert events[-1].usage.cached_tokens == 3
    assert service.status()["counters"]["cached_tokens_total"] >= before["cached_tokens_total"] + 3
    status = service.status()
    assert status["state"] == "loaded" and status["engine_pid"] and status["queue_length"] == 0
    assert status["model"] == tiny_model_dir.name and status["context_tokens"] == 4096


async def test_requests_beyond_parallel_wait_and_start_in_arrival_order(tiny_model_dir):
    service = make_service(tiny_model_dir, token_delay_s=0.005, num_slots=2)  # parallel 2
    await service.start()
    started: list[int] = []
    batches: list[dict] = []

    async def run(i: int) -> list:
        events = []
        async for event in service.generate(request([100 + i], max_tokens=5 + i, slot=None)):
            if not events:
                started.append(i)
            events.append(event)
        return events

    try:
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(run(i)))
            await asyncio.sleep(0)  # let it reach the gate's queue, so arrival order is i
        await asyncio.sleep(0.01)
        batches.append(service.status()["batch"])
        results = await asyncio.gather(*tasks)
    finally:
        await service.stop()
    assert started == [0, 1, 2, 3, 4]
    assert batches[0]["running"] == 2 and batches[0]["waiting"] == 3  # two run, three wait
    assert batches[0]["parallel"] == 2 and batches[0]["num_slots"] == 2
    for i, events in enumerate(results):
        assert token_ids(events) == expected_tokens([100 + i], 5 + i)  # none lost or mixed
        assert len({e.request_id for e in events}) == 1
        assert events[-1].usage.finish_reason == "length"


async def test_closing_a_stream_cancels_it_and_the_next_request_is_unaffected(service):
    cancelled_before = service.status()["counters"]["finish_reasons"].get("cancelled", 0)
    stream = service.generate(request([7], max_tokens=10_000))
    assert isinstance(await anext(stream), Tokens)
    await stream.aclose()  # the client went away
    assert not service.status()["is_busy"]
    counters = service.status()["counters"]
    assert counters["finish_reasons"]["cancelled"] == cancelled_before + 1

    events = await drain(service.generate(request([8, 9], max_tokens=4)))
    assert token_ids(events) == expected_tokens([8, 9], 4)
    assert events[-1].usage.finish_reason == "length"


async def test_a_cancelled_consumer_task_frees_the_lane(service):
    # aiohttp cancels the handler task when the client disconnects.
    got_first = asyncio.Event()

    async def consume():
        async for _event in service.generate(request([3], max_tokens=10_000)):
            got_first.set()

    task = asyncio.create_task(consume())
    await got_first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    events = await drain(service.generate(request([4], max_tokens=3)))
    assert token_ids(events) == expected_tokens([4], 3)


async def test_engine_killed_mid_stream_gives_an_error_then_recovers(service):
    await service.control("load")
    pid = service.status()["engine_pid"]
    events = []
    async for event in service.generate(request([1, 2], max_tokens=10_000)):
        events.append(event)
        if len(events) == 1:
            kill_hard(pid)
    assert isinstance(events[-1], Error) and events[-1].code == "engine_crashed"
    assert service.status()["state"] == "failed"

    events = await drain(service.generate(request([1, 2], max_tokens=3)))
    assert token_ids(events) == expected_tokens([1, 2], 3)
    status = service.status()
    assert status["state"] == "loaded" and status["engine_pid"] not in (None, pid)
    assert status["counters"]["errors"]["engine_crashed"] >= 1


async def test_unload_then_generate_brings_the_engine_back(service):
    await service.control("load")
    result = await service.control("unload")
    assert result["state"] == "unloaded" and result["engine_pid"] is None
    # Text works without the engine.
    assert service.text.encode("w5 w6", add_special=False) == [5, 6]
    events = await drain(service.generate(request([5, 6], max_tokens=3)))
    assert token_ids(events) == expected_tokens([5, 6], 3)
    assert service.status()["state"] == "loaded"


async def test_unload_while_a_request_runs_is_refused(service):
    stream = service.generate(request([2], max_tokens=10_000))
    await anext(stream)
    with pytest.raises(ServiceError) as refused:
        await service.control("unload")
    assert refused.value.status == 409 and refused.value.code == "busy"
    await stream.aclose()
    assert (await service.control("unload"))["state"] == "unloaded"


async def test_unknown_actions_and_missing_levels_are_not_applicable(service):
    await service.control("load")
    for action in ("release_experts", "frobnicate"):  # the fake is dense: no expert cache
        with pytest.raises(ServiceError) as refused:
            await service.control(action)
        assert (refused.value.status, refused.value.code) == (400, "not_applicable")


async def test_bad_requests_fail_before_any_event(service):
    for bad in (request([]), request([1], max_tokens=0), request([1], slot=9), request([600])):
        with pytest.raises(ServiceError) as refused:
            await anext(service.generate(bad))
        assert refused.value.status == 400


async def test_an_engine_that_cannot_start_answers_503_before_any_event(tiny_model_dir):
    broken = make_service(tiny_model_dir, crash_on_load=True)
    await broken.start()  # does not raise: the service stays up and says why
    assert broken.status()["state"] == "failed"
    assert "exited with code 3" in broken.status()["last_error"]
    with pytest.raises(ServiceError) as first:
        await anext(broken.generate(request([1])))  # first failure: retried at once, fails
    with pytest.raises(ServiceError) as second:
        await anext(broken.generate(request([1])))  # backing off: refused without a spawn
    assert (first.value.status, first.value.code) == (503, "engine_unavailable")
    assert second.value.retry_after_s and second.value.retry_after_s > 0
    assert broken.status()["engine_starts"] == 2
    assert not broken.status()["is_busy"]
    await broken.stop()
