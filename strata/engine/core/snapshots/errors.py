"""The two ways a snapshot fails: it cannot be trusted on read, or it could not be written."""

from __future__ import annotations

from strata.engine.core.storage_codes import (  # noqa: F401 - re-exported
    NO_SPACE_CODE,
    READ_ONLY_CODE,
    STORAGE_ERROR_CODE,
    storage_code,
)
from strata.errors import StrataError

# Why a snapshot was refused; the slot then starts from an empty history.
INVALID_REASONS = (
    "missing", "truncated", "corrupt", "other_version", "other_model", "other_layout", "expired",
)


class SnapshotInvalid(StrataError):
    """A snapshot that failed verification; `reason` is one of INVALID_REASONS."""

    def __init__(self, reason: str, detail: str):
        if reason not in INVALID_REASONS:
            raise ValueError(f"unknown snapshot failure reason {reason!r}")
        super().__init__(f"KV snapshot rejected ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class SnapshotWriteError(StrataError):
    """Writing a snapshot failed (disk full, permissions, budget); the KV stayed in memory.

    `code` is the protocol error code the engine process answers with (a server-side fault).
    """

    def __init__(self, message: str, code: str = STORAGE_ERROR_CODE):
        super().__init__(message)
        self.code = code
        self.failed_slots: list[int] = []  # an offload of several slots: the ones kept

    @classmethod
    def from_os_error(cls, what: str, exc: OSError) -> SnapshotWriteError:
        """One line naming what failed and the OS reason; the code says no space or other."""
        advice = ("free disk space or raise the quota" if storage_code(exc) == NO_SPACE_CODE
                  else "check the snapshot directory (--snapshot-dir): it must be writable")
        return cls(f"{what}: {exc.strerror or exc}; {advice}", storage_code(exc))


class SnapshotNameError(StrataError, ValueError):
    """A slot file name that would leave the snapshot directory, or is empty or too long."""
