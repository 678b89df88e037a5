"""The tray builds its server through the same composition root as `strata serve` (issue 21):
one read of the config file gives its settings and rules, and its HTTP runner is the Host's,
with the Host allow-list for the bind and handler cancellation.

Real ThreadServiceHost, Host, Service, Supervisor and engine process loop (fake engine).
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.app.service_host import HostOptions, tray_service_host
from strata.engine.service.service import Service
from strata.host import root
from strata.host.serve import serve_host

pytestmark = pytest.mark.timeout(90)
FAST_POLL = HostOptions(telemetry_interval_s=0.05, rules_interval_s=0.1)


class Listener:
    def __init__(self):
        self.statuses: list[dict] = []
        self.changed = threading.Event()

    def on_status(self, status):
        self.statuses.append(status)
        self.changed.set()

    def on_action(self, action, result, error):
        pass

    def on_rule_event(self, event):
        pass

    def on_log(self, line):
        pass


def _status_for_host(url: str, host: str) -> int:
    request = urllib.request.Request(url, headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def listen_calls(monkeypatch):
    """Every Host.listen call: the one HTTP runner both front ends must go through."""
    calls = []
    original = root.Host.listen

    async def spy(self, service, sockets):
        calls.append(self.port_advice)
        return await original(self, service, sockets)

    monkeypatch.setattr(root.Host, "listen", spy)
    return calls


def _fake_service(model_dir):
    def make(settings):
        return Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                       engine_config=FakeEngineConfig(model_path=str(model_dir),
                                                      token_delay_s=0.05))

    return make


def _write_config(tmp_path, model_dir):
    path = tmp_path / "config.toml"
    path.write_text(f'model = "{model_dir}"\nhost = "0.0.0.0"\nport = 0\n'
                    'allowed-hosts = ["host.docker.internal"]\n'
                    '[[rules]]\npreset = "blender"\n[tray]\nrules_enabled = false\n',
                    encoding="utf-8")
    return path


def test_the_tray_serves_through_the_host_like_serve(tiny_model_dir, tmp_path, listen_calls):
    config = _write_config(tmp_path, tiny_model_dir)
    host, settings = tray_service_host(str(config), {"port": None}, options=FAST_POLL,
                                       make_service=_fake_service(tiny_model_dir))
    assert settings.allowed_hosts == ("host.docker.internal",) and settings.port == 0
    listener = Listener()
    host.start(settings, listener)
    try:
        deadline_s = time.monotonic() + 30
        while host.endpoint_url is None and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert host.endpoint_url, listener.statuses[-1:]
        assert listen_calls == ["--port or in Settings"]
        base = host.endpoint_url.removesuffix("/v1")
        port = base.rsplit(":", 1)[1]
        assert _status_for_host(f"{base}/v1/models", f"evil.example:{port}") == 403
        assert _status_for_host(f"{base}/v1/models", f"host.docker.internal:{port}") == 200
        # A client that gives up cancels its generation at once (handler_cancellation).
        body = b'{"prompt": "w5 w6", "max_tokens": 3000}'  # 150 s at 50 ms a token
        request = urllib.request.Request(f"{host.endpoint_url}/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):
            urllib.request.urlopen(request, timeout=1.5)
        assert any(s.get("is_busy") for s in listener.statuses), "it never generated"
        deadline_s = time.monotonic() + 5
        while time.monotonic() < deadline_s:
            listener.changed.clear()
            listener.changed.wait(1)
            if not listener.statuses[-1].get("is_busy"):
                break
        assert not listener.statuses[-1].get("is_busy"), "the abandoned generation still runs"
    finally:
        host.stop(timeout_s=20)


def test_serve_builds_through_the_same_host(tiny_model_dir, tmp_path, listen_calls):
    config = _write_config(tmp_path, tiny_model_dir)
    host = root.Host.from_config(config, {}, make_service=_fake_service(tiny_model_dir))
    assert [r.name for r in host.rules] == ["Blender"] and host.rules_enabled is False

    async def run() -> list[str]:
        stop = asyncio.Event()
        urls: list[str] = []
        server = asyncio.create_task(serve_host(host, stop_event=stop, on_listening=urls.append))
        for _ in range(400):
            if urls or server.done():
                break
            await asyncio.sleep(0.05)
        stop.set()
        assert await asyncio.wait_for(server, 20) == 0
        return urls

    assert asyncio.run(run())
    assert listen_calls == ["--port"]


def test_a_config_the_tray_cannot_read_shows_as_the_error_state(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("sleep-idle = -5\n", encoding="utf-8")
    host, settings = tray_service_host(str(config), {}, options=FAST_POLL)
    assert settings is None
    listener = Listener()
    host.start(settings, listener)
    try:
        deadline_s = time.monotonic() + 10
        while time.monotonic() < deadline_s and not any(
                s.get("state") == "failed" for s in listener.statuses):
            time.sleep(0.05)
        failed = next(s for s in listener.statuses if s.get("state") == "failed")
        assert "'sleep-idle' must be >= 0 seconds" in failed["last_error"]
    finally:
        host.stop(timeout_s=10)
