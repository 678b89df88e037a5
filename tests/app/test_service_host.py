"""The worker-thread host: a failed start shows as "failed", and Load tries the start again."""

from __future__ import annotations

from strata.app.bridge import ServiceBridge
from strata.app.service_host import HostOptions, ThreadServiceHost
from strata.errors import StrataError
from tests.app.fakes import FakeRunningServer, FakeService


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
