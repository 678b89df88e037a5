"""Watch processes start and exit, cheaply enough to poll ten times a second.

Each tick lists the pids (psutil.pids(): one directory listing of /proc on Linux) and reads the
details (name, executable, argv, working directory) of new pids only, so a tick costs about
one listing however many processes run. A pid is read again while it is young (its first
`young_s` seconds): a fork shows the parent's image until it execs, and a launcher may exec a
second time (`env python main.py`). Linux's proc connector would push these events instead,
but it needs CAP_NET_ADMIN; polling the pid list measured cheap (docs/benchmarks.md).

The watcher runs in its own daemon thread and hands events to listeners there; the rules
engine passes them to its asyncio loop with call_soon_threadsafe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

INTERVAL_S = 0.1
YOUNG_S = 1.0


@dataclass(frozen=True)
class ProcessInfo:
    """What a rule pattern may match: name, executable path, argv and working directory."""

    pid: int
    name: str
    exe: str = ""
    cmdline: str = ""
    argv: tuple[str, ...] = ()
    cwd: str = ""

    @property
    def args(self) -> tuple[str, ...]:
        """argv, or the command line split on spaces where only that is known."""
        return self.argv or tuple(self.cmdline.split())


@dataclass(frozen=True)
class ProcessEvent:
    """kind: "seen" (a new pid, or a young one that exec'd: info changed) or "gone"."""

    kind: str
    pid: int
    info: ProcessInfo | None = None
    at_s: float = 0.0  # time.monotonic() of the tick that saw it


def read_process(pid: int) -> ProcessInfo | None:
    """The details of one process, or None when it is gone; fields it may not read stay ""."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            name = proc.name()
            argv = _try(proc.cmdline, [])
            exe = _try(proc.exe, "")
            cwd = _try(proc.cwd, "")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.Error:
        return None
    argv = tuple(str(a) for a in argv or ())
    return ProcessInfo(pid, name or "", exe or "", " ".join(argv), argv, cwd or "")


def _try(getter: Callable, default):
    # Another user's process hides its exe and cwd (AccessDenied); its name and argv still show.
    try:
        return getter()
    except (psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return default


Listener = Callable[[list[ProcessEvent]], None]


class ProcessWatcher:
    """Polls the pid list every interval_s and reports new and exited processes to listeners.

    `scan()` does one tick synchronously (tests call it directly); `start()` runs ticks in a
    daemon thread until `stop()`. The first tick reports every running process as "seen".
    """

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        *,
        young_s: float = YOUNG_S,
        list_pids: Callable[[], Iterable[int]] = psutil.pids,
        reader: Callable[[int], ProcessInfo | None] = read_process,
        is_first_reported: bool = True,
    ):
        """is_first_reported=False: what runs at the first tick is the baseline, and only
        processes that appear later are reported (the GPU watcher: a desktop's compositor
        was using the GPU before Strata started and is not "another program starting")."""
        self.interval_s = interval_s
        self.is_first_reported = is_first_reported
        self.young_s = young_s
        self.list_pids = list_pids
        self.reader = reader
        self.listeners: list[Listener] = []
        self.known: dict[int, ProcessInfo | None] = {}  # pid -> its details (None: unreadable)
        self._young: dict[int, float] = {}  # pid -> monotonic time first seen
        self.num_ticks = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def running(self) -> list[ProcessInfo]:
        """The processes known at the last tick (readable ones)."""
        return [info for info in self.known.values() if info is not None]

    def scan(self) -> list[ProcessEvent]:
        """One tick: read new pids, re-read young ones, note exits; returns (and reports) events."""
        now_s = time.monotonic()
        is_first = self.num_ticks == 0
        self.num_ticks += 1
        pids = set(self.list_pids())
        events: list[ProcessEvent] = []
        for pid in list(self.known):
            if pid not in pids:
                del self.known[pid]
                self._young.pop(pid, None)
                events.append(ProcessEvent("gone", pid, at_s=now_s))
        for pid in self._young.copy():
            if now_s - self._young[pid] > self.young_s:
                del self._young[pid]
                continue
            info = self.reader(pid)
            if info is not None and info != self.known.get(pid):
                self.known[pid] = info
                events.append(ProcessEvent("seen", pid, info, now_s))
        for pid in pids - self.known.keys():
            info = self.reader(pid)
            self.known[pid] = info
            if not is_first:
                self._young[pid] = now_s
            if info is not None and (self.is_first_reported or not is_first):
                events.append(ProcessEvent("seen", pid, info, now_s))
        if events:
            self._report(events)
        return events

    def _report(self, events: list[ProcessEvent]) -> None:
        for listener in list(self.listeners):
            try:
                listener(events)
            except Exception:  # one broken listener must not stop the watching
                log.exception("a process-watch listener failed")

    def start(self) -> None:
        """Tick in a daemon thread until stop()."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="strata-process-watch",
                                         daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan()
            except Exception:  # e.g. /proc unreadable for a moment: keep watching
                log.exception("process watch: a tick failed; trying again")
            self._stop.wait(self.interval_s)
