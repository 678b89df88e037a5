"""The engine process's error codes: what a failed command or request answers the host.

Every exception in the engine process becomes one Error event with a protocol code (the code
the exception carries, out_of_memory, a storage fault's code, bad_request, ...) and one line of
message; `internal` marks a bug, the only kind whose traceback goes to the log. It imports no
torch: the host side imports process.py, which imports this.
"""

from __future__ import annotations

import sys
from typing import Any

from strata.engine import protocol as p
from strata.engine.core.storage_codes import STORAGE_ERRNO_CODES
from strata.errors import StrataError


def one_line(exc: BaseException) -> str:
    """An exception as one line a user can read: the first line of its message, else its type."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class CommandRefused(Exception):
    """A command that cannot run in the current state; carries its protocol error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


# Storage faults are the server's, not the client's: codes of their own, so the host answers
# 5xx (507 for no space) rather than a 400 the client cannot fix.


def storage_error_code(exc: BaseException | None) -> str | None:
    """The storage code of an OSError in exc's cause chain (SnapshotWriteError wraps one)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNO_CODES:
            return STORAGE_ERRNO_CODES[exc.errno]
        exc = exc.__cause__ or exc.__context__
    return None


def error_code(exc: BaseException, command: Any) -> str:
    """The protocol error code for an exception raised while running `command`: the `code` the
    exception carries (EngineError subclasses, ArenaMapError, ...), else by its type, never by
    its class name (tests/core/test_process_errors.py checks)."""
    storage_code = None if isinstance(command, p.Load) else storage_error_code(exc)
    if storage_code is not None and not isinstance(exc, CommandRefused):
        return storage_code
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code.isidentifier() and code.islower():
        return code
    if isinstance(exc, (MemoryError, *_torch_out_of_memory_types())):
        return "out_of_memory"
    # The engine's own user-facing errors (StrataError) and bad model files (ModelFormatError,
    # a ValueError) are the caller's to fix, not bugs.
    if isinstance(exc, (StrataError, ValueError, OSError)):
        return "load_failed" if isinstance(command, p.Load) else "bad_request"
    return "internal"


def _torch_out_of_memory_types() -> tuple[type[BaseException], ...]:
    """torch's CUDA out-of-memory error, when torch is imported (a standby may not have it)."""
    torch = sys.modules.get("torch")
    error = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return (error,) if isinstance(error, type) else ()
