"""What the end-to-end test reads from a running tray: a ready file and screenshots.

Enabled only by strata-tray's hidden --ready-file/--artifacts-dir options. The ready file is
JSON, rewritten atomically whenever the state changes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QSystemTrayIcon


class SelfCheck(QObject):
    """Writes the ready file; saves the tray menu and dashboard as PNGs when they are shown."""

    def __init__(self, tray_app: Any, ready_file: str | None, artifacts_dir: str | None):
        super().__init__()
        self.tray_app = tray_app
        self.ready_file = Path(ready_file) if ready_file else None
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir else None
        self.last_written: dict[str, Any] = {}
        self.timer = QTimer(self)
        self.timer.setInterval(200)
        self.timer.timeout.connect(self._write_ready)

    def start(self) -> None:
        if self.artifacts_dir is not None:
            self.artifacts_dir.mkdir(parents=True, exist_ok=True)
            self.tray_app.tray.menu.aboutToShow.connect(
                lambda: QTimer.singleShot(500, self._grab_menu)
            )
            self.tray_app.dashboard.installEventFilter(self)
        self.timer.start()

    def _write_ready(self) -> None:
        if self.ready_file is None:
            return
        tray = self.tray_app.tray.tray
        status = self.tray_app.bridge.last_status
        geometry = tray.geometry()
        report = {
            "pid": os.getpid(),
            "tray_available": QSystemTrayIcon.isSystemTrayAvailable(),
            "tray_visible": tray.isVisible(),
            "tray_geometry": [geometry.x(), geometry.y(), geometry.width(), geometry.height()],
            "icon": self.tray_app.tray.icon_name,
            "state": status.get("state"),
            "endpoint": status.get("endpoint"),
            "last_error": status.get("last_error"),
            "status_line": self.tray_app.tray.status_action.text(),
            "models_menu": [entry.menu.title()
                            for entry in self.tray_app.tray.models_menu.entries.values()],
            "dashboard_visible": self.tray_app.dashboard.isVisible(),
        }
        state = report["state"]
        if (
            self.artifacts_dir is not None
            and report["dashboard_visible"]
            and state != self.last_written.get("state")
            and state not in (None, "starting", "busy")
        ):
            # One picture per level the dashboard lives through (dashboard-sleeping.png, ...),
            # taken once the chart has caught up with the change.
            path = self.artifacts_dir / f"dashboard-{state}.png"
            QTimer.singleShot(1500, lambda: self.tray_app.dashboard.grab().save(str(path)))
        if report != self.last_written:
            tmp = self.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(report), encoding="utf-8")
            tmp.replace(self.ready_file)
            self.last_written = report

    def _grab_menu(self) -> None:
        artifacts_dir = self.artifacts_dir
        if artifacts_dir is None:  # connected only when there is one
            return
        menu = self.tray_app.tray.menu
        menu.grab().save(str(artifacts_dir / "tray-menu.png"))
        screen = QGuiApplication.primaryScreen()
        if screen is not None:  # the whole screen shows the menu next to the tray icon
            screen.grabWindow(0).save(str(artifacts_dir / "screen-with-menu.png"))
        menu.hide()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        artifacts_dir = self.artifacts_dir  # installed only when there is one
        grab = self.tray_app.dashboard.grab  # before `is` narrows the dashboard to a QObject
        if (artifacts_dir is not None and watched is self.tray_app.dashboard
                and event.type() == QEvent.Type.Show):
            # let a few status updates fill the chart before the picture
            path = artifacts_dir / "dashboard.png"
            QTimer.singleShot(2500, lambda: grab().save(str(path)))
        return False
