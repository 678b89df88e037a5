"""Error codes to HTTP: the one table for the whole host.

A code comes from the exception that failed (its `code` attribute: the engine's errors, the
service's ServiceError) or an engine Error event; the service's level and slot commands and the
API's generation errors all read this table, so a code answers the same status on every route.
Server-side faults are 5xx; only what the client can fix is 4xx.
"""

from __future__ import annotations

from dataclasses import dataclass


class ServiceError(Exception):
    """A failure the API answers with an HTTP error: `code` is a short machine word, and its
    HTTP status comes from CODES (one table), never from the raiser. retry_after_s: a
    Retry-After of the raiser's own (the guard's estimate), else the code's."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return http_status(self.code)


@dataclass(frozen=True)
class ErrorCode:
    """How one code answers: its HTTP status, when to retry, and what to advise."""

    status: int
    retry_after_s: float | None = None  # Retry-After of a transient fault
    advice: str = ""  # what the user can do, said after the engine's own reason
    # How a failed level or slot command (sleep, refill, slot_save, ...) words it, and the
    # code it answers with when that differs (out_of_memory is the service's insufficient_vram).
    level_message: str = "{what} failed in the engine: {message}"
    level_code: str | None = None


_STORAGE_MESSAGE = "{what} failed: {message} ({advice})"
CODES = {
    # the engine's (protocol.Error.code)
    "bad_request": ErrorCode(400, level_message="{what} failed: {message}"),
    "not_applicable": ErrorCode(400, level_message="{what} does not apply: {message}"),
    "busy": ErrorCode(409, level_message="{what}: {message}"),
    # A generation that finds no model raced an unload: the server's state, worth a retry.
    "not_loaded": ErrorCode(503),
    "out_of_memory": ErrorCode(
        503, advice="; close other GPU apps and retry", level_code="insufficient_vram",
        level_message="{what} failed, the GPU has too little free memory: {message}{advice}"),
    "unavailable": ErrorCode(503),
    "cancelled": ErrorCode(503),
    "engine_crashed": ErrorCode(503, 2.0, level_code="engine_unavailable",
                                level_message="{what} failed: {message}"),
    "not_running": ErrorCode(503, level_code="engine_unavailable",
                             level_message="{what} failed: {message}"),
    "engine_timeout": ErrorCode(503, 5.0),
    "insufficient_storage": ErrorCode(
        507, advice="the server's disk is full; free space in the snapshot directory",
        level_message=_STORAGE_MESSAGE),
    "read_only_storage": ErrorCode(
        500, advice="the server's snapshot directory is on a read-only file system; start "
                    "Strata with a writable --snapshot-dir", level_message=_STORAGE_MESSAGE),
    "storage_error": ErrorCode(
        500, advice="the server could not read or write its snapshot directory",
        level_message=_STORAGE_MESSAGE),
    "internal": ErrorCode(500),
    # the service's own (ServiceError.code)
    "insufficient_vram": ErrorCode(503, 5.0),  # waiting for VRAM: a state, retry later
    "engine_unavailable": ErrorCode(503),
    "not_started": ErrorCode(503),
    "model_unavailable": ErrorCode(503),
    "queue_full": ErrorCode(503),  # past --max-queue waiting requests; the gate's Retry-After
    "before_load_failed": ErrorCode(503),
    "bad_model": ErrorCode(400),
    "model_not_found": ErrorCode(404),  # a request's `model` names no model of the pool
}
_UNKNOWN = ErrorCode(500)


def http_status(code: str | None) -> int:
    """The HTTP status for an error code; unknown codes are server errors (500)."""
    return CODES.get(code or "", _UNKNOWN).status


def retry_after_s(code: str | None) -> float | None:
    """Seconds a client may retry after (Retry-After), None when a retry will not help."""
    return CODES.get(code or "", _UNKNOWN).retry_after_s


def level_error(action: str, code: str | None, message: str) -> ServiceError:
    """The HTTP-facing error for the engine's refusal of a level or slot command."""
    entry = CODES.get(code or "", _UNKNOWN)
    advice = "" if code == "out_of_memory" and "retry" in message else entry.advice
    answered = entry.level_code or code or "internal"
    text = entry.level_message.format(what=action.replace("_", " "), message=message,
                                      advice=advice)
    return ServiceError(answered, text, retry_after_s=retry_after_s(answered))
