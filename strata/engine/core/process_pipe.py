"""The engine process's end of the pipe to the host.

Sends events, receives and polls for commands, and says whether the pipe has room to write
(a step's tokens go out while the host keeps up, else ride along with the next send). Any
failure of the pipe means the host is gone: HostGone, and the process exits.
"""

from __future__ import annotations

import logging
import select
import sys
from multiprocessing.connection import Connection
from typing import Any

from strata.engine import protocol as p

log = logging.getLogger("strata.engine.process")

_can_select_pipes = sys.platform != "win32"


class HostGone(Exception):
    """The host closed its end of the pipe: nobody is left to serve."""


def _stop_selecting_pipes(exc: BaseException) -> None:
    global _can_select_pipes
    _can_select_pipes = False
    log.info("select() cannot poll the engine pipe here (%s); tokens go out every step", exc)


class HostPipe:
    """The pipe's operations, each raising HostGone when the host has closed its end."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, event: p.Event) -> None:
        """Send one event to the host."""
        try:
            self.conn.send(event)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise HostGone() from exc

    def recv(self) -> Any:
        """The host's next message (an Envelope, unless the host is broken); blocks."""
        try:
            return self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise HostGone() from exc

    def poll(self, timeout_s: float) -> bool:
        """Whether a message arrives within timeout_s."""
        try:
            return self.conn.poll(timeout_s)
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise HostGone() from exc

    def is_writable(self) -> bool:
        """Whether a send would not block now (True where that cannot be told)."""
        # select() takes only sockets on Windows (WinError 10038 on a pipe), and there is no
        # portable "room to write" test: there, send every step (send blocks only once the
        # host is a whole pipe buffer behind).
        if not _can_select_pipes:
            return True
        try:
            _, writable, _ = select.select([], [self.conn.fileno()], [], 0)
        except (OSError, ValueError) as exc:
            _stop_selecting_pipes(exc)
            return True
        return bool(writable)
