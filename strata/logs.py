"""Where log lines go: stderr when the process has one, a rotating file when asked or when not.

Under pythonw (the Start menu, the installer's "Start now", the autostart Run key) sys.stderr
and sys.stdout are None: every log line and traceback would be lost and anything writing to
them (a progress bar) would raise. There the streams are replaced by writers into the log, so
prints and tracebacks land in the file too. stdlib only: the engine process uses it as well.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import threading
from pathlib import Path

from strata import paths

LOG_FILE_BYTES = 5 * 1024 * 1024
LOG_FILE_BACKUPS = 3
_FILE_PREFIX = "%(asctime)s "


def has_console() -> bool:
    """True when stderr reaches a person (a terminal, a pipe a caller reads), not our log."""
    return sys.stderr is not None and not isinstance(sys.stderr, _LogWriter)


def setup_logging(name: str, fmt: str, *, to_file: bool = False,
                  level: int = logging.INFO) -> Path | None:
    """Configure the root logger of process `name` (tray | serve | engine).

    Lines go to stderr when there is one, and to `<log_dir>/<name>.log` (rotating) when
    to_file or when there is no stderr. Returns the log file's path, or None without one.
    Like logging.basicConfig, the console part does nothing when the root logger already has
    handlers (pytest's, an embedding application's).
    """
    root = logging.getLogger()
    is_console_missing = sys.stderr is None
    log_path = None
    if to_file or is_console_missing:
        log_path = _add_file_handler(root, name, fmt)
    if is_console_missing:
        sys.stderr = _LogWriter(logging.getLogger(f"{name}.stderr"), logging.WARNING)
        if sys.stdout is None:
            sys.stdout = _LogWriter(logging.getLogger(f"{name}.stdout"), logging.INFO)
    elif not any(not isinstance(h, logging.FileHandler) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(fmt))
        root.addHandler(console)
    root.setLevel(level)
    return log_path


def _add_file_handler(root: logging.Logger, name: str, fmt: str) -> Path | None:
    directory = paths.log_dir()
    log_path = directory / f"{name}.log"
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log_path:
            return log_path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # delay: the file opens on the first line; engines share engine.log, and on Windows a
        # rotation while another process holds the file fails (logged by logging, not fatal).
        handler = logging.handlers.RotatingFileHandler(
            log_path, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS,
            encoding="utf-8", delay=True,
        )
    except OSError as exc:
        if sys.stderr is not None:
            print(f"strata: cannot write logs to {log_path}: {exc}", file=sys.stderr)
        return None
    handler.setFormatter(logging.Formatter(_FILE_PREFIX + fmt))
    root.addHandler(handler)
    return log_path


class _LogWriter:
    """A text stream that turns what is written to it into log records, one per line."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, logger: logging.Logger, level: int):
        self._logger = logger
        self._level = level
        self._pending = ""
        self._local = threading.local()  # logging's own error path writes to sys.stderr

    def write(self, text: str) -> int:
        if getattr(self._local, "busy", False):
            return len(text)
        self._local.busy = True
        try:
            *lines, self._pending = (self._pending + text).replace("\r", "\n").split("\n")
            for line in lines:
                if line.strip():
                    self._logger.log(self._level, "%s", line.rstrip())
        finally:
            self._local.busy = False
        return len(text)

    def flush(self) -> None:
        """Lines are logged as they complete; a partial line waits for its end."""

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True
