"""`strata serve` runs the config file's rules headless: a matching process puts the model to
sleep, and its end wakes it (the RulesEngine acting through Service.control)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import psutil
import pytest
from fakes.services import make_service
from helpers.processes import kill_hard

from strata.engine.service.serve import serve

pytestmark = pytest.mark.timeout(120)


def start_detached(marker: str) -> int:
    """A process that is not our child (own_pids skips children), found by `marker`."""
    line = f"{sys.executable} -c 'import time; time.sleep(60)' {marker} >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", line], capture_output=True, text=True,
                              check=True).stdout)


async def wait_for_state(service, state: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if service.status()["state"] == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"state stayed {service.status()['state']}, never {state}")


async def test_serve_runs_the_config_rules_headless(tiny_model_dir):
    marker = f"strata-test-game-{uuid.uuid4().hex[:8]}"
    service = make_service(tiny_model_dir, port=0)
    config = {"rules": [{"name": "game", "trigger": "process", "pattern": f"*{marker}*",
                         "action": "sleep", "on_end": "restore"}]}
    stop = asyncio.Event()
    urls: list[str] = []
    server = asyncio.create_task(serve(service.settings, service=service, stop_event=stop,
                                       on_listening=urls.append, config=config,
                                       rules_interval_s=0.1))
    game_pid = None
    try:
        for _ in range(200):
            if urls or server.done():
                break
            await asyncio.sleep(0.05)
        assert urls and service.status()["state"] == "loaded"
        game_pid = start_detached(marker)
        await wait_for_state(service, "sleeping")
        kill_hard(game_pid)
        await wait_for_state(service, "loaded")
        changes = service.status()["counters"]["level_changes"]
        assert changes["sleep"] == 1 and changes["wake"] == 1
    finally:
        if game_pid is not None and psutil.pid_exists(game_pid):
            kill_hard(game_pid)
        stop.set()
        assert await asyncio.wait_for(server, 20) == 0
