"""One form field per setting of the schema (settings_schema.py), picked by the setting's kind.

An editor shows a setting's value as the config file holds it and gives back the value the
form has, None meaning "absent from the file" (the default applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from strata.engine.service.settings import Setting
from strata.engine.service.settings_kinds import Command, Integer, ModelName, Seconds, Size, Text
from strata.units import MIB

WEEK_S = 7 * 86400
MAX_MIB = 64 * 1024 * 1024  # spin boxes hold an int: sizes are shown in MiB
MAX_WAIT_S = 3600


class SettingEditor:
    """A setting's input widget (`input`), the row that holds it (`row`), get and set."""

    def __init__(self, spec: Setting, input_widget: QWidget, row: QWidget | None = None):
        self.spec = spec
        self.input = input_widget
        self.row = row or input_widget

    def get(self) -> Any:
        raise NotImplementedError

    def set(self, value: Any) -> None:
        raise NotImplementedError


class TextEditor(SettingEditor):
    input: QLineEdit

    def __init__(self, spec: Setting, input_widget: QLineEdit, row: QWidget | None = None):
        super().__init__(spec, input_widget, row)

    def get(self) -> Any:
        text = self.input.text()
        if getattr(self.spec.kind, "is_secret", False):  # a key is taken as typed
            return text or None
        return text.strip() or None

    def set(self, value: Any) -> None:
        if isinstance(value, (list, tuple)):  # an argv list shows as one command line
            value = " ".join(value)
        self.input.setText(str(value or ""))


class NumberEditor(SettingEditor):
    """Integers, seconds (an idle timer's 0 is "off", None in the file) and sizes (in MiB)."""

    input: QSpinBox | QDoubleSpinBox

    def __init__(self, spec: Setting, input_widget: QSpinBox | QDoubleSpinBox,
                 row: QWidget | None = None):
        super().__init__(spec, input_widget, row)

    def get(self) -> Any:
        value = self.input.value()
        if isinstance(self.spec.kind, Size):
            return value * MIB
        if isinstance(self.spec.kind, Seconds) and self.spec.kind.is_timer:
            return value or None
        return value

    def set(self, value: Any) -> None:
        if value is None:
            value = self.spec.default
        if isinstance(self.spec.kind, Size):
            self.input.setValue(int(self.spec.check(value) // MIB))
        elif isinstance(self.spec.kind, Seconds):
            assert isinstance(self.input, QDoubleSpinBox)  # _spin_box gives seconds a double box
            self.input.setValue(float(value or 0))
        else:
            self.input.setValue(int(value))


def path_row(edit: QLineEdit, pick: Callable[[], None]) -> QWidget:
    """A line edit with a Browse… button."""
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(edit)
    browse = QPushButton("Browse…")
    browse.clicked.connect(pick)
    layout.addWidget(browse)
    return row


def _spin_box(spec: Setting) -> QSpinBox | QDoubleSpinBox:
    kind = spec.kind
    suffix = f" {spec.unit}" if spec.unit in ("s", "MiB") else ""
    box: QSpinBox | QDoubleSpinBox
    if isinstance(kind, Seconds):
        box = QDoubleSpinBox(maximum=WEEK_S if kind.is_timer else MAX_WAIT_S, suffix=" s",
                             decimals=0 if kind.is_timer else 1)
        if kind.is_timer:
            box.setSpecialValueText("off")  # 0 shows as "off", like the config's absent key
    elif isinstance(kind, Size):
        box = QSpinBox(maximum=MAX_MIB, suffix=" MiB")
    else:
        assert isinstance(kind, Integer)
        box = QSpinBox(minimum=kind.low, maximum=kind.high or 1024 * 1024, suffix=suffix)
    if spec.placeholder:  # shown at the minimum: "any free port"
        box.setSpecialValueText(spec.placeholder)
    return box


def editor_for(spec: Setting, pick_path: Callable[[QLineEdit, str], None]) -> SettingEditor:
    """The editor for a setting the window shows; pick_path(edit, "file"|"dir") browses."""
    kind = spec.kind
    if isinstance(kind, (Text, Command, ModelName)):
        edit = QLineEdit()
        if spec.placeholder:
            edit.setPlaceholderText(spec.placeholder)
        if isinstance(kind, Text) and kind.is_secret:
            edit.setEchoMode(QLineEdit.EchoMode.Password)
        row = None
        if isinstance(kind, Text) and kind.path:
            path = kind.path  # a local, so the lambda sees it as a str, not str | None
            row = path_row(edit, lambda: pick_path(edit, path))
        return TextEditor(spec, edit, row)
    if isinstance(kind, (Integer, Seconds, Size)):
        return NumberEditor(spec, _spin_box(spec))
    raise TypeError(f"the Settings window has no editor for {spec.name} ({type(kind).__name__})")
