"""The pieces of one engine process that the Supervisor tracks: its handle, how it ended,
and the two errors the Supervisor raises. Split from supervisor.py to keep that file about
the process lifecycle itself.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from strata.errors import StrataError


class EngineUnavailable(StrataError):
    """The engine could not be brought up; retry_after_s says when trying again makes sense."""

    def __init__(self, message: str, retry_after_s: float | None = None, *,
                 is_out_of_memory: bool = False):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.is_out_of_memory = is_out_of_memory  # VRAM was short: a refusal, not a crash


class EngineCommandError(StrataError):
    """The engine answered a command with an Error (or died before answering)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class EngineHandle:
    """One spawned engine process and what is waiting on it."""

    process: BaseProcess
    conn: Connection
    ready: asyncio.Future
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    waiters: dict[int, asyncio.Future] = field(default_factory=dict)
    is_alive: bool = True
    is_exit_expected: bool = False
    kill_reason: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid or 0


def describe_exit(exit_code: int | None) -> str:
    """How a process ended, in words: 'was killed by SIGKILL', 'exited with code 1'."""
    if exit_code is None:
        return "closed its pipe and did not exit"
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args: Any) -> bool:
    try:
        loop.call_soon_threadsafe(callback, *args)
        return True
    except RuntimeError:  # the loop is closed: the host is shutting down
        return False


def failure_message(exc: BaseException, load_timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"loading the model took longer than {load_timeout_s:.0f} s"
    if isinstance(exc, EngineCommandError) and exc.code != "engine_crashed":
        return f"loading the model failed ({exc.code}): {exc}"
    return str(exc)
