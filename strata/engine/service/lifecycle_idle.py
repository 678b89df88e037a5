"""The idle timers of DESIGN §4: each level goes down by itself after its idle seconds.

Only the clocks live here: when each timer is due, which fired in this idle period, and the
task that waits for the next one. Firing goes through the lifecycle (its gate, its level
change), which this file never touches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, Levels, is_level_reached

log = logging.getLogger(__name__)

# (countdown key in status()["idle"], settings field, the action it fires), shallow to deep.
IDLE_TIMERS = (
    ("cache_release", "cache_release_idle_s", Action.RELEASE_EXPERTS),
    ("session_offload", "session_offload_idle_s", Action.OFFLOAD_SESSION),
    ("sleep", "sleep_idle_s", Action.SLEEP),
    ("unload", "idle_unload_s", Action.UNLOAD),
)
# fire(action, cause, is_stale): go down; is_stale() says a request came meanwhile.
FireFn = Callable[[Action, str, Callable[[], bool]], Awaitable[None]]


class IdleTimers:
    """Countdowns per level, restarted by every activity; one task fires the next due."""

    def __init__(self, timeouts_s: dict[str, float | None], *, is_paused: Callable[[], bool],
                 is_up: Callable[[], bool], levels: Callable[[], Levels], fire: FireFn):
        """timeouts_s: countdown key -> seconds, None = off. is_paused(): a request or a step
        back up is under way (the clocks start when it ends)."""
        self.timeouts_s = {key: timeouts_s.get(key) for key, _, _ in IDLE_TIMERS}
        self._is_paused, self._is_up, self._levels, self._fire_level = (
            is_paused, is_up, levels, fire)
        self.idle_since_s: float | None = None  # monotonic end of the last activity
        self._epoch = 0  # bumped by every activity: a timer fires once per idle period
        self._fired_s: dict[str, float] = {}  # timer key -> monotonic time it fired
        self._inapplicable: set[str] = set()  # timers the engine said do not apply, until load
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._is_stopping = False

    # ---- reading ---------------------------------------------------------------------------

    def _countdowns_s(self) -> dict[str, float | None]:
        levels, now_s, is_up = self._levels(), time.monotonic(), self._is_up()
        countdowns: dict[str, float | None] = {}
        for key, _, action in IDLE_TIMERS:
            timeout_s = self.timeouts_s[key]
            if (timeout_s is None or not is_up or key in self._inapplicable
                    or key in self._fired_s or is_level_reached(action, levels)):
                countdowns[key] = None
            elif self._is_paused() or self.idle_since_s is None:
                countdowns[key] = timeout_s  # the clock starts when the activity ends
            else:
                countdowns[key] = max(0.0, self.idle_since_s + timeout_s - now_s)
        return countdowns

    def countdowns(self) -> dict[str, float | None]:
        """Seconds until each idle timer fires; None when off, not applicable or reached."""
        return {k: None if v is None else round(v, 3) for k, v in self._countdowns_s().items()}

    def fired(self) -> dict[str, float]:
        """Timers that fired in this idle period: seconds since each fired. They run again
        once the next request (or load, wake) has ended."""
        now_s = time.monotonic()
        return {key: round(now_s - fired_s, 3) for key, fired_s in self._fired_s.items()}

    # ---- changing --------------------------------------------------------------------------

    def mark_activity(self) -> None:
        """A request ended or the model came back: every idle clock starts again."""
        self.idle_since_s = time.monotonic()
        self._epoch += 1
        self._fired_s.clear()
        self.changed.set()

    def forget_inapplicable(self) -> None:
        """A new engine process: every timer applies again until it says otherwise."""
        self._inapplicable.clear()

    def set_timeout(self, key: str, seconds: float | None) -> None:
        """Change one idle timer (cache_release, ..., unload) at run time; None turns it off."""
        if key not in self.timeouts_s:
            raise ValueError(f"no idle timer {key!r}")
        self.timeouts_s[key] = seconds
        self._fired_s.pop(key, None)
        self.changed.set()
        self.start()

    # ---- the task --------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None and any(v is not None for v in self.timeouts_s.values()):
            self._task = asyncio.create_task(self._run(), name="strata-idle-timers")

    async def stop(self) -> None:
        if self._task is not None:
            # Python 3.11's wait_for swallows a cancel that lands as its inner wait completes
            # (an unload just set `changed`; cpython#86296): the flag ends the loop regardless.
            self._is_stopping = True
            self.changed.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _next_due(self) -> tuple[str, Action, float] | None:
        """(key, action, seconds until due) of the next timer; the deepest wins a tie."""
        if self._is_paused():
            return None
        candidates = [
            (left_s, -i, key, action)
            for i, (key, _, action) in enumerate(IDLE_TIMERS)
            if (left_s := self._countdowns_s()[key]) is not None
        ]
        if not candidates:
            return None
        left_s, _, key, action = min(candidates)
        return key, action, left_s

    async def _run(self) -> None:
        while not self._is_stopping:
            self.changed.clear()
            due = self._next_due()
            if due is None:
                await self.changed.wait()
                continue
            key, action, left_s = due
            if left_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left_s)
                continue
            try:
                await self._fire(key, action)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one firing must not end the timers
                log.exception("idle timer %s failed", key)

    async def _fire(self, key: str, action: Action) -> None:
        epoch = self._epoch
        self._fired_s[key] = time.monotonic()  # once per idle period, whatever the outcome
        cause = f"idle for {self.timeouts_s[key]:g} s"
        try:
            await self._fire_level(action, cause, lambda: epoch != self._epoch)
        except ServiceError as exc:
            if exc.code != "not_applicable":
                return  # the lifecycle recorded and logged the failure
            self._inapplicable.add(key)
            del self._fired_s[key]  # it never ran: do not report it as fired
            log.info("idle %s does not apply: %s", action, exc.message)
