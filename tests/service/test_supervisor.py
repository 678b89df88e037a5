"""The Supervisor over a real spawned engine process running the fake engine."""

from __future__ import annotations

import asyncio
import os

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig, expected_tokens
from helpers.processes import KILLED_WORDS, kill_hard

from strata.engine import protocol as p
from strata.engine.service.supervisor import EngineUnavailable, Supervisor

from .conftest import drain, token_ids

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def make_supervisor():
    made: list[Supervisor] = []

    def make(config: FakeEngineConfig | None = None, **options) -> Supervisor:
        supervisor = Supervisor(config or FakeEngineConfig(), FAKE_ENGINE_FACTORY, **options)
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        await supervisor.stop()


async def test_start_load_stream_and_clean_stop(make_supervisor):
    supervisor = make_supervisor(FakeEngineConfig(context_tokens=64))
    states: list[str] = []
    supervisor.state_listeners.append(states.append)
    info = await supervisor.ensure_loaded()
    assert info["context_tokens"] == 64 and supervisor.state == "loaded"
    pid = supervisor.pid
    assert pid and pid != os.getpid()

    events = await drain(supervisor.stream("r1", (3, 4), p.SamplingSpec(max_tokens=7)))
    assert token_ids(events) == expected_tokens((3, 4), 7)
    assert events[-1] == p.Done("r1", p.Usage(2, 7, 0, "length"), slot=0)
    status = await supervisor.command(p.GetStatus())
    assert status.engine.state == "loaded" and status.engine.slots[0].n_tokens == 9

    assert await supervisor.ensure_loaded() == info  # already up: no second process
    assert supervisor.pid == pid and supervisor.num_starts == 1

    process = supervisor._handle.process
    await supervisor.stop()
    assert process.exitcode == 0  # it took the Unload path, not terminate/kill
    assert supervisor.state == "unloaded" and supervisor.pid is None
    assert states == ["starting", "loaded", "unloaded"]


async def test_kill_mid_stream_fails_the_stream_and_the_next_request_restarts(make_supervisor):
    supervisor = make_supervisor(FakeEngineConfig(token_delay_s=0.02))
    await supervisor.ensure_loaded()
    first_pid = supervisor.pid
    events = []
    async for event in supervisor.stream("r1", (1,), p.SamplingSpec(max_tokens=500)):
        events.append(event)
        if len(events) == 1:
            kill_hard(first_pid)
    assert isinstance(events[-1], p.Error) and events[-1].code == "engine_crashed"
    assert KILLED_WORDS in events[-1].message
    assert supervisor.state == "failed" and KILLED_WORDS in supervisor.last_error

    await supervisor.ensure_loaded()  # the first crash restarts at once
    assert supervisor.pid not in (None, first_pid)
    events = await drain(supervisor.stream("r2", (1,), p.SamplingSpec(max_tokens=4)))
    assert token_ids(events) == expected_tokens((1,), 4)
    assert supervisor.num_crashes == 1 and supervisor.num_consecutive_failures == 0


async def test_crash_loop_backs_off_and_says_failed(make_supervisor):
    supervisor = make_supervisor(
        FakeEngineConfig(crash_on_load=True), backoff_base_s=0.3, backoff_max_s=0.5
    )
    with pytest.raises(EngineUnavailable, match="exited with code 3"):
        await supervisor.ensure_loaded()
    assert supervisor.state == "failed" and supervisor.retry_in_s == 0  # first: retry at once

    with pytest.raises(EngineUnavailable):
        await supervisor.ensure_loaded()
    assert 0.2 < supervisor.retry_in_s <= 0.3  # second failure: base delay
    assert supervisor.num_starts == 2

    with pytest.raises(EngineUnavailable, match="restarts in") as refused:
        await supervisor.ensure_loaded()
    assert 0 < refused.value.retry_after_s <= 0.3
    assert supervisor.num_starts == 2  # refused while backing off: nothing spawned
    assert supervisor.status()["state"] == "failed"
    assert "exited with code 3" in supervisor.status()["last_error"]

    await asyncio.sleep(supervisor.retry_in_s + 0.05)
    with pytest.raises(EngineUnavailable):
        await supervisor.ensure_loaded()
    assert supervisor.num_starts == 3
    assert 0.4 < supervisor.retry_in_s <= 0.5  # doubled to 0.6, capped at 0.5


async def test_a_load_error_is_reported_with_its_reason(make_supervisor):
    supervisor = make_supervisor(FakeEngineConfig(fail_on_load=True))
    with pytest.raises(EngineUnavailable, match=r"load_failed.*not a model file"):
        await supervisor.ensure_loaded()
    assert supervisor.state == "failed" and supervisor.pid is None


async def test_an_engine_stuck_on_cancel_is_killed_and_replaced(make_supervisor):
    supervisor = make_supervisor(FakeEngineConfig(token_delay_s=1.0), cancel_timeout_s=0.2)
    await supervisor.ensure_loaded()
    stuck_pid = supervisor.pid
    finals = []
    stream = supervisor.stream("slow", (1,), p.SamplingSpec(max_tokens=100), on_end=finals.append)
    assert isinstance(await anext(stream), p.Tokens)
    await asyncio.sleep(0.1)  # the engine is inside its next 1 s step now, deaf to the pipe
    await stream.aclose()
    assert finals[0].code == "engine_crashed" and "did not stop" in finals[0].message
    await asyncio.sleep(0.2)
    assert supervisor.state == "failed" and "did not stop" in supervisor.last_error
    await supervisor.ensure_loaded()
    assert supervisor.pid not in (None, stuck_pid)


async def test_stop_during_a_generation_ends_the_stream_and_the_process(make_supervisor):
    supervisor = make_supervisor(FakeEngineConfig(token_delay_s=0.02))
    await supervisor.ensure_loaded()
    stream = supervisor.stream("r", (1,), p.SamplingSpec(max_tokens=1000))
    assert isinstance(await anext(stream), p.Tokens)
    process = supervisor._handle.process
    await supervisor.stop()
    rest = await drain(stream)
    assert rest[-1].usage.finish_reason == "cancelled"
    assert process.exitcode == 0 and supervisor.state == "unloaded"


async def test_a_clean_unload_keeps_its_exit_code_when_the_reader_read_none(make_supervisor,
                                                                          monkeypatch):
    """Run 37: the reader thread and the unload path both join the engine process; the one
    that loses the race to reap it reads no exit code (multiprocessing's poll meets ECHILD),
    and a clean unload left last_exit_code None. The reader's None is forced here."""
    on_exit = Supervisor._on_exit
    monkeypatch.setattr(Supervisor, "_on_exit",
                        lambda self, handle, exit_code: on_exit(self, handle, None))
    supervisor = make_supervisor()
    await supervisor.ensure_loaded()
    await supervisor.stop()
    assert supervisor.last_exit_code == 0
