"""Killing a process the way a crash or the task manager would, on Linux and Windows alike."""

from __future__ import annotations

import sys

import psutil

# How the host describes an engine killed by kill_hard (engine_handle.describe_exit): a signal
# on POSIX; on Windows TerminateProcess leaves an exit code (psutil passes 15).
KILLED_WORDS = "exited with code" if sys.platform == "win32" else "SIGKILL"


def kill_hard(pid: int) -> None:
    """SIGKILL on POSIX, TerminateProcess on Windows (psutil); a gone process is no error."""
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass
