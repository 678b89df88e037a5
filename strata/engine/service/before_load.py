"""The before-load hook: a user command run before a load or wake, e.g. to ask ComfyUI to free.

The command is an argv list, or a string split the way the platform's programs split their
command line: shlex's POSIX rules on Linux, the Microsoft C runtime's on Windows (mslex: POSIX
rules would eat the backslashes of C:\\Tools\\free.exe). It runs without a shell, so nothing in
it is interpreted. Its outcome is kept for /v1/status (`last_hook`). A failure or timeout is
logged and does not stop the load unless the hook is required; a timeout kills the command and
every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from strata.engine.service.env_names import API_KEY_ENV
from strata.engine.service.facade import ServiceError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_KILL_GRACE_S = 2.0  # after a kill, how long to wait for the pipes to close


@dataclass(frozen=True)
class HookResult:
    """One run of the hook: ok, its exit code (None: it did not run or was killed), seconds."""

    ok: bool
    rc: int | None
    s: float
    error: str | None = None
    reason: str = "load"  # load | wake: what it ran before

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_windows() -> bool:
    return sys.platform == "win32"


# subprocess.CREATE_NO_WINDOW (Windows only, so not importable here): a console program
# started by the windowless tray (pythonw) would otherwise flash a console window per load.
CREATE_NO_WINDOW = 0x08000000


def spawn_options() -> dict[str, Any]:
    """Extra create_subprocess_exec arguments for the hook: no console window on Windows;
    a session of its own on POSIX, so a timeout can end the command's process group."""
    if _is_windows():
        return {"creationflags": CREATE_NO_WINDOW}
    return {"start_new_session": True}


def split_command(command: str) -> list[str]:
    """A command line as argv, by this platform's rules (see the module docstring).

    Raises ValueError on an unbalanced quote."""
    if _is_windows():
        import mslex

        # like_cmd=False: the string never goes through cmd.exe, so ^ and % are literal.
        return mslex.split(command, like_cmd=False)
    return shlex.split(command)


def command_argv(command: str | Sequence[str] | None) -> list[str] | None:
    """The hook command as argv: a string is split by split_command, a list taken as it is."""
    if command is None:
        return None
    argv = split_command(command) if isinstance(command, str) else [str(a) for a in command]
    return argv or None


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


class BeforeLoadHook:
    """Runs the configured command before a load or wake; `last` holds the latest outcome."""

    def __init__(
        self,
        command: str | Sequence[str] | None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        is_required: bool = False,
    ):
        self.argv = command_argv(command)
        self.timeout_s = timeout_s
        self.is_required = is_required
        self.last: HookResult | None = None

    @property
    def is_configured(self) -> bool:
        return self.argv is not None

    def status(self) -> dict[str, Any] | None:
        """The last run as {ok, rc, s, error, reason}, or None when it never ran."""
        return self.last.as_dict() if self.last else None

    async def run(self, reason: str) -> HookResult | None:
        """Run the command (reason: load | wake); None when no command is configured.

        Raises ServiceError("before_load_failed") when it fails and the hook is required.
        """
        if self.argv is None:
            return None
        started_s = time.monotonic()
        rc, error = await self._execute(reason)
        result = HookResult(error is None, rc, round(time.monotonic() - started_s, 3), error, reason)
        self.last = result
        if result.ok:
            log.info("before-load command finished in %.2f s", result.s)
            return result
        log.warning("before-load command %s (before %s)", error, reason)
        if self.is_required:
            raise ServiceError("before_load_failed",
                f"the before-load command {self.argv[0]!r} {error}; fix it, or drop "
                "--before-load-required to load anyway",
            )
        return result

    async def _execute(self, reason: str) -> tuple[int | None, str | None]:
        """(exit code, error text or None) of one run, killing it past the timeout."""
        assert self.argv is not None
        # The hook has no use for the server's API key: it does not inherit it.
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {"STRATA_BEFORE": reason}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, **spawn_options(),
            )
        except OSError as exc:
            return None, f"could not start: {exc.strerror or exc}"
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), self.timeout_s)
        except TimeoutError:
            await self._kill(process)
            return None, f"timed out after {self.timeout_s:g} s and was killed"
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(process))
            raise
        if process.returncode != 0:
            detail = _last_line(stderr)
            return process.returncode, f"exited with code {process.returncode}" + (
                f": {detail}" if detail else ""
            )
        return 0, None

    async def _kill(self, process: asyncio.subprocess.Process) -> None:
        if process.returncode is not None:
            return
        _kill_tree(process.pid)
        try:
            await asyncio.wait_for(process.communicate(), _KILL_GRACE_S)
        except (TimeoutError, ValueError):
            log.warning("the before-load command (pid %d) did not exit after a kill", process.pid)


def _kill_tree(pid: int) -> None:
    """Kill a process and everything it started: its process group where there are groups,
    and its descendants by parent id (Windows, and children that left the group)."""
    try:
        parent = psutil.Process(pid)
        victims = [parent, *parent.children(recursive=True)]  # listed before the parent dies
    except psutil.Error:
        victims = []
    if hasattr(os, "killpg") and hasattr(signal, "SIGKILL"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # its own group: start_new_session
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()  # TerminateProcess on Windows; psutil checks the pid was not reused
