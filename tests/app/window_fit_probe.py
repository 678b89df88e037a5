"""Run on a real X display: build each of the tray's windows, show it, and print as JSON
where it landed against the screen (tests/app/test_window_fit_xvfb.py reads it)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from PySide6.QtWidgets import QApplication, QPushButton, QWidget

from strata.app.bridge import ServiceBridge
from strata.app.dashboard import Dashboard
from strata.app.service_host import HostOptions, ThreadServiceHost
from strata.app.settings_window import SettingsWindow
from tests.app.fakes import FakeService, factory_for


def rect(r) -> list[int]:
    return [r.x(), r.y(), r.width(), r.height()]


def placed(window: QWidget, app: QApplication) -> dict:
    window.show()
    for _ in range(20):
        app.processEvents()
    buttons = {b.text(): rect(b.rect().translated(b.mapToGlobal(b.rect().topLeft())))
               for b in window.findChildren(QPushButton) if b.isVisible()}
    hint = window.minimumSizeHint()
    return {"frame": rect(window.frameGeometry()), "min_hint": [hint.width(), hint.height()],
            "buttons": buttons}


def main() -> None:
    app = QApplication(sys.argv[:1])
    screen = app.primaryScreen()
    report: dict = {"available": rect(screen.availableGeometry()),
                    "ratio": screen.devicePixelRatio()}
    with tempfile.TemporaryDirectory() as tmp:
        settings = SettingsWindow(Path(tmp) / "config.toml", models_dir=lambda: Path(tmp))
        settings.load()
        tabs = settings.findChild(__import__("PySide6.QtWidgets").QtWidgets.QTabWidget)
        for index in range(tabs.count()):
            tabs.setCurrentIndex(index)
            report[f"settings:{tabs.tabText(index)}"] = placed(settings, app)
        settings.close()
        host = ThreadServiceHost(factory_for(FakeService()),
                                 options=HostOptions(telemetry_interval_s=0.05))
        bridge = ServiceBridge(host)
        bridge.start(settings=None)
        dashboard = Dashboard(bridge)
        report["dashboard"] = placed(dashboard, app)
        dashboard.close()
        bridge.stop(timeout_s=5)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
