"""Settings: server options, rules and autostart, saved to the config file `strata serve` reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from strata.app import autostart
from strata.app.config_file import read_config, write_config
from strata.app.icons import icon
from strata.app.rules_editor import RulesEditor
from strata.engine.service.rules import rule_to_table, rules_from_config
from strata.engine.service.settings import FLAG_NAMES, IDLE_FIELDS, ServeSettings, check_setting
from strata.errors import user_message
from strata.units import MIB

IDLE_LABELS = {
    "cache_release_idle_s": "Release experts after idle",
    "session_offload_idle_s": "Offload session after idle",
    "sleep_idle_s": "Sleep after idle",
    "idle_unload_s": "Unload after idle",
}
# Every field the window edits, as the form names it (also in "takes effect on restart").
FIELD_LABELS = {
    "model": "Model",
    "port": "Port",
    "api_key": "API key",
    **IDLE_LABELS,
    "min_free_vram_mib": "VRAM guard: wait for free",
    "vram_wait_s": "VRAM guard: wait at most",
    "before_load": "Before-load command",
    "snapshot_dir": "Snapshot directory",
    "snapshot_ram_budget_bytes": "Snapshot RAM budget",
    "snapshot_disk_budget_bytes": "Snapshot disk budget",
}
TRAY_TABLE = "tray"  # [tray] holds rules_enabled; settings.py skips it


def canonical_key(key: str) -> str:
    """A config key as the ServeSettings field it sets (config files may use flag names)."""
    name = key.replace("-", "_")
    return FLAG_NAMES.get(key.replace("_", "-"), name)


def _path_row(edit: QLineEdit, pick) -> QWidget:
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(edit)
    browse = QPushButton("Browse…")
    browse.clicked.connect(pick)
    layout.addWidget(browse)
    return row


class SettingsWindow(QDialog):
    """Loads the config file on open(), writes it on save(); emits what changed."""

    saved = Signal(object)  # set of changed config keys ("rules", "rules_enabled", field names)
    restart_requested = Signal()

    def __init__(self, config_file: Path, parent: QWidget | None = None,
                 running_endpoint: Callable[[], str | None] | None = None):
        """running_endpoint: the URL the server answers at now (None while it is down), shown
        next to the config file's port, which may differ (--port, or port 0)."""
        super().__init__(parent)
        self.config_file = Path(config_file)
        self._running_endpoint = running_endpoint or (lambda: None)
        self.setWindowTitle("Strata settings")
        self.setWindowIcon(icon("app"))
        defaults = ServeSettings()
        self.model = QLineEdit()
        self.model.setPlaceholderText("embedded default: SmolLM2-135M-Instruct")
        self.port = QSpinBox(maximum=65535)
        self.port.setSpecialValueText("any free port")
        self.port_note = QLabel("")
        self.api_key = QLineEdit(echoMode=QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("none: anyone on this machine may connect")
        self.idle = {name: self._seconds_box(86400 * 7) for name in IDLE_FIELDS}
        self.min_free_vram_mib = QSpinBox(maximum=1024 * 1024, suffix=" MiB")
        self.vram_wait_s = QDoubleSpinBox(maximum=3600, suffix=" s", decimals=1)
        self.before_load = QLineEdit()
        self.before_load.setPlaceholderText('e.g. curl -X POST http://127.0.0.1:8188/free -d "{}"')
        self.snapshot_dir = QLineEdit()
        self.snapshot_ram_mib = QSpinBox(maximum=1024 * 1024, suffix=" MiB")
        self.snapshot_disk_mib = QSpinBox(maximum=64 * 1024 * 1024, suffix=" MiB")
        self.autostart = QCheckBox("Start Strata when I log in")
        self.rules_enabled = QCheckBox("Rules enabled")
        self.rules_editor = RulesEditor()
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.restart_button = QPushButton("Restart server now")
        self.restart_button.setVisible(False)
        self.restart_button.clicked.connect(self.restart_requested)
        self._defaults = defaults
        self._loaded: dict[str, Any] = {}
        self._build()

    def _seconds_box(self, maximum_s: int) -> QDoubleSpinBox:
        box = QDoubleSpinBox(maximum=maximum_s, suffix=" s", decimals=0)
        box.setSpecialValueText("off")  # 0 shows as "off", like the config's absent key
        return box

    def _build(self) -> None:
        server = QWidget()
        form = QFormLayout(server)
        model_row = _path_row(self.model, self._pick_model)
        use_default = QPushButton("Use default model")
        use_default.clicked.connect(self.model.clear)
        model_row.layout().addWidget(use_default)
        form.addRow("Model", model_row)
        port_row = QWidget()
        port_box = QHBoxLayout(port_row)
        port_box.setContentsMargins(0, 0, 0, 0)
        port_box.addWidget(self.port)
        port_box.addWidget(self.port_note, 1)
        form.addRow("Port", port_row)
        form.addRow("API key", self.api_key)
        for name, box in self.idle.items():
            form.addRow(IDLE_LABELS[name], box)
        form.addRow("VRAM guard: wait for free", self.min_free_vram_mib)
        form.addRow("VRAM guard: wait at most", self.vram_wait_s)
        form.addRow("Before-load command", self.before_load)
        form.addRow("Snapshot directory", _path_row(self.snapshot_dir, self._pick_snapshot_dir))
        form.addRow("Snapshot RAM budget", self.snapshot_ram_mib)
        form.addRow("Snapshot disk budget", self.snapshot_disk_mib)
        form.addRow("", self.autostart)
        rules = QWidget()
        rules_box = QVBoxLayout(rules)
        rules_box.addWidget(self.rules_enabled)
        rules_box.addWidget(self.rules_editor)
        tabs = QTabWidget()
        tabs.addTab(server, "Server")
        tabs.addTab(rules, "Rules")
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
        layout.addWidget(QLabel(f"Config file: {self.config_file}"))
        layout.addWidget(tabs)
        layout.addLayout(buttons)
        self.resize(640, 600)

    def _pick_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self,
            "Choose a model",
            self.model.text(),
            "GGUF models (*.gguf);;Hugging Face config (config.json)",
        )
        if path:  # a chosen config.json means its directory
            self.model.setText(str(Path(path).parent) if path.endswith("config.json") else path)

    def _pick_snapshot_dir(self) -> None:
        path = QFileDialog.getExistingDirectory(
            self, "Snapshot directory", self.snapshot_dir.text()
        )
        if path:
            self.snapshot_dir.setText(path)

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
        d = self._defaults
        self.model.setText(str(values.get("model") or ""))
        self.port.setValue(int(values.get("port", d.port)))
        endpoint = self._running_endpoint()
        self.port_note.setText(f"running now at {endpoint}" if endpoint else "not running now")
        self.api_key.setText(str(values.get("api_key") or ""))
        for name, box in self.idle.items():
            box.setValue(float(values.get(name) or 0))
        self.min_free_vram_mib.setValue(int(values.get("min_free_vram_mib", d.min_free_vram_mib)))
        self.vram_wait_s.setValue(float(values.get("vram_wait_s", d.vram_wait_s)))
        before = values.get("before_load") or ""
        self.before_load.setText(before if isinstance(before, str) else " ".join(before))
        self.snapshot_dir.setText(str(values.get("snapshot_dir") or ""))
        for box, name in (
            (self.snapshot_ram_mib, "snapshot_ram_budget_bytes"),
            (self.snapshot_disk_mib, "snapshot_disk_budget_bytes"),
        ):
            box.setValue(int(check_setting(name, values.get(name, getattr(d, name))) // MIB))
        self.autostart.setChecked(autostart.is_autostart_enabled())
        self.rules_enabled.setChecked(bool(raw.get(TRAY_TABLE, {}).get("rules_enabled", True)))
        try:
            self.rules_editor.set_rules(rules_from_config(raw.get("rules", [])))
        except Exception as exc:  # noqa: BLE001 - invalid rules are shown in the window, not raised
            self._say(
                f"rules in the config file are invalid: {user_message(exc) or exc}", is_error=True
            )

    def server_values(self) -> dict[str, Any]:
        """The ServeSettings fields as the form has them; None means "absent from the file"."""
        return {
            "model": self.model.text().strip() or None,
            "port": self.port.value(),
            "api_key": self.api_key.text() or None,
            **{name: (box.value() or None) for name, box in self.idle.items()},
            "min_free_vram_mib": self.min_free_vram_mib.value(),
            "vram_wait_s": self.vram_wait_s.value(),
            "before_load": self.before_load.text().strip() or None,
            "snapshot_dir": self.snapshot_dir.text().strip() or None,
            "snapshot_ram_budget_bytes": self.snapshot_ram_mib.value() * MIB,
            "snapshot_disk_budget_bytes": self.snapshot_disk_mib.value() * MIB,
        }

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
        needs_restart = [FIELD_LABELS[k] for k in FIELD_LABELS if k in changed]
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
