"""The dashboard window: VRAM chart, GPU processes, levels, idle countdowns, activity, log."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from strata.app import expert_cache_view, menu_model
from strata.app.bridge import ServiceBridge
from strata.app.icons import icon
from strata.app.menu_model import arena_bytes, gib_text
from strata.app.models_view import budget_text, last_used_text, model_rows, state_label
from strata.app.vram_chart import StackedChart
from strata.app.window_size import fit_to_screen

GPU_SERIES = [
    ("weights", "#2ea043"),
    ("experts", "#56d364"),
    ("kv", "#1f6feb"),
    ("other processes", "#da3633"),
    ("free", "#6e7681"),
]
RAM_SERIES = [("Strata (RSS)", "#2ea043"), ("other", "#da3633"), ("available", "#6e7681")]
MODEL_COLUMNS = ("Model", "State", "VRAM", "On disk", "Last used")
COUNTDOWNS = [
    ("cache_release", "Release experts"),
    ("session_offload", "Offload session"),
    ("sleep", "Sleep"),
    ("unload", "Unload"),
]


def chart_values(status: dict[str, Any]) -> tuple[str, tuple[int, ...]] | None:
    """("gpu"|"ram", values per series) for one status, None when it has no readings."""
    gpu, ram = status.get("gpu"), status.get("ram")
    if gpu is not None:
        arenas = [arena_bytes(status, a) for a in ("weights", "experts", "kv")]
        other = max(0, gpu.used_bytes - sum(arenas))
        return "gpu", (*arenas, other, gpu.free_bytes)
    if ram is not None:
        return "ram", (ram.strata_bytes, ram.used_by_others_bytes, ram.available_bytes)
    return None


def clock_text(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"


class Countdown(QProgressBar):
    """An idle timer: fills down to zero, ticking locally between status updates; once it
    has fired, says how long ago and when it runs again."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self.remaining_s: float | None = None
        self.fired_ago_s: float | None = None
        self.timeout_s: float | None = None
        self.received_s = 0.0
        self.total_s = 0.0
        self.setRange(0, 1000)
        self.tick()

    def set_remaining(self, remaining_s: float | None, total_s: float | None = None,
                      fired_ago_s: float | None = None) -> None:
        """remaining_s: until it fires (None: not counting); total_s: its idle timeout (None:
        off); fired_ago_s: seconds since it fired in this idle period (None: it has not)."""
        if remaining_s is not None and (self.remaining_s is None or remaining_s > self.total_s):
            self.total_s = float(remaining_s)  # a fresh countdown (the timer was reset)
        if total_s:
            self.total_s = float(total_s)
        self.timeout_s = total_s
        self.remaining_s = None if remaining_s is None else float(remaining_s)
        self.fired_ago_s = None if fired_ago_s is None else float(fired_ago_s)
        self.received_s = time.monotonic()
        self.tick()

    def current_s(self) -> float | None:
        if self.remaining_s is None:
            return None
        return max(0.0, self.remaining_s - (time.monotonic() - self.received_s))

    def tick(self) -> None:
        now_s = self.current_s()
        if now_s is not None:
            self.setValue(int(1000 * now_s / self.total_s) if self.total_s else 0)
            self.setFormat(f"{self.label} in {clock_text(now_s)}")
            return
        self.setValue(0)
        if self.fired_ago_s is not None:
            ago_s = self.fired_ago_s + time.monotonic() - self.received_s
            again = f" · again {clock_text(self.timeout_s)} after the next request" \
                if self.timeout_s else ""
            self.setFormat(f"{self.label}: done {clock_text(ago_s)} ago{again}")
        elif self.timeout_s:
            self.setFormat(f"{self.label}: waits for the next request, then "
                           f"{clock_text(self.timeout_s)}")
        else:
            self.setFormat(f"{self.label}: off")


def fill_table(table: QTableWidget, rows: Sequence[tuple[str, ...]]) -> None:
    """Replace table's rows with these cells' texts, a tuple a row."""
    table.setRowCount(len(rows))
    for index, cells in enumerate(rows):
        for column, text in enumerate(cells):
            table.setItem(index, column, QTableWidgetItem(text))


def activity_text(status: dict[str, Any]) -> str:
    """The request activity line, from the service's counters."""
    counters = status.get("counters") or {}  # absent while the server is starting or failed
    return (f"last request {float(counters.get('tokens_per_second', 0.0)):.1f} tok/s · "
            f"queue {menu_model.queue_length(status)} · "
            f"{int(counters.get('cached_tokens_total', 0)):,} of "
            f"{int(counters.get('prompt_tokens_total', 0)):,} prompt tokens from cache")


class Dashboard(QWidget):
    """Follows bridge.status_changed and bridge.log_line; level buttons send actions."""

    def __init__(self, bridge: ServiceBridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.setWindowTitle("Strata dashboard")
        self.setWindowIcon(icon("app"))
        fit_to_screen(self, 760, 720)
        self.mode = ""
        self.header = QLabel("Starting…")
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.header.setWordWrap(True)  # a long error must not widen the window
        self.chart = StackedChart(GPU_SERIES)
        self.chart_note = QLabel("")
        self.processes = QTableWidget(0, 3)
        self.processes.setHorizontalHeaderLabels(["PID", "Process", "VRAM"])
        self.processes.horizontalHeader().setStretchLastSection(True)
        self.processes.setMaximumHeight(140)
        self.models_box = QGroupBox("Models")
        self.models = QTableWidget(0, len(MODEL_COLUMNS))
        self.models.setHorizontalHeaderLabels(list(MODEL_COLUMNS))
        self.models.horizontalHeader().setStretchLastSection(True)
        self.models.horizontalHeader().setSectionResizeMode(
            0, QHeaderView.ResizeMode.ResizeToContents)  # model names are long
        self.models.verticalHeader().setVisible(False)
        self.models.setMaximumHeight(160)
        self.models_budget = QLabel("")
        # A partial expert cache's hits, misses and bytes moved, a row a MoE layer (issue 54).
        self.experts_box = QGroupBox("Expert cache")
        self.experts_summary = QLabel("")
        self.experts_summary.setWordWrap(True)
        self.expert_layers = QTableWidget(0, len(expert_cache_view.LAYER_COLUMNS))
        self.expert_layers.setHorizontalHeaderLabels(list(expert_cache_view.LAYER_COLUMNS))
        self.expert_layers.horizontalHeader().setStretchLastSection(True)
        self.expert_layers.verticalHeader().setVisible(False)
        self.expert_layers.setMaximumHeight(180)
        self.level_labels: dict[str, QLabel] = {}
        self.level_buttons: dict[str, QPushButton] = {}
        self.countdowns = {key: Countdown(label) for key, label in COUNTDOWNS}
        self.activity = QLabel("")
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(1000)
        self._build()
        self.ticker = QTimer(self)
        self.ticker.setInterval(250)
        self.ticker.timeout.connect(self._tick)
        self.ticker.start()
        bridge.status_changed.connect(self.apply_status)
        bridge.log_line.connect(self.log.appendPlainText)
        self.apply_status(bridge.last_status)

    def _build(self) -> None:
        # The panels scroll inside the window, so it fits a 1280x720 screen (or 150% of
        # 1920x1080) whatever they hold; the window's own minimum stays small.
        content = QWidget()
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)
        layout = QVBoxLayout(content)
        layout.addWidget(self.header)
        memory = QGroupBox("Memory, last 10 minutes")
        box = QVBoxLayout(memory)
        box.addWidget(self.chart)
        box.addWidget(self.chart_note)
        box.addWidget(self.processes)
        layout.addWidget(memory, 3)
        models_layout = QVBoxLayout(self.models_box)
        models_layout.addWidget(self.models)
        models_layout.addWidget(self.models_budget)
        layout.addWidget(self.models_box)
        experts_layout = QVBoxLayout(self.experts_box)
        experts_layout.addWidget(self.experts_summary)
        experts_layout.addWidget(self.expert_layers)
        layout.addWidget(self.experts_box)
        levels = QGroupBox("Levels")
        grid = QGridLayout(levels)
        for row, arena in enumerate(("weights", "experts", "kv")):
            grid.addWidget(QLabel(arena), row, 0)
            self.level_labels[arena] = QLabel("")
            grid.addWidget(self.level_labels[arena], row, 1)
        buttons = QHBoxLayout()
        for slot in ("experts", "offload", "sleep", "load"):
            button = QPushButton(slot)
            button.clicked.connect(lambda _=False, s=slot: self._clicked(s))
            self.level_buttons[slot] = button
            buttons.addWidget(button)
        grid.addLayout(buttons, 3, 0, 1, 2)
        layout.addWidget(levels)
        idle = QGroupBox("Idle timers")
        idle_box = QVBoxLayout(idle)
        for bar in self.countdowns.values():
            idle_box.addWidget(bar)
        layout.addWidget(idle)
        layout.addWidget(self.activity)
        layout.addWidget(self.log, 2)
        scroll.setWidget(content)

    def apply_status(self, status: dict[str, Any]) -> None:
        """Refresh every panel from one status snapshot."""
        state = menu_model.effective_state(status)
        self.header.setText(
            f"<b>{status.get('model') or 'no model'}</b> · "
            f"{menu_model.STATE_LABEL[state]} · "
            f"{status.get('endpoint') or 'endpoint not up'}"
            + (
                f"<br><font color='#da3633'>{status['last_error']}</font>"
                if status.get("last_error")
                else ""
            )
            + (
                f"<br><font color='#b7791f'>{status['kernel_notice']}</font>"
                if status.get("kernel_notice")
                else ""
            )
        )
        self._apply_chart(status)
        self._apply_models(status)
        self._apply_levels(status)
        self._apply_experts(status)
        idle = status.get("idle") or {}
        totals = status.get("idle_timeouts") or {}
        fired = status.get("idle_fired") or {}
        for key, bar in self.countdowns.items():
            bar.set_remaining(idle.get(key), totals.get(key), fired.get(key))
        self.activity.setText(activity_text(status))

    def _apply_chart(self, status: dict[str, Any]) -> None:
        reading = chart_values(status)
        if reading is None:
            return
        mode, values = reading
        if mode != self.mode:
            self.mode = mode
            self.chart.set_series(GPU_SERIES if mode == "gpu" else RAM_SERIES)
            self.processes.setVisible(mode == "gpu")
        self.chart.add_sample(values)
        if mode == "ram":
            reason = status.get("gpu_unavailable_reason") or "no NVIDIA GPU found"
            self.chart_note.setText(
                f"{reason[:1].upper()}{reason[1:]} — showing RAM instead of VRAM."
            )
            return
        gpu = status["gpu"]
        self.chart_note.setText(
            f"{gpu.name}: {gib_text(gpu.free_bytes)} free of {gib_text(gpu.total_bytes)}"
        )
        fill_table(self.processes, [
            (str(proc.pid), proc.name,
             f"{proc.used_bytes / 2**20:,.0f} MiB" if proc.used_bytes else "n/a")
            for proc in gpu.processes])

    def _apply_models(self, status: dict[str, Any]) -> None:
        """The library's models: state, VRAM held, size on disk, last use (the pool's rows)."""
        rows = model_rows(status)
        self.models_box.setVisible(bool(rows))
        self.models.setHorizontalHeaderLabels(
            [menu_model.memory_word(status) if c == "VRAM" else c for c in MODEL_COLUMNS])
        cells = []
        for row in rows:
            name = f"{row['name']} (default)" if row["is_default"] else str(row["name"])
            on_disk = gib_text(int(row["size_bytes"])) if row["is_downloaded"] \
                else "not downloaded"
            cells.append((name, state_label(str(row["state"])),
                          gib_text(int(row["vram_bytes"])), on_disk,
                          last_used_text(row["last_used_s"])))
        fill_table(self.models, cells)
        self.models_budget.setText(budget_text(status) if rows else "")

    def _apply_experts(self, status: dict[str, Any]) -> None:
        summary = expert_cache_view.summary_line(status)
        self.experts_box.setVisible(summary is not None)
        if summary is None:
            return
        self.experts_summary.setText(summary)
        fill_table(self.expert_layers, expert_cache_view.layer_rows(status))

    def _apply_levels(self, status: dict[str, Any]) -> None:
        for arena, label in self.level_labels.items():
            resident, released = (
                arena_bytes(status, arena),
                arena_bytes(status, arena, "released_bytes"),
            )
            where = "resident" if resident else ("released" if released else "empty")
            label.setText(f"{where} · {gib_text(resident)} in {menu_model.memory_word(status)} · "
                          f"{gib_text(released)} released")
        frees = {
            "experts": arena_bytes(status, "experts"),
            "offload": arena_bytes(status, "kv"),
            "sleep": menu_model.held_bytes(status),
            "load": menu_model.held_bytes(status),
        }
        for (slot, button), view in zip(
            self.level_buttons.items(), menu_model.lifecycle_actions(status)
        ):
            frees_text = (
                f" (frees {gib_text(frees[slot])})"
                if view.action in ("release_experts", "offload_session", "sleep", "unload")
                else ""
            )
            button.setText(view.label + frees_text)
            button.setEnabled(view.is_enabled)
            button.setToolTip(view.reason)
            button.setProperty("action", view.action)

    def _clicked(self, slot: str) -> None:
        action = self.level_buttons[slot].property("action")
        if action:
            self.bridge.request(action)

    def _tick(self) -> None:
        for bar in self.countdowns.values():
            bar.tick()
