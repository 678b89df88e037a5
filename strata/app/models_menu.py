"""The tray's "Models" submenu: each library model with its state, Load/Wake and Unload.

Rebuilt only when the list of models changes (a pull, a rescan); a status tick only updates
texts and enabled states, so a submenu the user holds open does not close under the pointer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QWidget

from strata.app.bridge import ServiceBridge
from strata.app.models_view import ModelView, model_views


@dataclass
class ModelEntry:
    """The widgets of one model: its submenu (titled with name and state) and two actions."""

    menu: QMenu
    up: QAction
    down: QAction


class ModelsMenu(QMenu):
    """Follows the bridge's status; a click sends load/wake/unload with model=NAME."""

    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None):
        super().__init__("Models", parent)
        self.bridge = bridge
        self.setToolTipsVisible(True)
        self.entries: dict[str, ModelEntry] = {}
        self.empty_action = self.addAction("No models yet")
        self.empty_action.setEnabled(False)
        self._names: tuple[str, ...] = ()

    def apply_status(self, status: dict[str, Any]) -> None:
        views = model_views(status)
        names = tuple(view.name for view in views)
        if names != self._names:
            self._rebuild(names)
        for view in views:
            self._apply(self.entries[view.name], view)

    def _rebuild(self, names: tuple[str, ...]) -> None:
        for entry in self.entries.values():
            self.removeAction(entry.menu.menuAction())
            entry.menu.deleteLater()
        self.entries = {}
        self._names = names
        self.empty_action.setVisible(not names)
        for name in names:
            menu = self.addMenu(name)
            menu.setToolTipsVisible(True)
            menu.menuAction().setCheckable(True)  # checked: the default model
            up, down = menu.addAction("Load"), menu.addAction("Unload")
            up.triggered.connect(lambda _=False, n=name: self._clicked(n, "up"))
            down.triggered.connect(lambda _=False, n=name: self._clicked(n, "down"))
            self.entries[name] = ModelEntry(menu, up, down)

    @staticmethod
    def _apply(entry: ModelEntry, view: ModelView) -> None:
        entry.menu.setTitle(view.label)
        entry.menu.menuAction().setChecked(view.is_default)
        for action, action_view in ((entry.up, view.up), (entry.down, view.down)):
            action.setText(action_view.label)
            action.setData(str(action_view.action))
            action.setEnabled(action_view.is_enabled)
            action.setToolTip(action_view.reason or action_view.label)

    def _clicked(self, name: str, which: str) -> None:
        entry = self.entries.get(name)
        if entry is None:
            return
        action = (entry.up if which == "up" else entry.down).data()
        if action:
            self.bridge.request(action, model=name)
