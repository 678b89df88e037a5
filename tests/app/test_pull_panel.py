"""Pull from the settings window: the real pull() on a worker thread against the local hub over
real HTTP, progress in the bar, cancel, errors in one line; a pulled model reaches the pool."""

from __future__ import annotations

import pytest

from strata.app.bridge import ServiceBridge
from strata.app.settings_window import SettingsWindow
from tests.app.fakes import FakePool, model_row
from tests.library.fake_hub import FakeHub, hub_in_thread
from tests.text.spm_gguf import write_spm_gguf


@pytest.fixture
def gguf_bytes(tmp_path_factory) -> bytes:
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "m.gguf").read_bytes()


@pytest.fixture
def hub(gguf_bytes, monkeypatch):
    fake = FakeHub(repos={"acme/tiny-GGUF": {"tiny-Q8_0.gguf": gguf_bytes,
                                             "tiny-Q4_K_M.gguf": gguf_bytes + b"4"}})
    with hub_in_thread(fake) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield fake


@pytest.fixture
def window(qtbot, tmp_path):
    models_dir = tmp_path / "models"
    window = SettingsWindow(tmp_path / "config.toml", models_dir=lambda: models_dir)
    window.models_dir = models_dir
    qtbot.addWidget(window)
    window.show()
    yield window
    window.pull_panel.runner.cancel()
    window.pull_panel.runner.wait()


def test_a_pull_fills_the_bar_and_lands_in_the_library(qtbot, hub, window, gguf_bytes,
                                                       monkeypatch):
    hub.chunk_bytes, hub.chunk_delay_s = 1024, 0.02  # many progress steps
    panel = window.pull_panel
    seen: list[str] = []
    panel.runner.progress.connect(lambda report: seen.append(panel.bar.format()))
    panel.spec.setText("acme/tiny-GGUF:Q8_0")
    with qtbot.waitSignal(window.pulled, timeout=20000) as pulled:
        panel.pull_button.click()
        assert not panel.pull_button.isEnabled() and panel.cancel_button.isEnabled()
    path = window.models_dir / "acme/tiny-GGUF/tiny-Q8_0.gguf"
    assert pulled.args == [str(path)]
    assert path.read_bytes() == gguf_bytes
    assert any(text.startswith("tiny-Q8_0.gguf: ") and "MiB" in text for text in seen)
    assert "verifying tiny-Q8_0.gguf" in seen
    assert panel.bar.value() == 1000 and panel.message.text() == f"Pulled into {path}"
    assert panel.pull_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_cancel_stops_the_download(qtbot, hub, window, monkeypatch):
    hub.chunk_bytes, hub.chunk_delay_s = 512, 0.1  # long enough to cancel halfway
    panel = window.pull_panel
    panel.spec.setText("acme/tiny-GGUF:Q8_0")
    panel.pull_button.click()
    qtbot.waitUntil(lambda: "MiB" in panel.bar.format() and panel.bar.value() > 0,
                    timeout=10000)
    with qtbot.waitSignal(panel.runner.cancelled, timeout=10000):
        panel.cancel_button.click()
    qtbot.waitUntil(lambda: hub.num_aborted == 1, timeout=5000)
    assert not list(window.models_dir.rglob("*.gguf"))
    assert panel.message.text().startswith("Cancelled")
    assert panel.pull_button.isEnabled()


@pytest.mark.parametrize(("spec", "words"), [
    ("acme/missing", "was not found"),
    ("acme/tiny-GGUF", "several GGUF files"),
    ("llama3.2", "OWNER/REPO"),
])
def test_errors_show_in_one_line(qtbot, hub, window, spec, words):
    panel = window.pull_panel
    panel.spec.setText(spec)
    with qtbot.waitSignal(panel.runner.failed, timeout=10000):
        panel.pull_button.click()
    assert words in panel.message.text() and "\n" not in panel.message.text()
    assert "#da3633" in panel.message.styleSheet()
    assert panel.bar.format() == "failed" and panel.pull_button.isEnabled()


def test_a_pulled_model_reaches_the_pool_through_a_rescan(qtbot, make_bridge, tmp_path):
    service = FakePool(models_dir=tmp_path / "library")
    bridge: ServiceBridge = make_bridge(service=service)
    assert bridge.host.models_dir == tmp_path / "library"  # where the window pulls to
    service.rows["tiny-Q8_0"] = model_row("tiny-Q8_0")  # what the pool finds on its rescan
    bridge.rescan("/library/acme/tiny-GGUF/tiny-Q8_0.gguf")
    qtbot.waitUntil(lambda: service.num_rescans == 1)
    qtbot.waitUntil(lambda: [row["name"] for row in bridge.last_status.get("models", [])]
                    == ["tiny-moe", "tiny-Q8_0"])


def test_a_single_model_server_pulls_into_the_model_cache(qtbot, make_bridge, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    bridge = make_bridge()
    assert bridge.host.models_dir == tmp_path / "home/models"
    bridge.rescan()  # nothing to rescan: no error, no crash
