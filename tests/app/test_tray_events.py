"""The tray follows the service's state events: a change shows at once, with no status poll
(the only timer left is the chart's GPU/RAM telemetry, set to an hour here)."""

from __future__ import annotations

import asyncio

from strata.app.bridge import ServiceBridge
from strata.app.service_host import HostOptions, ThreadServiceHost
from strata.app.tray import TrayController
from tests.app.fakes import FakeService, factory_for

NO_POLL = HostOptions(telemetry_interval_s=3600.0, rules_interval_s=3600.0)


def test_the_tray_updates_on_a_state_event_without_a_poll(qtbot):
    service = FakeService()
    host = ThreadServiceHost(factory_for(service), options=NO_POLL)
    bridge = ServiceBridge(host)
    tray = TrayController(bridge)
    bridge.start(settings=None)
    try:
        qtbot.waitUntil(lambda: bool(bridge.last_status.get("endpoint")), timeout=5000)
        qtbot.waitUntil(lambda: tray.status_action.text().startswith("Serving"), timeout=5000)
        # The lifecycle going down by itself, on the service loop: only its event tells.
        host._loop.call_soon_threadsafe(service.fire_idle, "sleep", "sleep", 300.0)
        qtbot.waitUntil(lambda: tray.status_action.text().startswith("Sleeping"), timeout=2000)
        assert bridge.last_status["state"] == "sleeping"
        assert tray.level_actions["sleep"].text() == "Wake"
    finally:
        bridge.stop(timeout_s=5)


def test_the_real_service_tells_its_listeners_of_every_change(tiny_model_dir):
    from fakes.services import answer, make_service

    async def run() -> list[str]:
        service = make_service(tiny_model_dir)
        states: list[str] = []
        service.state_listeners.append(lambda: states.append(service.status()["state"]))
        await service.start()
        try:
            await answer(service, [5, 6, 7], max_tokens=3)
            await service.control("sleep")
            await service.control("unload")
        finally:
            await service.stop()
        return states

    states = asyncio.run(run())
    for state in ("loading", "busy", "sleeping", "unloaded"):
        assert state in states, (state, states)
