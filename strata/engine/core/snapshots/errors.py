"""The two ways a snapshot fails: it cannot be trusted on read, or it could not be written."""

from __future__ import annotations

import errno

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


# Protocol error codes of a failed write: the server's fault, never the client's (a 5xx).
NO_SPACE_CODE = "insufficient_storage"  # ENOSPC, EDQUOT, or the disk budget is too small
STORAGE_ERROR_CODE = "storage_error"  # any other OS error: read-only, I/O error, permissions
_NO_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def storage_code(exc: BaseException) -> str:
    """The error code for an OS error while writing: insufficient_storage or storage_error."""
    return NO_SPACE_CODE if getattr(exc, "errno", None) in _NO_SPACE_ERRNOS else STORAGE_ERROR_CODE


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
