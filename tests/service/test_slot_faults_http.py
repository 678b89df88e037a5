"""Slot commands that fail on the server's side answer 5xx, not a 400 the client cannot fix
(issue 17 item 11): disk full 507, read-only 500, a command past its timeout 503 + Retry-After.

Real Service, Supervisor and engine process loop (over the fake engine, which writes its slot
files with plain file I/O), a real tmpfs and the real aiohttp app.
"""

from __future__ import annotations

import os

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig
from fakes.services import answer, make_service

from strata.engine.api import create_app
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.tmpfs import fill, remount_read_only, small_tmpfs

pytestmark = pytest.mark.timeout(120)


async def test_disk_full_is_507_and_read_only_is_500(tiny_model_dir, tmp_path, aiohttp_client):
    with small_tmpfs(tmp_path / "snapshots") as disk:
        service = make_service(tiny_model_dir, engine={"snapshot_dir": str(disk)})
        await service.start()
        try:
            client = await aiohttp_client(create_app(service))
            await service.control("load")
            await answer(service, [5, 6, 7], slot=0)
            fill(disk)
            resp = await client.post("/slots/0?action=save", json={"filename": "chat.json"})
            assert resp.status == 507, await resp.text()
            error = (await resp.json())["error"]
            assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
            assert "disk is full" in error["message"]
            assert str(disk) not in error["message"]  # file names, never server paths
            (disk / "filler").unlink()
            remount_read_only(disk)
            resp = await client.post("/slots/0?action=save", json={"filename": "chat.json"})
            assert resp.status == 500, await resp.text()
            error = (await resp.json())["error"]
            assert error["code"] == "read_only_storage" and "read-only" in error["message"]
            # The slot is untouched: a save to a writable place still has its tokens.
            status = service.status()
            assert status["state"] == "loaded" and status["slots"][0]["n_tokens"] > 0
        finally:
            await service.stop()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX (Windows has none)")
async def test_a_slot_command_past_its_timeout_is_503_with_retry_after(
        tiny_model_dir, tmp_path, aiohttp_client):
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    os.mkfifo(snapshots / "stuck.json")  # a restore opens it and waits for a writer forever
    service = Service(ServeSettings(model=str(tiny_model_dir)),
                      engine_factory=FAKE_ENGINE_FACTORY,
                      engine_config=FakeEngineConfig(model_path=str(tiny_model_dir),
                                                     snapshot_dir=str(snapshots)),
                      supervisor_options={"command_timeout_s": 1.0, "stop_timeout_s": 2.0},
                      vram_reader=lambda: None)
    await service.start()
    try:
        client = await aiohttp_client(create_app(service))
        await service.control("load")
        resp = await client.post("/slots/1?action=restore", json={"filename": "stuck.json"})
        assert resp.status == 503, await resp.text()
        assert int(resp.headers["Retry-After"]) >= 1
        error = (await resp.json())["error"]
        assert "did not answer" in error["message"] and error["type"] == "unavailable_error"
    finally:
        await service.stop()
