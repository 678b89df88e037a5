"""The tray icon and its menu; follows the bridge's status signal, sends actions through it."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from strata.app import expert_cache_view, menu_model
from strata.app.bridge import ServiceBridge
from strata.app.icons import icon
from strata.app.models_menu import ModelsMenu
from strata.engine.service.rules import RuleEvent

LEVEL_SLOTS = ("experts", "offload", "sleep", "load")  # the four toggles, in menu order


class TrayController(QObject):
    """Owns the QSystemTrayIcon; dashboard/settings/quit are signals for main to wire."""

    dashboard_requested = Signal()
    settings_requested = Signal()
    quit_requested = Signal()
    notified = Signal(str, str)  # title, message: every notification, shown or not

    def __init__(self, bridge: ServiceBridge, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.icon_name = ""
        self.tray = QSystemTrayIcon(icon("unloaded"), self)
        self.menu = QMenu()
        self.menu.setToolTipsVisible(True)
        self.status_action = self.menu.addAction("Starting…")
        self.status_action.setEnabled(False)
        self.models_menu = ModelsMenu(bridge, self.menu)
        self.menu.addMenu(self.models_menu)
        self.menu.addSeparator()
        self.level_actions: dict[str, QAction] = {}
        for slot in LEVEL_SLOTS:
            action = self.menu.addAction(slot)
            action.triggered.connect(lambda _=False, s=slot: self._level_clicked(s))
            self.level_actions[slot] = action
        # Shown only over a partial expert cache (menu_model.shrink_action).
        self.shrink_action = self.menu.addAction("Shrink experts")
        self.shrink_action.setVisible(False)
        self.shrink_action.triggered.connect(self._shrink_clicked)
        # A partial expert cache's hits and bytes moved (expert_cache_view.py); the dashboard
        # has them a layer each.
        self.experts_action = self.menu.addAction("Experts")
        self.experts_action.setEnabled(False)
        self.experts_action.setVisible(False)
        self.menu.addSeparator()
        self.rules_action = self.menu.addAction("Rules enabled")
        self.rules_action.setCheckable(True)
        self.rules_action.setChecked(True)
        self.rules_action.toggled.connect(bridge.set_rules_enabled)
        self.menu.addSeparator()
        self.menu.addAction("Dashboard").triggered.connect(self.dashboard_requested)
        self.menu.addAction("Settings…").triggered.connect(self.settings_requested)
        self.copy_action = self.menu.addAction("Copy endpoint URL")
        self.copy_action.triggered.connect(self.copy_endpoint)
        self.menu.addSeparator()
        self.menu.addAction("Quit Strata").triggered.connect(self.quit_requested)
        self.tray.setContextMenu(self.menu)
        self.tray.activated.connect(self._activated)
        bridge.status_changed.connect(self.apply_status)
        bridge.rule_fired.connect(self._rule_fired)
        bridge.action_failed.connect(
            lambda action, why: self.notify(
                f"{action.replace('_', ' ').capitalize()} failed", why, is_error=True
            )
        )
        self.apply_status(bridge.last_status)

    def show(self) -> None:
        self.tray.show()

    def apply_status(self, status: dict[str, Any]) -> None:
        """Icon, tooltip, status line and each action's label/enabled state for this status."""
        state = menu_model.effective_state(status)
        name = menu_model.ICON_OF_STATE[state]
        if name != self.icon_name:
            self.tray.setIcon(icon(name))
            self.icon_name = name
        self.tray.setToolTip(menu_model.tooltip(status))
        self.status_action.setText(menu_model.status_line(status))
        self.models_menu.apply_status(status)
        for slot, view in zip(LEVEL_SLOTS, menu_model.lifecycle_actions(status)):
            action = self.level_actions[slot]
            action.setText(view.label)
            action.setData(view.action)
            action.setEnabled(view.is_enabled)
            action.setToolTip(view.reason or view.label)
        shrink = menu_model.shrink_action(status)
        self.shrink_action.setVisible(shrink is not None)
        if shrink is not None:
            self.shrink_action.setText(shrink[0].label)
            self.shrink_action.setData(shrink[1])
        experts = expert_cache_view.summary_line(status)
        self.experts_action.setVisible(experts is not None)
        self.experts_action.setText(experts or "Experts")
        self.copy_action.setEnabled(bool(status.get("endpoint")))
        if "rules_enabled" in status and status["rules_enabled"] != self.rules_action.isChecked():
            self.rules_action.blockSignals(True)  # follow the host; do not echo back to it
            self.rules_action.setChecked(bool(status["rules_enabled"]))
            self.rules_action.blockSignals(False)

    def copy_endpoint(self) -> None:
        endpoint = self.bridge.last_status.get("endpoint")
        if endpoint:
            QGuiApplication.clipboard().setText(str(endpoint))

    def notify(self, title: str, message: str, is_error: bool = False) -> None:
        """A desktop notification (where the tray supports them); always emits notified."""
        self.notified.emit(title, message)
        if self.tray.isVisible() and QSystemTrayIcon.supportsMessages():
            kind = (
                QSystemTrayIcon.MessageIcon.Warning
                if is_error
                else QSystemTrayIcon.MessageIcon.Information
            )
            self.tray.showMessage(title, message, kind, 6000)

    def _level_clicked(self, slot: str) -> None:
        action = self.level_actions[slot].data()
        if action:
            self.bridge.request(action)

    def _shrink_clicked(self) -> None:
        keep_free_mib = self.shrink_action.data()
        if isinstance(keep_free_mib, int):
            self.bridge.request("shrink_experts", keep_free_mib=keep_free_mib)

    def _rule_fired(self, event: RuleEvent) -> None:
        self.notify(f"Strata rule: {event.rule}", event.sentence, is_error=not event.is_ok)

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:  # left click opens the dashboard
            self.dashboard_requested.emit()
