"""The one base class for errors whose message is meant for the user."""

from __future__ import annotations


class StrataError(Exception):
    """A failure the user can act on: the message says what failed, why and what to do.

    The CLI prints it as one line; the API turns it into a JSON error. Anything else is a bug
    and keeps its traceback in the log.
    """


def user_message(exc: BaseException) -> str | None:
    """The one-line message of a StrataError, None for anything else."""
    if isinstance(exc, StrataError):
        text = str(exc)
        return text.splitlines()[0] if text else type(exc).__name__
    return None
