"""Engine error codes (protocol.Error.code) to HTTP statuses: the one table for the whole host.

The service's level and slot commands and the API's generation errors both read it, so a code
answers the same status on every route. Server-side faults are 5xx; only what the client can
fix is 4xx.
"""

from __future__ import annotations

ENGINE_CODE_STATUS = {
    "bad_request": 400, "not_applicable": 400, "busy": 409,
    # A generation that finds no model raced an unload: the server's state, worth a retry.
    "not_loaded": 503,
    "out_of_memory": 503, "unavailable": 503, "cancelled": 503, "engine_crashed": 503,
    "not_running": 503, "engine_timeout": 503,
    "insufficient_storage": 507, "read_only_storage": 500, "storage_error": 500,
    "internal": 500,
}
# Transient faults: the client may retry after this many seconds (Retry-After).
RETRY_AFTER_S = {"engine_timeout": 5.0, "engine_crashed": 2.0}
# What to tell the user for the storage codes, after the engine's own reason.
STORAGE_ADVICE = {
    "insufficient_storage": "the server's disk is full; free space in the snapshot directory",
    "read_only_storage": "the server's snapshot directory is on a read-only file system; "
                         "start Strata with a writable --snapshot-dir",
    "storage_error": "the server could not read or write its snapshot directory",
}


def http_status(code: str | None) -> int:
    """The HTTP status for an engine error code; unknown codes are server errors (500)."""
    return ENGINE_CODE_STATUS.get(code or "", 500)
