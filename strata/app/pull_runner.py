"""Runs `strata pull`'s pull() on a worker thread for the settings window; results come back
as signals (emitted on the worker thread, delivered on the Qt thread)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from strata.errors import user_message
from strata.library.pull import PullCancelled, PullProgress, pull

log = logging.getLogger(__name__)
_PROGRESS_INTERVAL_S = 0.1  # a progress signal at most this often (a file's last always)


class PullRunner(QObject):
    """One pull at a time; cancel() stops it at its next chunk."""

    progress = Signal(object)  # PullProgress
    finished = Signal(str)  # the pulled GGUF file or HF directory
    failed = Signal(str)  # one line for the user
    cancelled = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._last_sent_s = 0.0

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, spec: str, models_dir: Path) -> None:
        """Pull spec into models_dir on a new thread; refused while one runs."""
        if self.is_running:
            raise RuntimeError("a pull is running")
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(spec, models_dir, self._cancel),
                                        name="strata-pull", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancel.set()

    def wait(self, timeout_s: float = 10.0) -> None:
        """Join the worker (tests, quitting); a transfer stopped by cancel() ends quickly."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, spec: str, models_dir: Path, cancel: threading.Event) -> None:
        try:
            path = pull(spec, models_dir, progress=False, on_progress=self._report,
                        cancel=cancel)
        except PullCancelled:
            self.cancelled.emit()
        except Exception as exc:  # every failure becomes the window's one line
            message = user_message(exc)
            if not message:
                log.exception("pull of %s failed", spec)
            self.failed.emit(message or f"{type(exc).__name__}: {exc}")
        else:
            self.finished.emit(str(path))

    def _report(self, report: PullProgress) -> None:
        now_s = time.monotonic()
        is_edge = report.completed_bytes in (0, report.total_bytes) or report.phase != \
            "downloading"
        if is_edge or now_s - self._last_sent_s >= _PROGRESS_INTERVAL_S:
            self._last_sent_s = now_s
            self.progress.emit(report)
