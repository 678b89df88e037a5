"""Engine faults seen through HTTP on a real engine process (the fake engine): a crash is
restarted without waiting for a client, and a command that hangs is killed with a 503 and
Retry-After, never a hang (issue 17 items 5 and 7)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig
from helpers.processes import kill_hard

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.host.serve import serve

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def http_server(model_dir, supervisor_options=None, **engine):
    """`serve` over a Service whose engine process runs the fake engine; yields (base, service)."""
    settings = ServeSettings(model=str(model_dir), port=0)
    service = Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                      engine_config=FakeEngineConfig(model_path=str(model_dir), **engine),
                      supervisor_options={"backoff_base_s": 0.2, "backoff_max_s": 0.4,
                                          **(supervisor_options or {})})
    stop, urls = asyncio.Event(), []
    server = asyncio.create_task(serve(settings, service=service, stop_event=stop,
                                       on_listening=urls.append))
    for _ in range(400):
        if urls or server.done():
            break
        await asyncio.sleep(0.05)
    assert urls, "the server did not start"
    try:
        yield urls[0].removesuffix("/v1"), service
    finally:
        stop.set()
        assert await asyncio.wait_for(server, 20) == 0


async def health(session, base) -> tuple[int, dict]:
    async with session.get(f"{base}/health") as response:
        return response.status, await response.json()


async def wait_healthy(session, base, timeout_s: float = 20.0) -> dict:
    """Poll /health (and nothing else: no request that could start the engine)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        status, body = await health(session, base)
        if status == 200:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"/health still {status} {body} after {timeout_s} s")


async def complete(session, base) -> dict:
    async with session.post(f"{base}/v1/completions",
                            json={"prompt": "w5 w6", "max_tokens": 3}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_health_recovers_by_itself_after_the_engine_is_killed(tiny_model_dir):
    async with http_server(tiny_model_dir) as (base, service), aiohttp.ClientSession() as session:
        assert (await health(session, base))[0] == 200
        pid = service.status()["engine_pid"]
        kill_hard(pid)
        for _ in range(200):  # the supervisor notices the exit
            if service.status()["engine_crashes"] == 1:
                break
            await asyncio.sleep(0.02)
        # Only /health is asked: before, it stayed 503 until a generation request came.
        body = await wait_healthy(session, base)
        assert body["state"] == "loaded"
        status = service.status()
        assert status["engine_pid"] not in (None, pid) and status["engine_crashes"] == 1
        assert (await complete(session, base))["usage"]["completion_tokens"] == 3


async def test_a_slot_command_that_hangs_is_a_503_and_the_engine_restarts(tiny_model_dir):
    options = {"command_timeout_s": 1.0}
    async with http_server(tiny_model_dir, options, slot_delay_s=60.0) as (base, service), \
            aiohttp.ClientSession() as session:
        pid = service.status()["engine_pid"]
        started_s = time.monotonic()
        async with session.post(f"{base}/slots/0?action=restore",
                                json={"filename": "x.slot"}) as response:
            body = await response.json()
            assert response.status == 503, body
            assert int(response.headers["Retry-After"]) >= 1
        assert time.monotonic() - started_s < 10  # the command timeout, not the 60 s hang
        assert body["error"]["code"] == "engine_timeout"
        assert "did not answer RestoreSlot within 1 s" in body["error"]["message"]
        # The wedged process was killed and replaced; the next generation does not hang.
        await wait_healthy(session, base)
        assert service.status()["engine_pid"] not in (None, pid)
        answer = await asyncio.wait_for(complete(session, base), 20)
        assert answer["usage"]["completion_tokens"] == 3


async def test_a_status_read_queued_behind_slow_work_does_not_kill_the_engine(tiny_model_dir):
    from strata.engine import protocol as p
    from strata.engine.service.supervisor import Supervisor

    supervisor = Supervisor(FakeEngineConfig(model_path=str(tiny_model_dir), slot_delay_s=2.0),
                            FAKE_ENGINE_FACTORY, command_timeout_s=10.0)
    try:
        await supervisor.ensure_loaded()
        pid = supervisor.pid
        await supervisor.command(p.SaveSlot(0, "a.slot"))
        restore = asyncio.create_task(supervisor.command(p.RestoreSlot(0, "a.slot")))
        await asyncio.sleep(0.2)  # the engine is inside the 2 s restore now
        with pytest.raises(TimeoutError):  # slow, not wedged: the status read just gives up
            await supervisor.command(p.GetStatus(), 0.3)
        assert (await restore).result["id_slot"] == 0
        assert supervisor.pid == pid and supervisor.state == "loaded"
    finally:
        await supervisor.stop()
