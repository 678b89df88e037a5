"""The worker-thread host: a failed start shows as "failed", and Load tries the start again."""

from __future__ import annotations

import gc
import weakref

from strata.app.bridge import ServiceBridge
from strata.app.service_host import HostOptions, ThreadServiceHost
from strata.errors import StrataError
from tests.app.fakes import FakeRunningServer, FakeService, factory_for


def test_load_retries_a_failed_start_and_quit_stops_the_server(qtbot):
    service = FakeService()
    attempts = []

    async def factory(settings):
        attempts.append(settings)
        if len(attempts) == 1:
            raise StrataError("port 8080 is in use; pick another port")
        return FakeRunningServer(service)

    bridge = ServiceBridge(ThreadServiceHost(factory, options=HostOptions(telemetry_interval_s=0.05)))
    bridge.start(settings="s")
    qtbot.waitUntil(lambda: bridge.last_status.get("state") == "failed")
    assert "port 8080 is in use" in bridge.last_status["last_error"]
    with qtbot.waitSignal(bridge.action_finished, timeout=5000):
        bridge.request("load")
    qtbot.waitUntil(lambda: bridge.last_status.get("endpoint") == "http://127.0.0.1:5555/v1")
    assert attempts == ["s", "s"]
    bridge.stop(timeout_s=5)
    assert service.is_stopped


def _served_and_stopped(qtbot, service: FakeService) -> ServiceBridge:
    # A helper, so the waitUntil lambda's reference to the bridge ends with this frame.
    bridge = ServiceBridge(ThreadServiceHost(factory_for(service),
                                             options=HostOptions(telemetry_interval_s=0.05)))
    bridge.start(settings="s")
    qtbot.waitUntil(lambda: bool(bridge.last_status.get("endpoint")))
    bridge.stop(timeout_s=5)
    qtbot.wait(50)  # queued status signals from the worker thread are delivered, not pending
    return bridge


def test_a_stopped_bridge_is_freed_when_dropped_not_by_a_later_cyclic_collection(qtbot):
    """The host lets go of its listener once its thread ended: the bridge (a QObject) goes
    when its owner drops it, never as cyclic garbage freed inside some later, unrelated code."""
    service = FakeService()
    bridge = _served_and_stopped(qtbot, service)
    assert service.is_stopped
    freed = weakref.ref(bridge)
    gc.disable()
    try:
        del bridge
        assert freed() is None, "the stopped bridge is still held in a reference cycle"
    finally:
        gc.enable()
