"""`strata-tray`: the tray app. Hosts the same Service and HTTP API as `strata serve`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from strata import __version__
from strata.app.bridge import ServiceBridge, SignalLogHandler
from strata.app.dashboard import Dashboard
from strata.app.icons import icon
from strata.app.self_check import SelfCheck
from strata.app.service_host import ThreadServiceHost, tray_service_host
from strata.app.settings_window import SettingsWindow
from strata.app.single_instance import SingleInstance, ask_running_instance, server_name
from strata.app.tray import TrayController
from strata.engine.service.config_file import read_config
from strata.engine.service.rules import rules_from_config
from strata.engine.service.settings import add_serve_arguments, overrides_from_args
from strata.logs import setup_logging

log = logging.getLogger("strata.tray")


def build_parser() -> argparse.ArgumentParser:
    """`strata serve`'s options, plus hidden ones the end-to-end test uses."""
    parser = argparse.ArgumentParser(prog="strata-tray", description=__doc__)
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    add_serve_arguments(parser)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--artifacts-dir", help=argparse.SUPPRESS)
    return parser


class TrayApp:
    """Wires the bridge, tray, dashboard and settings together; owns their lifetimes."""

    def __init__(self, app: QApplication, args: argparse.Namespace, config_file: Path):
        self.app, self.args, self.config_file = app, args, config_file
        self.bridge = ServiceBridge(self._new_host())
        self.tray = TrayController(self.bridge)
        self.dashboard = Dashboard(self.bridge)
        self.settings_window = SettingsWindow(
            config_file, running_endpoint=lambda: self.bridge.last_status.get("endpoint"),
            models_dir=lambda: self.bridge.host.models_dir,
            running_settings=lambda: self.settings)
        self.tray.dashboard_requested.connect(self.show_dashboard)
        self.tray.settings_requested.connect(self.settings_window.open_settings)
        self.tray.quit_requested.connect(app.quit)
        self.settings_window.saved.connect(self._settings_saved)
        self.settings_window.restart_requested.connect(self.restart_server)
        self.settings_window.pulled.connect(self.bridge.rescan)
        app.aboutToQuit.connect(self.shutdown)

    def _new_host(self) -> ThreadServiceHost:
        thread_host, self.settings = tray_service_host(self.args.config,
                                                       overrides_from_args(self.args))
        return thread_host

    def start(self) -> None:
        self.bridge.start(self.settings)
        if QSystemTrayIcon.isSystemTrayAvailable():
            self.tray.show()
        else:  # no tray on this desktop: the dashboard is the only way in
            log.warning("no system tray available; showing the dashboard instead")
            self.show_dashboard()

    def show_dashboard(self) -> None:
        self.dashboard.show()
        self.dashboard.raise_()
        self.dashboard.activateWindow()

    def restart_server(self) -> None:
        """Stop the server and start it again with the settings as saved (the app stays)."""
        self.bridge.stop()
        self.bridge.host = self._new_host()
        self.bridge.start(self.settings)
        self.settings_window.restart_button.setVisible(False)

    def _settings_saved(self, changed: set[str]) -> None:
        if changed & {"rules", "rules_enabled"}:
            config = read_config(self.config_file)
            self.bridge.set_rules(rules_from_config(config.get("rules", [])))
            self.bridge.set_rules_enabled(bool(config.get("tray", {}).get("rules_enabled", True)))

    def shutdown(self) -> None:
        """Quit: stop accepting requests, end the engine process, then let Qt exit."""
        self.tray.tray.hide()
        self.settings_window.pull_panel.runner.cancel()  # a pull in flight stops at its next chunk
        self.bridge.stop()


def missing_display_reason(environ: Mapping[str, str] | None = None,
                           platform: str | None = None) -> str | None:
    """Why Qt will find no display here, or None. On Linux without DISPLAY or
    WAYLAND_DISPLAY, Qt's xcb plugin aborts with a message about missing plugins instead."""
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    qpa = environ.get("QT_QPA_PLATFORM", "").split(":")[0]
    if not platform.startswith("linux") or (qpa and qpa not in ("xcb", "wayland")):
        return None  # another OS, or a platform without a display (offscreen, vnc, ...)
    if environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY"):
        return None
    return ("no display: neither DISPLAY nor WAYLAND_DISPLAY is set; start it from a desktop "
            "session, or run `strata serve` for the server without a tray")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `strata-tray` GUI script (pythonw on Windows: no console window)."""
    args = build_parser().parse_args(argv)
    reason = missing_display_reason()
    if reason is not None:
        print(f"strata-tray: {reason}", file=sys.stderr)
        return 1
    # Always a log file too: the tray usually runs under pythonw, with no console to read.
    setup_logging("tray", "%(asctime)s %(name)s: %(message)s", to_file=True)
    from strata.paths import config_path

    config_file = Path(args.config).expanduser() if args.config else config_path()
    app = QApplication(sys.argv[:1])
    app.setApplicationName("Strata")
    app.setQuitOnLastWindowClosed(False)  # closing the dashboard leaves the tray running
    app.setWindowIcon(icon("app"))
    name = server_name(str(config_file.resolve()))
    if ask_running_instance(name):
        print("strata-tray: already running; showing its dashboard", file=sys.stderr)
        return 0
    instance = SingleInstance(name)
    if not instance.listen():
        log.warning("could not claim %s; a second launch will start another tray", name)
    tray_app = TrayApp(app, args, config_file)
    instance.show_requested.connect(tray_app.show_dashboard)
    logging.getLogger().addHandler(SignalLogHandler(tray_app.bridge))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: app.quit())
    wake_python = QTimer()  # Qt's loop is C++: tick so Python can run its signal handlers
    wake_python.timeout.connect(lambda: None)
    wake_python.start(200)
    tray_app.start()
    if args.ready_file or args.artifacts_dir:
        check = SelfCheck(tray_app, args.ready_file, args.artifacts_dir)
        check.start()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
