"""Rules without Qt: fake process lists and VRAM readings drive triggers; a fake service acts."""

from __future__ import annotations

import asyncio
import logging

import pytest

from strata.engine.service.facade import ServiceError
from strata.engine.service.rules import (
    GIB,
    PRESETS,
    ProcessInfo,
    Rule,
    RuleConfigError,
    matches,
    rule_from_table,
    rule_to_table,
    rules_from_config,
)
from strata.engine.service.rules_engine import RulesEngine, rules_engine_from_config
from strata.engine.service.telemetry import GpuProcess, GpuSnapshot
from tests.fakes.status import service_status

OWN_PID = 1000


class LevelService:
    """Keeps level state like the real Service would: actions change the VRAM it reports."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.resident = {"weights": 4 * GIB, "experts": 10 * GIB, "kv": GIB}
        self.fail_with: ServiceError | None = None

    def status(self) -> dict:
        return service_status(model="tiny-moe", vram={
            k: {"resident_bytes": v, "released_bytes": 0} for k, v in self.resident.items()
        })

    async def control(self, action: str, **kw) -> dict:
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append(action)
        freeing = {
            "release_experts": ["experts"],
            "offload_session": ["kv"],
            "sleep": ["weights", "experts", "kv"],
            "unload": ["weights", "experts", "kv"],
        }
        held_before = sum(self.resident.values())
        for arena in freeing.get(action, []):
            self.resident[arena] = 0
        if action in ("wake", "load", "refill_experts"):
            self.resident.update(weights=4 * GIB, experts=10 * GIB, kv=GIB)
        # Service.control()'s answer: the action, whether it changed anything, what it freed.
        return {"action": action, "changed": True,
                "freed_bytes": max(0, held_before - sum(self.resident.values()))}


class World:
    """A mutable fake process list and GPU."""

    def __init__(self) -> None:
        self.procs = [
            ProcessInfo(1, "systemd", "/usr/lib/systemd/systemd", "/sbin/init"),
            ProcessInfo(OWN_PID, "python", "/usr/bin/python3", "strata-tray"),
        ]
        self.free_bytes = 40 * GIB
        self.gpu_procs: list[GpuProcess] = []
        self.lister_error: Exception | None = None

    def lister(self):
        if self.lister_error is not None:
            raise self.lister_error
        return list(self.procs)

    def gpu(self) -> GpuSnapshot:
        return GpuSnapshot(
            "fake", 80 * GIB, self.free_bytes, 80 * GIB - self.free_bytes, tuple(self.gpu_procs)
        )


def make(rules, world, service=None):
    events = []
    engine = RulesEngine(
        service or LevelService(),
        list(rules),
        on_event=events.append,
        process_lister=world.lister,
        vram_reader=world.gpu,
        own_pids=lambda: {OWN_PID},
    )
    return engine, events


COMFY = ProcessInfo(4242, "python", "/usr/bin/python3", "python /home/me/ComfyUI/main.py --listen")


async def test_process_rule_fires_once_per_episode_and_restores():
    world = World()
    engine, events = make([PRESETS["comfyui"]], world)
    assert await engine.poll_once() == []
    world.procs.append(COMFY)
    await engine.poll_once()
    await engine.poll_once()  # still running: must not fire again
    assert engine.service.calls == ["sleep"]
    assert events[0].sentence.startswith("Released 15.0 GiB for ComfyUI")
    world.procs.remove(COMFY)
    await engine.poll_once()
    assert engine.service.calls == ["sleep", "load"]  # load brings back whatever is down
    assert "took 15.0 GiB back (wake)" in events[-1].sentence
    world.procs.append(COMFY)  # a new episode fires again
    await engine.poll_once()
    assert engine.service.calls == ["sleep", "load", "sleep"]


async def test_wait_on_end_does_not_restore():
    world = World()
    rule = Rule("Blender", "process", "release_experts", "wait", ("blender",))
    engine, events = make([rule], world)
    world.procs.append(ProcessInfo(77, "blender", "/opt/blender/blender", "blender scene.blend"))
    await engine.poll_once()
    world.procs.pop()
    await engine.poll_once()
    assert engine.service.calls == ["release_experts"]
    assert "next request" in events[-1].sentence


async def test_steam_preset_matches_windows_and_linux_paths():
    rule = PRESETS["steam"]
    assert matches(
        rule.patterns, ProcessInfo(5, "game.exe", r"C:\Steam\steamapps\common\Game\game.exe")
    )
    assert matches(
        rule.patterns, ProcessInfo(6, "game", "/home/u/.steam/steam/steamapps/common/G/game")
    )
    assert not matches(rule.patterns, ProcessInfo(7, "steam", "/usr/bin/steam"))
    assert matches(
        PRESETS["sd-webui"].patterns,
        ProcessInfo(8, "python", "", "python /x/stable-diffusion-webui-forge/launch.py"),
    )


async def test_other_process_vram_trigger_ignores_our_own_pid():
    world = World()
    rule = Rule("hog", "process_vram", "offload_session", "restore", threshold_gib=8)
    engine, events = make([rule], world)
    world.gpu_procs = [GpuProcess(OWN_PID, "python", 20 * GIB)]
    await engine.poll_once()
    assert engine.service.calls == []
    world.gpu_procs.append(GpuProcess(99, "blender", 9 * GIB))
    await engine.poll_once()
    assert engine.service.calls == ["offload_session"]
    assert "blender uses 9.0 GiB" in events[0].sentence
    world.gpu_procs.pop()
    await engine.poll_once()  # offload has no explicit restore: the next request brings it back
    assert engine.service.calls == ["offload_session"]
    assert "next request" in events[-1].sentence


async def test_process_vram_rule_says_once_when_the_driver_hides_per_process_vram(caplog):
    """Windows' WDDM: NVML lists GPU processes without their VRAM, so the rule cannot fire."""
    world = World()
    engine, _ = make([Rule("hog", "process_vram", "sleep", "restore", threshold_gib=1)], world)
    world.gpu_procs = [GpuProcess(99, "game.exe", None), GpuProcess(98, "blender.exe", None)]
    with caplog.at_level(logging.WARNING, logger="strata.engine.service.rules"):
        await engine.poll_once()
        await engine.poll_once()
    warnings = [r.getMessage() for r in caplog.records if "per-process VRAM" in r.getMessage()]
    assert len(warnings) == 1 and "use a free_vram or process rule" in warnings[0]
    assert engine.service.calls == []


async def test_free_vram_trigger_has_hysteresis():
    world = World()
    rule = Rule("low", "free_vram", "release_experts", "restore", threshold_gib=4)
    engine, _events = make([rule], world)
    world.free_bytes = 2 * GIB
    await engine.poll_once()
    assert engine.service.calls == ["release_experts"]
    world.free_bytes = 12 * GIB  # our 10 GiB came back free; refilling would drop it to 2 again
    await engine.poll_once()
    assert engine.service.calls == ["release_experts"]
    world.free_bytes = 20 * GIB
    await engine.poll_once()
    assert engine.service.calls == ["release_experts", "load"]


async def test_crashed_lister_is_logged_and_the_loop_goes_on(caplog):
    world = World()
    engine, _events = make([PRESETS["comfyui"]], world)
    world.lister_error = PermissionError("psutil: access denied")
    with caplog.at_level(logging.ERROR):
        task = asyncio.create_task(engine.run(interval_s=0.01))
        await asyncio.sleep(0.05)
        assert not task.done()
        world.lister_error = None
        world.procs.append(COMFY)
        for _ in range(100):
            if engine.service.calls:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert engine.service.calls == ["sleep"]
    assert "process watch: a tick failed" in caplog.text


async def test_busy_retries_and_not_applicable_reports_once():
    world = World()
    service = LevelService()
    engine, events = make([PRESETS["comfyui"]], world, service)
    world.procs.append(COMFY)
    service.fail_with = ServiceError("busy", "a request is running")
    await engine.poll_once()
    assert events == []  # busy: not fired; the driver tries again every BUSY_RETRY_S
    service.fail_with = ServiceError("not_applicable", "no expert cache")
    for _ in range(100):
        if events:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # more retries would report again: they must not
    assert len(events) == 1 and not events[0].is_ok and "no expert cache" in events[0].sentence
    service.fail_with = None
    world.procs.remove(COMFY)
    await engine.poll_once()
    assert service.calls == []  # nothing was released, so nothing to restore


async def test_disabled_engine_does_nothing():
    world = World()
    engine, _events = make([PRESETS["comfyui"]], world)
    engine.set_enabled(False)
    world.procs.append(COMFY)
    await engine.poll_once()
    assert engine.service.calls == []


def test_config_round_trip_and_presets():
    tables = [
        {"preset": "comfyui", "on_end": "wait"},
        {"name": "low", "trigger": "free_vram", "threshold_gib": 3, "action": "unload"},
        {"name": "game", "trigger": "process", "pattern": "*.exe", "enabled": False},
    ]
    rules = rules_from_config(tables)
    assert rules[0].patterns == PRESETS["comfyui"].patterns and rules[0].on_end == "wait"
    assert rules[1].threshold_gib == 3.0 and not rules[2].is_enabled
    assert rules_from_config([rule_to_table(r) for r in rules]) == rules
    engine = rules_engine_from_config(
        LevelService(), {"rules": tables, "tray": {"rules_enabled": False}}
    )
    assert len(engine.rules) == 3 and not engine.is_enabled


@pytest.mark.parametrize(
    "table, words",
    [
        ({"trigger": "process"}, "needs a pattern"),
        ({"trigger": "free_vram"}, "threshold_gib > 0"),
        ({"trigger": "process", "pattern": "x", "action": "slep"}, "unknown action 'slep'"),
        ({"preset": "nope"}, "unknown preset"),
        ({"trigger": "process", "pattern": "x", "colour": "red"}, "unknown key(s) colour"),
        ({"name": "x"}, "no trigger"),
    ],
)
def test_bad_rule_tables_give_one_line_errors(table, words):
    with pytest.raises(RuleConfigError) as info:
        rule_from_table(table)
    assert words in str(info.value) and "\n" not in str(info.value)


async def test_a_program_that_starts_using_the_gpu_fires_the_general_rule():
    world = World()
    gpu_pids = [1]  # the compositor: using the GPU before Strata started, a baseline
    world.procs += [ProcessInfo(3000, "Xorg", "/usr/lib/xorg/Xorg", "Xorg :0"),
                    ProcessInfo(4000, "game", "/opt/game/game", "game")]
    rule = PRESETS["any-gpu-app"]
    engine = RulesEngine(LevelService(), [rule], process_lister=world.lister,
                         gpu_pid_lister=lambda: list(gpu_pids), own_pids=lambda: {OWN_PID})
    await engine.poll_once()
    gpu_pids.append(3000)  # an ignored desktop program
    gpu_pids.append(OWN_PID)  # Strata's own engine
    await engine.poll_once()
    assert engine.service.calls == []
    gpu_pids.append(4000)  # a game creates its CUDA context
    await engine.poll_once()
    assert engine.service.calls == ["sleep"]
    gpu_pids.remove(4000)
    await engine.poll_once()
    assert engine.service.calls == ["sleep", "load"]
