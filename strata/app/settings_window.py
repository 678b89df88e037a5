"""Settings: server options, rules and autostart, saved to the config file `strata serve` reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from strata.app import autostart
from strata.app.icons import icon
from strata.app.pull_panel import PullPanel
from strata.app.rules_editor import RulesEditor
from strata.app.setting_editors import SettingEditor, TextEditor, editor_for
from strata.app.window_size import fit_to_screen
from strata.engine.service.config_file import read_config, write_config
from strata.engine.service.rules import rule_to_table, rules_from_config
from strata.engine.service.settings import (
    BY_NAME,
    IDLE_FIELDS,
    SETTINGS,
    ServeSettings,
    check_setting,
    field_for_key,
)
from strata.errors import user_message

# Every field the window edits, as the form names it (also in "takes effect on restart"):
# the settings the schema gives a label, in the schema's order.
FIELD_LABELS = {spec.name: spec.label for spec in SETTINGS if spec.label}
IDLE_LABELS = {name: FIELD_LABELS[name] for name in IDLE_FIELDS}
TRAY_TABLE = "tray"  # [tray] holds rules_enabled; settings.py skips it


def canonical_key(key: str) -> str:
    """A config key as the ServeSettings field it sets (config files may use flag names)."""
    return field_for_key(key) or key.replace("-", "_")


class SettingsWindow(QDialog):
    """Loads the config file on open(), writes it on save(); emits what changed."""

    saved = Signal(object)  # set of changed config keys ("rules", "rules_enabled", field names)
    restart_requested = Signal()
    pulled = Signal(str)  # a model arrived in the library (its path): the server rescans

    def __init__(self, config_file: Path, parent: QWidget | None = None,
                 running_endpoint: Callable[[], str | None] | None = None,
                 models_dir: Callable[[], Path] | None = None,
                 running_settings: Callable[[], Any] | None = None):
        """running_endpoint: the URL the server answers at now (None while it is down), shown
        next to the config file's port, which may differ (--port, or port 0).
        models_dir: the library the running server reads, where the Models tab pulls to.
        running_settings: the ServeSettings the server runs with now (command-line flags
        included); an idle timer running with another value than the file's says so."""
        super().__init__(parent)
        self.config_file = Path(config_file)
        self._running_endpoint = running_endpoint or (lambda: None)
        self._running_settings = running_settings or (lambda: None)
        self.setWindowTitle("Strata settings")
        self.setWindowIcon(icon("app"))
        # One editor per labelled setting, built from the schema; each input is also an
        # attribute named after its setting (window.port, window.sleep_idle_s, ...).
        self.editors: dict[str, SettingEditor] = {
            name: editor_for(BY_NAME[name], self._pick_path) for name in FIELD_LABELS
        }
        for name, editor in self.editors.items():
            setattr(self, name, editor.input)
        self.idle = {name: self.editors[name].input for name in IDLE_FIELDS}
        self.snapshot_ram_mib = self.editors["snapshot_ram_budget_bytes"].input
        self.snapshot_disk_mib = self.editors["snapshot_disk_budget_bytes"].input
        self.port_note = QLabel("")
        # A timer the tray counts down while the file says "off" (a flag set it): shown here.
        self.idle_notes = {name: QLabel("") for name in IDLE_FIELDS}
        self.autostart = QCheckBox("Start Strata when I log in")
        self.rules_enabled = QCheckBox("Rules enabled")
        self.rules_editor = RulesEditor()
        self.pull_panel = PullPanel(models_dir)
        self.pull_panel.pulled.connect(self.pulled)
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.restart_button = QPushButton("Restart server now")
        self.restart_button.setVisible(False)
        self.restart_button.clicked.connect(self.restart_requested)
        self._defaults = ServeSettings()
        self._loaded: dict[str, Any] = {}
        self._build()

    def _row(self, name: str) -> QWidget:
        """The form row of a setting, with the extras of the model and port rows."""
        row = self.editors[name].row
        if name == "model":
            # A path setting: a line edit, in a row (path_row) whose layout takes the button.
            editor, layout = self.editors["model"], row.layout()
            assert isinstance(editor, TextEditor) and layout is not None
            use_default = QPushButton("Use default model")
            use_default.clicked.connect(editor.input.clear)
            layout.addWidget(use_default)
        elif name == "port":
            row = QWidget()
            box = QHBoxLayout(row)
            box.setContentsMargins(0, 0, 0, 0)
            box.addWidget(self.editors["port"].input)
            box.addWidget(self.port_note, 1)
        elif name in self.idle_notes:
            row = QWidget()
            box = QHBoxLayout(row)
            box.setContentsMargins(0, 0, 0, 0)
            box.addWidget(self.editors[name].input)
            box.addWidget(self.idle_notes[name], 1)
        return row

    def _build(self) -> None:
        server = QWidget()
        form = QFormLayout(server)
        for name, label in FIELD_LABELS.items():
            form.addRow(label, self._row(name))
        form.addRow("", self.autostart)
        rules = QWidget()
        rules_box = QVBoxLayout(rules)
        rules_box.addWidget(self.rules_enabled)
        rules_box.addWidget(self.rules_editor)
        tabs = QTabWidget()
        tabs.addTab(server, "Server")
        tabs.addTab(rules, "Rules")
        tabs.addTab(self.pull_panel, "Models")
        save = QPushButton("Save")
        save.setDefault(True)
        save.clicked.connect(self.save)
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        buttons = QHBoxLayout()
        buttons.addWidget(self.message, 1)
        buttons.addWidget(self.restart_button)
        buttons.addWidget(save)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        config_label = QLabel(f"Config file: {self.config_file}")
        config_label.setWordWrap(True)  # a long path must not widen the window
        layout.addWidget(config_label)
        layout.addWidget(tabs)
        layout.addLayout(buttons)
        fit_to_screen(self, 640, 600)

    def _pick_path(self, edit: QLineEdit, kind: str) -> None:
        """Browse for a model file (a chosen config.json means its directory) or a folder."""
        if kind == "dir":
            path = QFileDialog.getExistingDirectory(self, "Choose a folder", edit.text())
        else:
            path, _ = QFileDialog.getOpenFileName(
                self, "Choose a model", edit.text(),
                "GGUF models (*.gguf);;Hugging Face config (config.json)")
            if path.endswith("config.json"):
                path = str(Path(path).parent)
        if path:
            edit.setText(path)

    def open_settings(self) -> None:
        """Reload the fields from the config file, then show the window."""
        self.load()
        self.show()
        self.raise_()
        self.activateWindow()

    def load(self) -> None:
        """Fill the fields from the config file (defaults for absent keys)."""
        try:
            raw = read_config(self.config_file)
        except Exception as exc:  # noqa: BLE001 - an unreadable file is shown in the window, not raised
            self._say(user_message(exc) or str(exc), is_error=True)
            raw = {}
        self._loaded = raw
        values = {canonical_key(k): v for k, v in raw.items() if k not in ("rules", TRAY_TABLE)}
        for name, editor in self.editors.items():
            editor.set(values.get(name))
        endpoint = self._running_endpoint()
        self.port_note.setText(f"running now at {endpoint}" if endpoint else "not running now")
        self._show_running_timers(self._effective(values))
        self.autostart.setChecked(autostart.is_autostart_enabled())
        self.rules_enabled.setChecked(bool(raw.get(TRAY_TABLE, {}).get("rules_enabled", True)))
        try:
            self.rules_editor.set_rules(rules_from_config(raw.get("rules", [])))
        except Exception as exc:  # noqa: BLE001 - invalid rules are shown in the window, not raised
            self._say(
                f"rules in the config file are invalid: {user_message(exc) or exc}", is_error=True
            )

    def _show_running_timers(self, from_file: dict[str, Any]) -> None:
        """Next to each idle timer, the value the server runs with where it is not the file's
        (a command-line flag, or a saved change that waits for a restart)."""
        running = self._running_settings()
        for name, note in self.idle_notes.items():
            value = getattr(running, name, None) if running is not None else None
            if running is None or value == from_file.get(name):
                note.setText("")
            else:
                note.setText(f"running now: {f'{value:g} s' if value else 'off'}")

    def server_values(self) -> dict[str, Any]:
        """The ServeSettings fields as the form has them; None means "absent from the file"."""
        return {name: editor.get() for name, editor in self.editors.items()}

    def save(self) -> bool:
        """Validate and write the config file; apply autostart now; emit saved(changed keys)."""
        try:
            values = {k: check_setting(k, v) for k, v in self.server_values().items()}
            rules = self.rules_editor.rules()
        except Exception as exc:  # noqa: BLE001 - any invalid field is shown in the window
            self._say(user_message(exc) or str(exc), is_error=True)
            return False
        old = self._loaded
        config = {canonical_key(k): v for k, v in old.items() if k not in ("rules", TRAY_TABLE)}
        old_values = self._effective(config)
        for name, value in values.items():
            # Only what differs from the default goes into the file: an absent key is the
            # default, and a later Strata's better default then reaches this user too.
            if value is None or value == getattr(self._defaults, name):
                config.pop(name, None)
            else:
                config[name] = list(value) if isinstance(value, tuple) else value
        tray_table = {**old.get(TRAY_TABLE, {}), "rules_enabled": self.rules_enabled.isChecked()}
        config[TRAY_TABLE] = tray_table
        config["rules"] = [rule_to_table(r) for r in rules]
        if not config["rules"] and "rules" not in old:
            del config["rules"]  # no rules, as before: nothing to write
        if tray_table == {"rules_enabled": True} and TRAY_TABLE not in old:
            del config[TRAY_TABLE]  # the default
        changed = {k for k in values if old_values.get(k) != self._effective(config).get(k)}
        if old.get("rules", []) != config.get("rules", []):
            changed.add("rules")
        if old.get(TRAY_TABLE, {}).get("rules_enabled", True) != tray_table["rules_enabled"]:
            changed.add("rules_enabled")
        try:
            write_config(self.config_file, config)
            if self.autostart.isChecked() != autostart.is_autostart_enabled():
                autostart.set_autostart(self.autostart.isChecked())
        except Exception as exc:  # noqa: BLE001 - any failure to save is shown in the window
            self._say(user_message(exc) or str(exc), is_error=True)
            return False
        self._loaded = read_config(self.config_file)
        needs_restart = [label for name, label in FIELD_LABELS.items()
                         if name in changed and BY_NAME[name].needs_restart]
        if needs_restart:
            self._say(f"Saved to {self.config_file}. {', '.join(needs_restart)}: "
                      "takes effect when the server restarts.")
        else:
            self._say(f"Saved to {self.config_file} and applied.")
        self.restart_button.setVisible(bool(needs_restart))
        self.saved.emit(changed)
        return True

    def _effective(self, config: dict[str, Any]) -> dict[str, Any]:
        """The value each form field runs with under `config`: the file's, else the default
        (a value the file spells differently, e.g. an int for a float, compares equal)."""
        result = {}
        for name in FIELD_LABELS:
            try:
                result[name] = check_setting(name, config[name]) if name in config \
                    else getattr(self._defaults, name)
            except Exception:  # noqa: BLE001 - an invalid value in the file: whatever the form saves differs
                result[name] = config.get(name)
        return result

    def _say(self, text: str, is_error: bool = False) -> None:
        self.message.setStyleSheet("color: #da3633" if is_error else "")
        self.message.setText(text)
