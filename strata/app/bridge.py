"""The one place where service events enter Qt: a HostListener that re-emits them as signals.

The host calls the listener on its worker thread; emitting a signal from there queues the call
to the receivers' (main) thread, so widgets are only ever touched on the Qt thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from PySide6.QtCore import QObject, Signal

from strata.app import menu_model
from strata.app.service_host import HostListener, ServiceHost, ThreadServiceHost  # noqa: F401
from strata.engine.service.rules import Rule, RuleEvent

log = logging.getLogger(__name__)



class ServiceBridge(QObject):
    """Signals for the tray's widgets, and the Qt-side entry to the host's actions."""

    status_changed = Signal(object)  # dict: service.status() + endpoint, gpu, ram, rules_enabled
    action_finished = Signal(str, object)  # action, result dict
    action_failed = Signal(str, str)  # action, one-line reason
    rule_fired = Signal(object)  # RuleEvent
    log_line = Signal(str)  # "HH:MM:SS text"

    def __init__(self, host: ServiceHost, parent: QObject | None = None):
        super().__init__(parent)
        self.host = host
        self.last_status: dict[str, Any] = {"state": "starting"}
        self.status_changed.connect(self._remember)

    def start(self, settings: Any) -> None:
        """Start the host's worker thread with this bridge as its listener."""
        self.host.start(settings, self)

    def request(self, action: str, **kwargs: Any) -> None:
        """Ask the service for a lifecycle action (model=NAME: that model of the pool); the
        answer comes as action_finished/failed."""
        model = f" {kwargs['model']}" if kwargs.get("model") else ""
        self._log(f"{action.replace('_', ' ')}{model} requested")
        try:
            self.host.call(action, **kwargs)
        except Exception as exc:  # noqa: BLE001 - host not started or already stopped
            self.action_failed.emit(action, str(exc))

    def rescan(self, _path: str = "") -> None:
        """A model arrived in the library (a pull): the pool lists it (status_changed)."""
        try:
            self.host.rescan()
        except Exception as exc:  # noqa: BLE001 - host not started or already stopped
            self._log(f"rescan failed: {exc}")

    def set_rules_enabled(self, is_enabled: bool) -> None:
        self.host.set_rules(is_enabled=is_enabled)
        self._log(f"rules {'on' if is_enabled else 'off'}")

    def set_rules(self, rules: list[Rule]) -> None:
        self.host.set_rules(rules=rules)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the service (blocking until the engine has exited or timeout_s passed)."""
        self.host.stop(timeout_s)

    def _remember(self, status: dict[str, Any]) -> None:
        self.last_status = status

    # ---- HostListener: called on the worker thread, so only emit --------------------------

    def on_status(self, status: dict[str, Any]) -> None:
        self.status_changed.emit(status)

    def on_action(self, action: str, result: dict[str, Any] | None, error: str | None) -> None:
        if error is None:
            model = (result or {}).get("model")  # the pool's answer names the model it acted on
            self._log(menu_model.DONE_VERB.get(action, action) + (f" {model}" if model else ""))
            self.action_finished.emit(action, result or {})
        else:
            self._log(f"{action.replace('_', ' ')} failed: {error}")
            self.action_failed.emit(action, error)

    def on_rule_event(self, event: RuleEvent) -> None:
        self._log(f"rule: {event.sentence}")
        self.rule_fired.emit(event)

    def on_log(self, line: str) -> None:
        self._log(line)

    def _log(self, text: str) -> None:
        self.log_line.emit(f"{time.strftime('%H:%M:%S')} {text}")


class SignalLogHandler(logging.Handler):
    """Warnings and errors from any thread into the dashboard's log, through the bridge."""

    def __init__(self, bridge: ServiceBridge, level: int = logging.WARNING):
        super().__init__(level)
        self.bridge = bridge

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bridge.on_log(f"{record.levelname.lower()}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a log handler must never raise into the caller
            self.handleError(record)
