"""The settings window's Models tab: pull a model from the Hugging Face hub, with progress."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from strata.app.pull_runner import PullRunner
from strata.library.pull import PullProgress
from strata.paths import model_cache_dir

_MIB = 1 << 20
_EXAMPLE = "bartowski/Qwen_Qwen3-8B-GGUF:Q4_K_M"


def progress_text(report: PullProgress) -> str:
    """"tiny-Q8_0.gguf (1/3): 12 of 800 MiB", or "verifying ..." once it has arrived."""
    name = Path(report.file.name).name
    which = f" ({report.file_index + 1}/{report.num_files})" if report.num_files > 1 else ""
    if report.phase == "verifying":
        return f"verifying {name}{which}"
    total = f" of {report.total_bytes / _MIB:,.0f}" if report.total_bytes else ""
    return f"{name}{which}: {report.completed_bytes / _MIB:,.0f}{total} MiB"


class PullPanel(QWidget):
    """A REPO[:FILE] field, Pull and Cancel, a progress bar and a one-line message."""

    pulled = Signal(str)  # the path of the new model, once it has arrived and been checked

    def __init__(self, models_dir: Callable[[], Path] | None = None,
                 parent: QWidget | None = None):
        """models_dir: where pulls go now (the running server's library)."""
        super().__init__(parent)
        self._models_dir = models_dir or model_cache_dir
        self.spec = QLineEdit()
        self.spec.setPlaceholderText(f"OWNER/REPO or OWNER/REPO:QUANT, e.g. {_EXAMPLE}")
        self.spec.returnPressed.connect(self.start_pull)
        self.pull_button = QPushButton("Pull")
        self.pull_button.clicked.connect(self.start_pull)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel_pull)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setValue(0)
        self.bar.setTextVisible(True)
        self.bar.setFormat("")
        self.message = QLabel("")
        # One line that never widens the window: a long error is cut, whole in the tooltip.
        self.message.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.runner = PullRunner(self)
        self.runner.progress.connect(self._progress)
        self.runner.finished.connect(self._finished)
        self.runner.failed.connect(self._failed)
        self.runner.cancelled.connect(self._cancelled)
        self._build()

    def _build(self) -> None:
        row = QHBoxLayout()
        row.addWidget(self.spec, 1)
        row.addWidget(self.pull_button)
        row.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        intro = QLabel("Fetch a GGUF or a Hugging Face model from the Hugging Face hub "
                       "(HF_ENDPOINT and HF_TOKEN are honoured) into the model library.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        layout.addLayout(row)
        layout.addWidget(self.bar)
        layout.addWidget(self.message)
        layout.addStretch(1)

    def start_pull(self) -> None:
        spec = self.spec.text().strip()
        if not spec:
            self._say(f"Name a model first, e.g. {_EXAMPLE}", is_error=True)
            return
        if self.runner.is_running:
            return
        self._set_running(True)
        self.bar.setValue(0)
        self.bar.setFormat("listing the repository…")
        self._say("")
        self.runner.start(spec, self._models_dir())

    def cancel_pull(self) -> None:
        self.cancel_button.setEnabled(False)
        self.bar.setFormat("cancelling…")
        self.runner.cancel()

    def _progress(self, report: PullProgress) -> None:
        if report.total_bytes:
            self.bar.setValue(int(1000 * report.completed_bytes / report.total_bytes))
        self.bar.setFormat(progress_text(report))

    def _finished(self, path: str) -> None:
        self._set_running(False)
        self.bar.setValue(1000)
        self.bar.setFormat("done")
        self._say(f"Pulled into {path}")
        self.pulled.emit(path)

    def _failed(self, message: str) -> None:
        self._set_running(False)
        self.bar.setFormat("failed")
        self._say(message, is_error=True)

    def _cancelled(self) -> None:
        self._set_running(False)
        self.bar.setValue(0)
        self.bar.setFormat("")
        self._say("Cancelled; a later pull fetches the file from its start.")

    def _set_running(self, is_running: bool) -> None:
        self.pull_button.setEnabled(not is_running)
        self.spec.setEnabled(not is_running)
        self.cancel_button.setEnabled(is_running)

    def _say(self, text: str, is_error: bool = False) -> None:
        self.message.setStyleSheet("color: #da3633" if is_error else "")
        self.message.setText(text)
        self.message.setToolTip(text)
