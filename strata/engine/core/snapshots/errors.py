"""The two ways a snapshot fails: it cannot be trusted on read, or it could not be written."""

from __future__ import annotations

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
    """Writing a snapshot failed (disk full, permissions, budget); the KV stayed in memory."""


class SnapshotNameError(StrataError, ValueError):
    """A slot file name that would leave the snapshot directory, or is empty or too long."""
