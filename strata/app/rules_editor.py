"""The rules editor (a tab of Settings): one table row per rule, presets one click away."""

from __future__ import annotations

from typing import Any, cast

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from strata.engine.service.rules import (
    ACTIONS,
    MATCH_MODES,
    ON_END,
    PRESETS,
    TRIGGERS,
    Rule,
    RuleConfigError,
)

COLUMNS = ["On", "Name", "Trigger", "Pattern(s) / ignore / GiB", "Action", "When it ends",
           "Match", "Keep free MiB"]
TRIGGER_TEXT = {
    "process": "process starts",
    "gpu_process": "another process uses the GPU",
    "process_vram": "other process VRAM >",
    "free_vram": "free VRAM <",
}
ON_END_TEXT = {"restore": "restore now", "wait": "wait for a request"}
MATCH_TEXT = {"exe": "what it runs", "cmdline": "whole command line"}


class RulesEditor(QWidget):
    """Edits a list of Rules; rules() validates and raises RuleConfigError for a bad row."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.preset_box = QComboBox()
        for key, rule in PRESETS.items():
            self.preset_box.addItem(rule.name, key)
        add_preset = QPushButton("Add preset")
        add_preset.clicked.connect(lambda: self.add_rule(PRESETS[self.preset_box.currentData()]))
        add_custom = QPushButton("Add custom")
        add_custom.clicked.connect(
            lambda: self.add_rule(
                Rule(
                    f"rule {self.table.rowCount() + 1}",
                    "free_vram",
                    "sleep",
                    "restore",
                    threshold_gib=4,
                )
            )
        )
        remove = QPushButton("Remove")
        remove.clicked.connect(self.remove_selected)
        buttons = QHBoxLayout()
        for widget in (self.preset_box, add_preset, add_custom, remove):
            buttons.addWidget(widget)
        buttons.addStretch()
        layout = QVBoxLayout(self)
        intro = QLabel(
            "When a trigger starts, Strata gives VRAM back at the chosen level. Patterns "
            "are globs on what a process runs (executable, Python script); the command "
            "line only when Match says so. For 'another process uses the GPU' the cell "
            "lists programs to ignore."
        )
        intro.setWordWrap(True)  # unwrapped, it made Settings 1569 px wide (issue 51.18)
        layout.addWidget(intro)
        layout.addLayout(buttons)
        layout.addWidget(self.table)

    def _combo(self, options: tuple[str, ...], texts: dict[str, str], value: str) -> QComboBox:
        box = QComboBox()
        for option in options:
            box.addItem(texts.get(option, option.replace("_", " ")), option)
        box.setCurrentIndex(options.index(value))
        return box

    def add_rule(self, rule: Rule) -> None:
        """Append a row showing rule."""
        row = self.table.rowCount()
        self.table.insertRow(row)
        check = QTableWidgetItem()
        check.setFlags(Qt.ItemFlag.ItemIsUserCheckable | Qt.ItemFlag.ItemIsEnabled)
        check.setCheckState(Qt.CheckState.Checked if rule.is_enabled else Qt.CheckState.Unchecked)
        self.table.setItem(row, 0, check)
        self.table.setItem(row, 1, QTableWidgetItem(rule.name))
        self.table.setCellWidget(row, 2, self._combo(TRIGGERS, TRIGGER_TEXT, rule.trigger))
        if rule.trigger == "process":
            what = ", ".join(rule.patterns)
        elif rule.trigger == "gpu_process":
            what = ", ".join(rule.ignore)
        else:
            what = f"{rule.threshold_gib:g}"
        self.table.setItem(row, 3, QTableWidgetItem(what))
        self.table.setCellWidget(row, 4, self._combo(ACTIONS, {}, rule.action))
        self.table.setCellWidget(row, 5, self._combo(ON_END, ON_END_TEXT, rule.on_end))
        self.table.setCellWidget(row, 6, self._combo(MATCH_MODES, MATCH_TEXT, rule.match))
        # shrink_experts only: the MiB to leave free for the other program.
        self.table.setItem(row, 7, QTableWidgetItem(str(rule.keep_free_mib or "")))
        # The default 100 px cut "other process VRAM >" and the other choices off.
        self.table.resizeColumnsToContents()

    def set_rules(self, rules: list[Rule]) -> None:
        self.table.setRowCount(0)
        for rule in rules:
            self.add_rule(rule)

    def remove_selected(self) -> None:
        for row in sorted({index.row() for index in self.table.selectedIndexes()}, reverse=True):
            self.table.removeRow(row)

    def _text(self, row: int, column: int) -> str:
        item = self.table.item(row, column)
        return item.text() if item is not None else ""

    def _is_checked(self, row: int, column: int) -> bool:
        item = self.table.item(row, column)
        return item is not None and item.checkState() == Qt.CheckState.Checked

    def _choice(self, row: int, column: int) -> Any:
        """The current data of the combo box in a cell (every choice column holds one)."""
        return cast(QComboBox, self.table.cellWidget(row, column)).currentData()

    def rules(self) -> list[Rule]:
        """The rules as edited; RuleConfigError names the first bad row."""
        result = []
        for row in range(self.table.rowCount()):
            trigger = self._choice(row, 2)
            what = self._text(row, 3).strip()
            name = self._text(row, 1).strip() or f"rule {row + 1}"
            patterns: tuple[str, ...] = ()
            ignore: tuple[str, ...] = ()
            threshold_gib = 0.0
            if trigger == "process":
                patterns = tuple(p.strip() for p in what.split(",") if p.strip())
            elif trigger == "gpu_process":
                ignore = tuple(p.strip() for p in what.split(",") if p.strip())
            else:
                try:
                    threshold_gib = float(what)
                except ValueError:
                    raise RuleConfigError(
                        f"rule {name!r} (row {row + 1}): {what!r} is not a number "
                        "of GiB; type e.g. 4"
                    ) from None
            keep_text = self._text(row, 7).strip()
            if keep_text and not keep_text.isdigit():
                raise RuleConfigError(f"rule {name!r} (row {row + 1}): keep free {keep_text!r} "
                                      "is not a whole number of MiB; type e.g. 8192")
            result.append(
                Rule(
                    name,
                    trigger,
                    self._choice(row, 4),
                    self._choice(row, 5),
                    patterns,
                    threshold_gib,
                    self._is_checked(row, 0),
                    match=self._choice(row, 6),
                    ignore=ignore,
                    keep_free_mib=int(keep_text or 0),
                )
            )
        names = [r.name for r in result]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate:  # episodes are tracked by name
            raise RuleConfigError(f"two rules are named {duplicate!r}; give each rule its own name")
        return result
