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

from strata.host.serve import serve

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
    # The marker is only an argument of `python -c`: command-line matching, opted into.
    config = {"rules": [{"name": "game", "trigger": "process", "pattern": f"*{marker}*",
                         "match": "cmdline", "action": "sleep", "on_end": "restore"}]}
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
        # the start, then the restore (load brings back whatever is down)
        assert changes["sleep"] == 1 and changes["load"] == 2
    finally:
        if game_pid is not None and psutil.pid_exists(game_pid):
            kill_hard(game_pid)
        stop.set()
        assert await asyncio.wait_for(server, 20) == 0


async def test_an_unload_rule_comes_back_after_refusals_with_the_conversation(tiny_model_dir,
                                                                               tmp_path):
    """The issue-18 failure: after a game, the restore was refused once and never retried,
    and the conversation was lost. Now: refused while VRAM is short (no crash counted), retried
    with backoff, back once it frees, and the follow-up turn reuses the cache."""
    from fakes.services import answer

    from strata.engine.service.rules import ProcessInfo, Rule
    from strata.engine.service.rules_engine import RulesEngine
    from strata.units import MIB

    free = {"mib": 4000}
    service = make_service(tiny_model_dir, engine={"snapshot_dir": str(tmp_path)},
                           vram_reader=lambda: free["mib"] * MIB, min_free_vram_mib=1000,
                           vram_wait_s=0.1)
    await service.start()
    procs: list[ProcessInfo] = []
    rules = RulesEngine(service, [Rule("Steam game", "process", "unload", "restore",
                                       ("*/steamapps/common/*",))],
                        process_lister=lambda: list(procs), restore_backoff_s=(0.05, 0.1))
    try:
        prompt = tuple(range(20, 60))
        ids, _ = await answer(service, prompt, max_tokens=4)
        procs.append(ProcessInfo(4321, "game", "/games/steamapps/common/G/game", "game"))
        await rules.poll_once()
        assert service.status()["state"] == "unloaded"
        free["mib"] = 300  # the game holds the GPU
        with pytest.raises(Exception) as refused:  # a request meanwhile: 503, not a crash
            await answer(service, prompt)
        assert getattr(refused.value, "status", None) == 503
        procs.clear()  # the game exits, but its memory is not free yet
        await rules.poll_once()
        await asyncio.sleep(0.3)  # a few refused attempts
        assert service.status()["state"] == "waiting_for_vram"
        assert service.status()["engine_crashes"] == 0
        free["mib"] = 4000
        await wait_for_state(service, "loaded")
        _, usage = await answer(service, prompt + tuple(ids) + (9,), max_tokens=2)
        assert usage.cached_tokens >= len(prompt)
        assert service.status()["engine_crashes"] == 0
    finally:
        rules.stop()
        await service.stop()
