"""Coming back up a level (DESIGN §4): load, wake and refill, each behind the before-load hook
and the free-VRAM guard, so a failure is a clean ServiceError before any event and the level
stays where it was; and the sessions a rule's unload keeps over it.

A part of Lifecycle (lifecycle.py), split out by job; it runs under the caller's gate and never
takes it itself.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from strata.engine import protocol as p
from strata.engine.service.before_load import BeforeLoadHook
from strata.engine.service.error_codes import level_error
from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, Level, Levels
from strata.engine.service.lifecycle_idle import IdleTimers
from strata.engine.service.load_size import COME_BACK_WORKSPACE_BYTES, load_bytes
from strata.engine.service.supervisor import EngineCommandError, EngineUnavailable, Supervisor
from strata.engine.service.vram_guard import VramGuard

log = logging.getLogger(__name__)

KEPT_SLOT_FILE = "strata-kept-slot{slot}.snap"  # a rule's unload keeps the sessions here
# What each way back maps again, by arena.
_COME_BACK_ARENAS = {Action.WAKE: ("weights", "experts", "kv"),
                     Action.REFILL_EXPERTS: ("experts",)}


class ComingBack:
    """Lifecycle's way back up; the attributes below are Lifecycle's."""

    supervisor: Supervisor
    guard: VramGuard
    hook: BeforeLoadHook
    keep_standby: bool
    timers: IdleTimers
    engine: p.EngineStatus | None
    transition: str | None
    last_error: str | None
    waiting_for_vram: dict[str, Any] | None
    _vram_wait_s: float | None
    _kept_slots: list[int]
    _load_need_bytes: int | None

    # Lifecycle's methods (it overrides each), declared for the type checker.
    def is_up(self) -> bool:
        raise NotImplementedError

    def levels(self) -> Levels:
        raise NotImplementedError

    def _notify(self) -> None: ...
    def _mark_activity(self) -> None: ...
    async def _refresh(self) -> None: ...

    async def _engine_level(self, action: Action) -> dict[str, Any]:
        raise NotImplementedError

    async def _bring_back(self, *, need_experts: bool) -> None:
        if not self.is_up():
            await self._load()
        if self.levels().weights == Level.SLEEPING:
            await self._come_back(Action.WAKE, "wake the model")
        if need_experts and self.levels().experts == Level.RELEASED:
            await self._come_back(Action.REFILL_EXPERTS, "refill the experts")

    async def _load(self) -> None:
        supervisor = self.supervisor
        async with self._coming_back("loading"):
            # While the supervisor backs off after crashes, ensure_loaded refuses at once: no
            # point in running the hook or waiting for VRAM first.
            if not (supervisor.state == "failed" and supervisor.retry_in_s > 0):
                await self.hook.run("load")
                await self._wait_for_vram("load the model", self._load_bytes())
            try:
                await supervisor.ensure_loaded()
            except EngineUnavailable as exc:
                if exc.is_out_of_memory:  # the engine found too little VRAM: not a crash
                    if self.keep_standby:
                        await supervisor.start_standby()
                    self.waiting_for_vram = {"what": "load the model", "reason": str(exc)}
                    raise ServiceError("insufficient_vram", f"cannot load the model yet: "
                                       f"{exc}; waiting for VRAM, retry later",
                                       retry_after_s=exc.retry_after_s) from None
                raise ServiceError("engine_unavailable", str(exc),
                                   retry_after_s=exc.retry_after_s) from None
            if self.engine is None or self.engine.pid != supervisor.pid:
                self.timers.forget_inapplicable()  # a new process: every level applies again
            await self._restore_kept_slots()
            await self._refresh()

    @contextlib.asynccontextmanager
    async def _coming_back(self, transition: str):
        """Show the transition while a level comes back; record its error, or clear the last
        one and count the step as activity (idle timers start again from here)."""
        self.transition = transition
        self._notify()
        try:
            yield
        except ServiceError as exc:
            if exc.code == "insufficient_vram":
                self.waiting_for_vram = self.waiting_for_vram or {
                    "what": transition, "reason": exc.message}
            else:
                self.last_error = exc.message
            raise
        finally:
            self.transition = None
        self.last_error = None
        self.waiting_for_vram = None
        self._mark_activity()

    async def _come_back(self, action: Action, what: str) -> None:
        """wake or refill_experts: the hook (wake), the guard for what it maps, the command."""
        async with self._coming_back("waking"):
            if action is Action.WAKE:
                await self.hook.run("wake")
            need_bytes = sum(self.engine.arenas[name].released_bytes
                             for name in _COME_BACK_ARENAS[action]
                             if self.engine is not None and name in self.engine.arenas)
            await self._wait_for_vram(
                what, need_bytes + COME_BACK_WORKSPACE_BYTES if need_bytes else 0)
            await self._engine_level(action)

    def _load_bytes(self) -> int:
        """What a load maps (load_size.load_bytes), computed once per model."""
        if self._load_need_bytes is None:
            self._load_need_bytes = load_bytes(self.supervisor.engine_config)
        return self._load_need_bytes

    async def _wait_for_vram(self, what: str, need_bytes: int) -> None:
        """The guard, recording a refusal as the waiting_for_vram state."""
        try:
            await self.guard.wait_for_room(what, need_bytes, self._vram_wait_s)
        except ServiceError as exc:
            self.waiting_for_vram = {"what": what, "reason": exc.message}
            log.info("%s", exc.message)  # working as designed: one line, no traceback
            raise

    # ---- sessions kept over a rule's unload ------------------------------------------------

    async def _restore_kept_slots(self) -> None:
        kept, self._kept_slots = self._kept_slots, []
        for slot in kept:
            try:
                await self.supervisor.command(
                    p.RestoreSlot(slot, KEPT_SLOT_FILE.format(slot=slot)))
            except (EngineCommandError, TimeoutError) as exc:
                log.info("slot %d's kept session was not restored (%s); it starts afresh",
                         slot, exc)


def engine_level_error(action: Action | str, exc: EngineCommandError) -> ServiceError:
    """The HTTP-facing error for the engine's refusal of a level or slot command."""
    return level_error(str(action), exc.code, str(exc))
