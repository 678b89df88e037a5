"""The tray menu per state, clicks reaching the service, rule notifications."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.processes import kill_hard

from strata.app.tray import TrayController
from strata.engine.service.rules import Rule
from tests.app.fakes import FakeService

GIB = 1024**3


def enabled_labels(tray: TrayController) -> set[str]:
    return {a.text() for a in tray.level_actions.values() if a.isEnabled()}


def status_for(state: str, **extra) -> dict:
    service = FakeService(state=state)
    status = service.status()
    if state in ("sleeping", "unloaded"):
        status["vram"] = {a: {"resident_bytes": 0, "released_bytes": 0} for a in status["vram"]}
    return {**status, "endpoint": "http://127.0.0.1:1/v1", **extra}


@pytest.mark.parametrize(
    "state, enabled",
    [
        ("loaded", {"Release experts", "Offload session", "Sleep", "Unload"}),
        ("experts_released", {"Refill experts", "Offload session", "Sleep", "Unload"}),
        ("sleeping", {"Wake", "Unload"}),
        ("unloaded", {"Load"}),
        ("failed", {"Load"}),
        ("busy", set()),
        ("starting", set()),
    ],
)
def test_menu_items_follow_the_state(qtbot, make_bridge, state, enabled):
    tray = TrayController(make_bridge())
    tray.apply_status(status_for(state))
    assert enabled_labels(tray) == enabled
    assert (
        tray.icon_name
        == {
            "loaded": "serving",
            "experts_released": "released",
            "sleeping": "sleeping",
            "unloaded": "unloaded",
            "failed": "error",
            "busy": "busy",
            "starting": "busy",
        }[state]
    )


def test_disabled_items_give_their_reason_in_the_status_line(qtbot, make_bridge):
    tray = TrayController(make_bridge())
    tray.apply_status(status_for("loaded", is_busy=True))
    assert enabled_labels(tray) == set()
    assert "a request is running" in tray.status_action.text()
    dense = status_for("loaded")
    dense["vram"]["experts"] = {"resident_bytes": 0, "released_bytes": 0}
    tray.apply_status(dense)
    assert "Release experts" not in enabled_labels(tray)
    assert "dense model: no expert cache" in tray.status_action.text()
    failed = status_for("failed", last_error="engine crashed: out of memory")
    tray.apply_status(failed)
    assert "engine crashed: out of memory" in tray.status_action.text()
    assert "tiny-moe" in tray.tray.toolTip() and "127.0.0.1:1" in tray.tray.toolTip()


def test_a_click_sends_the_action_and_the_menu_follows(qtbot, make_bridge, fake_service):
    bridge = make_bridge()
    tray = TrayController(bridge)
    qtbot.waitUntil(
        lambda: (
            tray.level_actions["sleep"].text() == "Sleep"
            and tray.level_actions["sleep"].isEnabled()
        )
    )
    with qtbot.waitSignal(bridge.action_finished, timeout=5000) as finished:
        tray.level_actions["sleep"].trigger()
    assert finished.args[0] == "sleep"
    assert fake_service.calls == ["sleep"]
    qtbot.waitUntil(lambda: tray.level_actions["sleep"].text() == "Wake")
    assert tray.icon_name == "sleeping"
    tray.level_actions["sleep"].trigger()
    qtbot.waitUntil(lambda: fake_service.calls == ["sleep", "wake"])
    qtbot.waitUntil(tray.level_actions["experts"].isEnabled)  # disabled while sleeping
    tray.level_actions["experts"].trigger()
    qtbot.waitUntil(lambda: fake_service.calls[-1] == "release_experts")


def test_a_failed_action_notifies(qtbot, make_bridge, fake_service):
    bridge = make_bridge()
    tray = TrayController(bridge)
    fake_service.is_busy = True
    with qtbot.waitSignal(tray.notified, timeout=5000) as note:
        bridge.request("sleep")
    assert "a request is running" in note.args[1]


def test_rules_check_switches_the_host(qtbot, make_bridge):
    bridge = make_bridge()
    tray = TrayController(bridge)
    tray.rules_action.setChecked(False)
    qtbot.waitUntil(lambda: bridge.last_status.get("rules_enabled") is False)


def test_a_rule_action_fires_a_notification(qtbot, make_bridge, fake_service):
    """A real process (psutil lister) triggers a real RulesEngine on the host's loop."""
    marker = "strata-rule-trigger-test"
    # The marker is only an argument of `python -c`: command-line matching, opted into.
    rule = Rule("Marker app", "process", "release_experts", "restore", (f"*{marker}*",),
                match="cmdline")
    bridge = make_bridge(rules=[rule])
    tray = TrayController(bridge)
    # Started through a shell that exits at once, so it is not our child: Strata ignores its
    # own process tree (the engine process), and this one must look like someone else's app.
    shell = subprocess.run(
        [
            "sh",
            "-c",
            f"'{sys.executable}' -c 'import time; time.sleep(60)' {marker}"
            " >/dev/null 2>&1 & echo $!",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    other_pid = int(shell.stdout.strip())
    try:
        with qtbot.waitSignal(tray.notified, timeout=10000) as note:
            pass
        assert note.args[0] == "Strata rule: Marker app"
        assert note.args[1].startswith("Released 10.0 GiB for Marker app")
        assert fake_service.calls == ["release_experts"]
    finally:
        kill_hard(other_pid)
    qtbot.waitUntil(
        lambda: fake_service.calls == ["release_experts", "load"], timeout=10000
    )


@pytest.mark.parametrize("mode", ["slots", "all"])
def test_shrink_shows_over_an_expert_cache_and_keeps_half_of_it_free(
        qtbot, make_bridge, fake_service, mode):
    """A partial cache, or one holding every expert (a shrink switches it live, issue 54)."""
    from types import SimpleNamespace

    tray = TrayController(make_bridge())
    status = status_for("loaded")
    tray.apply_status(status)
    assert not tray.shrink_action.isVisible()  # no expert cache (dense): no shrink
    experts_bytes = status["vram"]["experts"]["resident_bytes"]
    status["experts"] = {"mode": mode, "num_slots": 100, "max_slots": 100}
    status["gpu"] = SimpleNamespace(free_bytes=2 * GIB)
    tray.apply_status(status)
    assert tray.shrink_action.isVisible() and "keep serving" in tray.shrink_action.text()
    tray.shrink_action.trigger()
    qtbot.waitUntil(lambda: "shrink_experts" in fake_service.calls, timeout=5000)
    index = fake_service.calls.index("shrink_experts")
    assert fake_service.call_options[index] == {
        "keep_free_mib": (2 * GIB + experts_bytes // 2) >> 20}


def test_every_state_the_service_reports_has_a_label_and_an_icon():
    from strata.app.menu_model import ICON_OF_STATE, STATE_LABEL
    from strata.engine.service.levels import SERVICE_STATES as STATES

    # "starting" is the host's own word, before the service exists; no state a fake made up.
    assert set(STATE_LABEL) == set(ICON_OF_STATE) == {*STATES, "starting"}
